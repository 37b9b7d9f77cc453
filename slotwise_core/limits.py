"""Limits that a service and the HTTP edge both apply, defined once (stdlib only: the client
package imports it without the services' dependencies)."""

from __future__ import annotations

DEFAULT_MAX_IMAGES = 64  # per request: prep's --max-images, and the edge's before any fetch
# per request: prep's --max-messages, and the edge's before anything is read of them (a chat
# of more is refused; its template renders each message, and sessions keep their boundaries)
DEFAULT_MAX_MESSAGES = 4096

# a GenerateRequest's, as infer checks them (the edge refuses past them before calling)
MAX_TOKENS = 1 << 20  # a reply's tokens
MAX_TOP_LOGPROBS = 20  # the likeliest tokens shown beside each one sampled
MAX_TURN_NOTE = 64 << 10  # bytes of a session turn's note
MAX_CACHE_SALT = 256  # characters
MAX_DRAFTS = 64  # per step: a slot's drafts take that much of the step's batch at most
MAX_NGRAM = 64  # speculative ngram_size_n

# prep's TokenizeBatch: texts in one call (a prompt of texts and ids mixed, logit_bias texts)
MAX_TOKENIZE_TEXTS = 1 << 16

MAX_TITLE_CHARS = 200  # a session's title
# a session's id as infer takes it (infer_service/sessions/store.py): the edge refuses any other
# before it goes into a call's metadata (a NUL there fails the call inside grpc)
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MIN_WATCH_MS, DEFAULT_WATCH_MS = 100, 250  # WatchSlots' min_interval_ms
