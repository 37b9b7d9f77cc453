"""Limits that a service and the HTTP edge both apply, defined once (stdlib only: the client
package imports it without the services' dependencies)."""

from __future__ import annotations

DEFAULT_MAX_IMAGES = 64  # per request: prep's --max-images, and the edge's before any fetch

# a GenerateRequest's, as infer checks them (the edge refuses past them before calling)
MAX_TOKENS = 1 << 20  # a reply's tokens
MAX_TOP_LOGPROBS = 20  # the likeliest tokens shown beside each one sampled
MAX_TURN_NOTE = 64 << 10  # bytes of a session turn's note
MAX_CACHE_SALT = 256  # characters
MAX_DRAFTS = 64  # per step: a slot's drafts take that much of the step's batch at most
MAX_NGRAM = 64  # speculative ngram_size_n

MAX_TITLE_CHARS = 200  # a session's title
MIN_WATCH_MS, DEFAULT_WATCH_MS = 100, 250  # WatchSlots' min_interval_ms
