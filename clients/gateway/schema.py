"""The OpenAI request bodies the gateway accepts, as pydantic models.

Unknown fields are accepted and ignored (SDKs send `user`, `store`, `metadata`, ...); the
parameters slotwise cannot honour are refused by name in `unsupported`, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS = 1 << 20  # what infer accepts at most (GenerateLimits.max_tokens)


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


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


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
    session_id: str | None = None


class SamplingRequest(_Open):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 32)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the extensions other servers accept
    top_k: int | None = Field(default=None, ge=0, lt=1 << 31)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    n: int | None = None
    logprobs: Any = None
    slotwise: SlotwiseOptions = Field(default_factory=SlotwiseOptions)

    def unsupported(self) -> str | None:
        """The first parameter given that slotwise cannot honour."""
        if self.n not in (None, 1):
            return "n"
        if self.logprobs not in (None, False):
            return "logprobs"
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    top_logprobs: Any = None

    def unsupported(self) -> str | None:
        for name in ("tools", "tool_choice", "functions", "top_logprobs"):
            if getattr(self, name) not in (None, [], "none"):
                return name
        if self.response_format not in (None, {"type": "text"}):
            return "response_format"
        return super().unsupported()


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS)  # the API's default
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            return "prompt"
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()
