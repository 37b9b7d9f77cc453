"""The OpenAI request bodies of Chat Completions, Completions and Embeddings, as pydantic
models (a chat's messages are schema.py's: llama-server's chat routes read them too).

Unknown fields are accepted and ignored (SDKs send `user`, `store`, `metadata`, ...); the
parameters slotwise cannot honour are refused by name in `unsupported`, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clients.gateway.schema import (
    MAX_N,
    ChatMessage,
    OpenModel,
    SlotwiseOptions,
    SpeculativeOptions,
)
from slotwise_core.limits import MAX_CACHE_SALT, MAX_TOKENS, MAX_TOP_LOGPROBS


class StreamOptions(OpenModel):
    include_usage: bool = False


class FunctionDef(OpenModel):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenModel):
    name: str


class NamedToolChoice(OpenModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(OpenModel):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class LoraScale(BaseModel):
    """llama-server's per-request LoRA adapter: its id (GET /lora-adapters) and scale."""

    model_config = ConfigDict(extra="forbid")

    id: int = Field(ge=0, lt=1 << 31)
    scale: float


class SamplingRequest(OpenModel):
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


class EmbeddingRequest(OpenModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
