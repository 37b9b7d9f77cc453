"""Anthropic's Messages API (api.py)."""
