"""Anthropic's Messages API: the routes, in its error shape (router.py), the request bodies
(schema.py), their translation onto turns (api.py)."""
