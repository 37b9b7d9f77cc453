"""OpenAI's Responses API, its chains kept as sessions: the routes (router.py), the request
body (schema.py), its translation onto turns (api.py)."""
