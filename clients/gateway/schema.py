"""The OpenAI request bodies the gateway accepts (Chat Completions, Completions, Embeddings),
as pydantic models.

Unknown fields are accepted and ignored (SDKs send `user`, `store`, `metadata`, ...); the
parameters slotwise cannot honour are refused by name in `unsupported`, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotwise_core.limits import (
    MAX_CACHE_SALT,
    MAX_DRAFTS,
    MAX_NGRAM,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    MAX_TURN_NOTE,
    SESSION_ID_PATTERN,
)

MAX_N = 8  # choices per request


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ImageUrl(_Open):
    url: str
    detail: str | None = None


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Open):
    data: str  # the file's bytes, base64 (no data: prefix)
    format: str  # wav, mp3 (OpenAI's) or flac (llama-server's): checked in sounds.audio_part


class AudioPart(_Open):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


class FunctionCall(_Open):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Open):
    include_usage: bool = False


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


class FunctionDef(_Open):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Open):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SpeculativeOptions(BaseModel):
    """llama-server's `speculative` body options (also as its flat `speculative.n_max` keys)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["none", "ngram-simple", "ngram-map-k", "draft-simple"] | None = None
    n_max: int | None = Field(default=None, ge=0, le=MAX_DRAFTS)
    n_min: int | None = Field(default=None, ge=0, le=MAX_DRAFTS)
    p_min: float | None = Field(default=None, ge=0.0, le=1.0)
    ngram_size_n: int | None = Field(default=None, ge=1, le=MAX_NGRAM)
    ngram_size_m: int | None = Field(default=None, ge=1, le=1024)
    ngram_min_hits: int | None = Field(default=None, ge=1, lt=1 << 16)


class LoraScale(BaseModel):
    """llama-server's per-request LoRA adapter: its id (GET /lora-adapters) and scale."""

    model_config = ConfigDict(extra="forbid")

    id: int = Field(ge=0, lt=1 << 31)
    scale: float


class SamplingRequest(_Open):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 32)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    # the extensions other servers accept
    top_k: int | None = Field(default=None, ge=0, lt=1 << 31)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server's: GBNF
    json_schema: dict[str, Any] | None = None  # llama-server's
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT)  # vLLM's
    speculative: SpeculativeOptions | None = None
    timings_per_token: bool = False  # llama-server's: timings in every streamed chunk
    return_progress: bool = False  # llama-server's: the prompt's progress in the stream
    # llama-server's: LoRA adapters by id, those not listed at 0 (none: the server's scales)
    lora: list[LoraScale] | None = None
    slotwise: SlotwiseOptions = Field(default_factory=SlotwiseOptions)

    @property
    def salt(self) -> str:
        return self.cache_salt or self.slotwise.cache_salt

    def unsupported(self) -> str | None:
        """The first parameter given that slotwise cannot honour."""
        given = [x for x in (self.response_format, self.grammar, self.json_schema) if x]
        if len(given) > 1:
            return "response_format"  # (more than one constraint)
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | dict[str, Any] | None = (
        None
    )
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def unsupported(self) -> str | None:
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name) not in (None, []):
                return name
        if self.modalities not in (None, ["text"]):
            return "modalities"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs"
        return super().unsupported()


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS)  # the API's default
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def unsupported(self) -> str | None:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            return "prompt"
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        return super().unsupported()


class EmbeddingRequest(_Open):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
