"""llama-server's native API (api.py): its bodies read in settings.py, its slots as sessions
in slots.py."""
