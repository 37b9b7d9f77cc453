"""OpenAI's Responses API, its chains kept as sessions (api.py)."""
