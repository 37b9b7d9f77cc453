"""prep_service's command-line flags: its parser and `slotwise serve` are built from these
(and read into start arguments by `start_arguments` in prep_service/__main__.py)."""

from __future__ import annotations

from pathlib import Path

from prep_service.image_cache import DEFAULT_IMAGE_CACHE_BYTES
from prep_service.token_cache import DEFAULT_TOKEN_CACHE_BYTES
from slotwise_core.flags import option, positive_int
from slotwise_core.images import DEFAULT_MAX_PIXELS, DEFAULT_MAX_TOTAL_PIXELS
from slotwise_core.limits import DEFAULT_MAX_IMAGES, DEFAULT_MAX_MESSAGES
from slotwise_core.serving import DEFAULT_MAX_MESSAGE_BYTES
from slotwise_core.sounds import DEFAULT_MAX_SECONDS, MAX_SOUNDS_PER_REQUEST

OPTIONS = (
    option("--model", type=Path, required=True, help="text model GGUF (loaded vocab-only)"),
    option("--mmproj", type=Path, help="multimodal projector GGUF (omit for text-only)"),
    option("--threads", type=positive_int, default=2, help="worker threads for tokenizing"),
    option("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="pixels of one image"),
    option("--max-side", type=int, default=0, help="downscale images above this side"),
    option("--max-images", type=positive_int, default=DEFAULT_MAX_IMAGES,
           help="images and sounds per request"),
    option("--max-audio-seconds", type=float, default=DEFAULT_MAX_SECONDS,
           help="the longest sound (read from its header, before decoding); one request's "
           f"sounds together: {MAX_SOUNDS_PER_REQUEST} times this"),
    option("--max-messages", type=positive_int, default=DEFAULT_MAX_MESSAGES,
           help="messages of one chat (more are refused before the template renders any)"),
    option("--max-total-pixels", type=int, default=DEFAULT_MAX_TOTAL_PIXELS,
           help="pixels of all images of one request together (checked before decoding)"),
    option("--max-message-mb", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES >> 20),
    option("--image-cache-mb", type=int, default=DEFAULT_IMAGE_CACHE_BYTES >> 20,
           help="what prep learnt of the image files it decoded, by their digest, so that a "
           "resent image is not decoded again (0: off)"),
    option("--token-cache-mb", type=int, default=DEFAULT_TOKEN_CACHE_BYTES >> 20,
           help="the tokens of long texts (a system prompt, a conversation so far) per tenant, "
           "so that one sent again is not tokenized again (0: off)"),
    option("--chat-template", metavar="NAME|FILE",
           help="a llama.cpp built-in template name (chatml, gemma, llama3, ...) or a Jinja "
           "file; default: the model's own"),
)  # fmt: skip
