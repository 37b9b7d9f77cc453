"""llama-server's native API: the routes, in its error shape (router.py), its bodies read in
settings.py, their translation onto turns (api.py), its slots as sessions (slots.py)."""
