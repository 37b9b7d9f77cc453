"""The Responses API's request body, as pydantic models (unknown fields accepted and ignored;
what slotwise cannot honour refused by name in `unsupported`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from clients.gateway.schema import OpenModel, SlotwiseOptions, SpeculativeOptions
from slotwise_core.limits import MAX_TOKENS, MAX_TOP_LOGPROBS


class InputItem(OpenModel):
    type: str | None = None  # message (or absent), function_call, function_call_output
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class TextFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(OpenModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    slotwise: SlotwiseOptions = Field(default_factory=SlotwiseOptions)
    speculative: SpeculativeOptions | None = None  # llama-server's (also flat keys)

    def unsupported(self) -> str | None:
        for name in ("conversation", "prompt"):
            if getattr(self, name) not in (None, {}):
                return name
        r = self.reasoning
        if r not in (None, {}) and (
            not isinstance(r, dict) or set(r) - {"effort", "summary"} or r.get("summary")
        ):
            return "reasoning"  # (its effort only: a model here writes no summaries)
        if self.background:
            return "background"
        if set(self.include or ()) - {"message.output_text.logprobs"}:
            return "include"
        return None
