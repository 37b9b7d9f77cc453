"""OpenAI's Chat Completions, Completions and Embeddings: the routes (router.py), the request
bodies (schema.py), their translation onto turns (api.py)."""
