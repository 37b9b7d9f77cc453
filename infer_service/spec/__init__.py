"""Speculative decoding's proposers: drafts from the sequence's own tokens. Pure Python."""
