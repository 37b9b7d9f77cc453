"""llama-server's answers on the tiny model (record.py), which the native API tests compare."""
