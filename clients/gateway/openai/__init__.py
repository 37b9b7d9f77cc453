"""OpenAI's Chat Completions, Completions and Embeddings (api.py)."""
