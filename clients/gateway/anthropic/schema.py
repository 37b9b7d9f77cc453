"""The Messages API's request bodies, as pydantic models (unknown fields accepted and
ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from clients.gateway.schema import OpenModel, SlotwiseOptions, SpeculativeOptions
from slotwise_core.limits import MAX_TOKENS


class MessageParam(OpenModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(OpenModel):
    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None  # (custom, or absent: a client tool)


class MessagesRequest(OpenModel):
    model: str | None = None
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: Any = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    slotwise: SlotwiseOptions = Field(default_factory=SlotwiseOptions)
    speculative: SpeculativeOptions | None = None  # llama-server's (also flat keys)


class CountRequest(OpenModel):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
