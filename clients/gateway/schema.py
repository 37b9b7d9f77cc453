"""The request models more than one API reads, as pydantic models: the open base of every
body (unknown fields accepted and ignored: SDKs send `user`, `store`, `metadata`, ...), OpenAI's
chat message (Chat Completions' and llama-server's chat routes'), slotwise's own options (any
body's `slotwise`) and llama-server's `speculative` options. Each API's own bodies are in its
folder's schema.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotwise_core.limits import (
    MAX_CACHE_SALT,
    MAX_DRAFTS,
    MAX_NGRAM,
    MAX_TURN_NOTE,
    SESSION_ID_PATTERN,
)

MAX_N = 8  # choices per request
# the draft types a request may name (llama-server's --spec-type names, and slotwise's suffix)
SPEC_TYPE_NAMES = (
    "none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
    "suffix", "draft-simple", "draft-mtp",
)  # fmt: skip
_NAME = "(?:" + "|".join(SPEC_TYPE_NAMES) + ")"
SPEC_TYPE_PATTERN = f"^{_NAME}(?: *, *{_NAME})*$"


class OpenModel(BaseModel):
    """A body (or a part of one) that takes fields it does not name, and ignores them."""

    model_config = ConfigDict(extra="allow")


class ImageUrl(OpenModel):
    url: str
    detail: str | None = None


class TextPart(OpenModel):
    type: Literal["text"]
    text: str


class ImagePart(OpenModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(OpenModel):
    data: str  # the file's bytes, base64 (no data: prefix)
    format: str  # wav, mp3 (OpenAI's) or flac (llama-server's): checked in sounds.audio_part


class AudioPart(OpenModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


class FunctionCall(OpenModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(OpenModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class SlotwiseOptions(BaseModel):
    """slotwise's own options (the SDK's `extra_body={"slotwise": {...}}`)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["auto", "shift", "gap", "reprefill", "stop"] = "auto"
    keep: Annotated[int, Field(ge=0, lt=1 << 32)] | Literal["system"] = "system"
    discard_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    unit: Literal["token", "message"] | None = None
    truncate: bool = True  # drop the oldest units of a prompt that cannot fit
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    # KV reused only with the same salt
    cache_salt: str = Field(default="", max_length=MAX_CACHE_SALT)
    # a session turn's note, kept with the turn (GET /slotwise/sessions/{id} shows it again)
    note: str = Field(default="", max_length=MAX_TURN_NOTE)


class SpeculativeOptions(BaseModel):
    """llama-server's `speculative` body options (also as its flat `speculative.n_max` keys)."""

    model_config = ConfigDict(extra="forbid")

    # one of SPEC_TYPE_NAMES, or several separated by commas (llama-server's --spec-type a,b)
    type: str | None = Field(default=None, max_length=200, pattern=SPEC_TYPE_PATTERN)
    n_max: int | None = Field(default=None, ge=0, le=MAX_DRAFTS)
    n_min: int | None = Field(default=None, ge=0, le=MAX_DRAFTS)
    p_min: float | None = Field(default=None, ge=0.0, le=1.0)
    ngram_size_n: int | None = Field(default=None, ge=1, le=MAX_NGRAM)
    ngram_size_m: int | None = Field(default=None, ge=1, le=1024)
    ngram_min_hits: int | None = Field(default=None, ge=1, lt=1 << 16)
    ngram_mod_n_match: int | None = Field(default=None, ge=1, le=MAX_NGRAM)
    ngram_mod_n_min: int | None = Field(default=None, ge=0, le=1024)
    ngram_mod_n_max: int | None = Field(default=None, ge=0, le=1024)
