"""The gateway's settings: `slotwise gateway`'s flags, or `slotwise serve --http-port`'s
(clients/cli.py's gateway_config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from clients.gateway.media import MediaPolicy
from clients.gateway.turns import Thinking
from slotwise_core.keys import Keys
from slotwise_core.limits import DEFAULT_MAX_MESSAGES

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_COMPLETIONS", "GatewayConfig"]

# a body this large holds two images at --max-image-mb's default, base64 (4/3 of their bytes),
# well within what prep and infer take in one message (--max-message-mb, 256)
DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_COMPLETIONS = 32  # generations of one llama-server /completion (prompts x n_cmpl)


@dataclass(frozen=True)
class GatewayConfig:
    prep_address: str
    infer_address: str
    model_name: str = "slotwise"
    api_key: str | None = None  # one key (tenant default); or:
    api_keys: Keys | None = None  # the keys file (the services' own): callers' keys go on
    media: MediaPolicy = field(default_factory=MediaPolicy)
    token: str | None = None  # bearer token for the gRPC services, without api keys
    strict_model_name: bool = False  # 404 for another model name (else any name is this one)
    cors_origins: tuple[str, ...] = ()
    ui: bool = True  # the web page at / (its API under /slotwise/ is there either way)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 413 beyond: nothing larger is read in
    max_messages: int = DEFAULT_MAX_MESSAGES  # a chat's (400 beyond, before any is read)
    # generations one /completion starts (its prompts x n_cmpl): 400 beyond, before any starts
    max_completions: int = DEFAULT_MAX_COMPLETIONS
    # a reasoning model's thoughts: --reasoning-format, --reasoning-budget(-message),
    # --chat-template-kwargs and --reasoning (what a request leaves unset)
    thinking: Thinking = field(default_factory=Thinking)
    # llama-server's: --no-slots (GET /slots is a 501), --alias and --tags (/v1/models),
    # --verbose (__verbose in chat completions)
    slots_endpoint: bool = True
    model_aliases: tuple[str, ...] = ()
    model_tags: tuple[str, ...] = ()
    verbose_replies: bool = False
    # a native /completion's defaults (llama-server's --temp, --seed), and /props' model_path
    default_temperature: float | None = None
    default_seed: int | None = None
    model_path: str = ""
