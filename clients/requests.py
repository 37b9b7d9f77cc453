"""Request builders: the client's inputs (messages, images, options) -> the protos it sends.

Pure functions, no I/O but reading image files: the blocking and the asyncio client build every
request here.
"""

from __future__ import annotations

import inspect
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.enums import Policy, ToolChoice, Unit, to_pb
from clients.types import (
    Audio,
    Constraint,
    ImageInput,
    ImageSize,
    Message,
    Part,
    PromptInput,
    ReasoningOptions,
    Speculative,
    Tool,
    is_pil_image,
    is_size,
)
from slotwise.v1 import infer_pb2, prep_pb2, prompt_pb2

__all__ = [
    "ToolOptions",
    "chat_pb",
    "context_pb",
    "count_request",
    "create_session_request",
    "generate_request",
    "image_pb",
    "part_pb",
    "prepare_request",
    "sampling_pb",
]


def audio_pb(audio: Audio, *, sizes_allowed: bool) -> prep_pb2.Audio:
    """An Audio -> prep_pb2.Audio (a file's bytes, float32 samples, or a length to count)."""
    if audio.seconds is not None:
        if not sizes_allowed:
            raise ValueError(f"a sound given by its length ({audio.seconds} s) can only be counted")
        return prep_pb2.Audio(seconds=audio.seconds)
    if audio.pcm is not None:
        return prep_pb2.Audio(pcm_f32=bytes(audio.pcm))
    data = audio.data
    return prep_pb2.Audio(
        data=Path(data).read_bytes() if isinstance(data, os.PathLike) else bytes(data or b"")
    )


def part_pb(part: Part, *, sizes_allowed: bool) -> prep_pb2.Part:
    """One message part (text, image or sound) -> prep_pb2.Part."""
    if isinstance(part, str):
        return prep_pb2.Part(text=part)
    if isinstance(part, Audio):
        return prep_pb2.Part(audio=audio_pb(part, sizes_allowed=sizes_allowed))
    return prep_pb2.Part(image=image_pb(part, sizes_allowed=sizes_allowed))


def image_pb(image: ImageInput, *, sizes_allowed: bool) -> prep_pb2.Image:
    """Any accepted image form -> prep_pb2.Image (encoded bytes, or a size for CountTokens)."""
    if isinstance(image, ImageSize | tuple):
        if not is_size(image):
            raise TypeError(f"an image size is (width, height), got {image!r}")
        w, h = (image.width, image.height) if isinstance(image, ImageSize) else image
        if not sizes_allowed:
            raise ValueError(f"an image given by its size ({w}x{h}) can only be counted")
        return prep_pb2.Image(size=prep_pb2.ImageSize(width=w, height=h))
    if isinstance(image, bytes | bytearray):
        return prep_pb2.Image(data=bytes(image))
    if isinstance(image, os.PathLike):
        return prep_pb2.Image(data=Path(image).read_bytes())
    if is_pil_image(image):
        buf = io.BytesIO()
        image.save(buf, "PNG")
        return prep_pb2.Image(data=buf.getvalue())
    if isinstance(image, str):
        raise TypeError("a str is text; pass an image file as pathlib.Path or bytes")
    raise TypeError(f"not an image: {type(image).__name__}")


@dataclass(frozen=True)
class ToolOptions:
    """A chat's tools and how the model may use them."""

    tools: Sequence[Tool] = ()
    choice: ToolChoice | str = ToolChoice.AUTO
    name: str = ""  # ToolChoice.FUNCTION: the function to call
    parallel: bool | None = None  # None: the server's default (several calls allowed)


def chat_pb(
    messages: Sequence[Message],
    *,
    sizes_allowed: bool,
    tools: ToolOptions | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> prep_pb2.Chat:
    out = []
    for m in messages:
        if not isinstance(m, Message):
            raise TypeError(f"expected Message, got {type(m).__name__}")
        parts = [part_pb(p, sizes_allowed=sizes_allowed) for p in m.parts]
        calls = [
            prep_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)
            for c in m.tool_calls
        ]
        out.append(
            prep_pb2.Message(
                role=m.role,
                parts=parts,
                tool_calls=calls,
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
        )
    chat = prep_pb2.Chat(messages=out)
    if template_kwargs:
        chat.template_kwargs_json = json.dumps(dict(template_kwargs))
    if tools is not None:
        chat.tools.extend(
            prep_pb2.Tool(
                name=t.name,
                description=t.description,
                parameters_json=json.dumps(t.parameters) if t.parameters is not None else "",
            )
            for t in tools.tools
        )
        chat.tool_choice = to_pb(ToolChoice, tools.choice)  # type: ignore[assignment]
        chat.tool_name = tools.name
        if tools.parallel is not None:
            chat.parallel_tool_calls = tools.parallel
    return chat


def _input_fields(
    prompt: PromptInput,
    images: Sequence[ImageInput | Audio],
    add_special: bool,
    first_message: int,
    *,
    sizes_allowed: bool,
    tools: ToolOptions | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The prompt fields PrepareRequest and CountTokensRequest share."""
    if isinstance(prompt, str):
        if first_message:
            raise ValueError("first_message applies to messages, not to a raw prompt")
        if tools is not None:
            raise ValueError("tools go with messages, not with a raw prompt")
        if template_kwargs:
            raise ValueError("template_kwargs go with messages, not with a raw prompt")
        raw = prep_pb2.RawPrompt(text=prompt, add_special=add_special)
        if any(isinstance(m, Audio) for m in images):  # images and sounds, in marker order
            raw.media.extend(part_pb(m, sizes_allowed=sizes_allowed) for m in images)
        else:
            raw.images.extend(image_pb(im, sizes_allowed=sizes_allowed) for im in images)  # type: ignore[arg-type]
        return {"raw": raw}
    if images:
        raise ValueError("images= goes with a raw prompt; put images in the messages' parts")
    return {
        "chat": chat_pb(
            list(prompt), sizes_allowed=sizes_allowed, tools=tools, template_kwargs=template_kwargs
        ),
        "first_message": first_message,
    }


def prepare_request(
    prompt: PromptInput,
    images: Sequence[ImageInput | Audio] = (),
    *,
    add_special: bool = True,
    first_message: int = 0,
    tools: ToolOptions | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> prep_pb2.PrepareRequest:
    """Messages (chat template applied) or a raw prompt whose media markers take `images`;
    first_message: only the chunks of messages[first_message:] (a session turn); tools: shown
    to the model as the template shows them (Prepared.tool_constraint makes its calls valid);
    template_kwargs: the template's variables beside the messages ({"enable_thinking":
    false})."""
    fields = _input_fields(
        prompt, images, add_special, first_message, sizes_allowed=False, tools=tools,
        template_kwargs=template_kwargs,
    )  # fmt: skip
    return prep_pb2.PrepareRequest(**fields)


def count_request(
    prompt: PromptInput,
    images: Sequence[ImageInput | Audio] = (),
    *,
    add_special: bool = True,
    first_message: int = 0,
    tools: ToolOptions | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> prep_pb2.CountTokensRequest:
    """As prepare_request; images may also be ImageSize / (width, height) sizes."""
    fields = _input_fields(
        prompt, images, add_special, first_message, sizes_allowed=True, tools=tools,
        template_kwargs=template_kwargs,
    )  # fmt: skip
    return prep_pb2.CountTokensRequest(**fields)


def sampling_pb(
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repeat_penalty: float | None = None,
    penalty_last_n: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
) -> infer_pb2.SamplingParams:
    """SamplingParams with the given fields set; None leaves a field to the server (or session)."""
    fields = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repeat_penalty": repeat_penalty,
        "penalty_last_n": penalty_last_n,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
    }
    return infer_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


def context_pb(
    *,
    policy: Policy | str | None = None,
    keep: int | None = None,
    discard_fraction: float | None = None,
    unit: Unit | str | None = None,
    truncate_prompt: bool | None = None,
) -> infer_pb2.ContextOptions | None:
    """ContextOptions with the options given, or None when none is: the server's defaults (or,
    on a session turn, the session's options) apply to every option left out, one by one."""
    if all(v is None for v in (policy, keep, discard_fraction, unit, truncate_prompt)):
        return None
    context = infer_pb2.ContextOptions()
    if policy is not None:
        context.policy = to_pb(Policy, policy)  # type: ignore[assignment]
    if keep is not None:
        context.keep = keep
    if discard_fraction is not None:
        context.discard_fraction = discard_fraction
    if unit is not None:
        context.unit = to_pb(Unit, unit)  # type: ignore[assignment]
    if truncate_prompt is not None:
        context.truncate_prompt = truncate_prompt
    return context


_SAMPLING_OPTIONS = frozenset(inspect.signature(sampling_pb).parameters)
_CONTEXT_OPTIONS = frozenset(inspect.signature(context_pb).parameters)


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = set(options) - _SAMPLING_OPTIONS - _CONTEXT_OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    sampling = {k: v for k, v in options.items() if k in _SAMPLING_OPTIONS}
    context = {k: v for k, v in options.items() if k in _CONTEXT_OPTIONS}
    return sampling, context


def generate_request(
    prompt: prompt_pb2.PreparedPrompt,
    *,
    max_tokens: int = 0,
    stop: Sequence[str] | str = (),
    session_id: str = "",
    constraint: Constraint | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    turn_note: bytes = b"",
    cache_salt: str = "",
    expect_turns: int | None = None,
    speculative: Speculative | None = None,
    ignore_eos: bool = False,
    lora: Mapping[int, float] | Sequence[tuple[int, float]] | None = None,
    reasoning: ReasoningOptions | None = None,
    **options: Any,
) -> infer_pb2.GenerateRequest:
    """The GenerateRequest for these options.

    options: sampling (temperature, top_k, top_p, min_p, repeat_penalty, penalty_last_n,
    presence_penalty, frequency_penalty, seed) and context (policy, keep, discard_fraction,
    unit, truncate_prompt). Options left out (or None) are the server's defaults, or for a
    session turn (session_id) the session's. max_tokens 0: the server's default.
    constraint: a grammar or JSON Schema the text keeps to; logit_bias: token id -> bias;
    logprobs / top_logprobs: each Delta carries its tokens' log-probabilities (and the top
    alternatives); turn_note: kept with a session turn's record; cache_salt: KV is reused
    only between requests of the same salt (and tenant); expect_turns: a session turn runs
    only if the session has completed that many turns (else FAILED_PRECONDITION);
    speculative: drafts verified in the batch (the server's --spec-* where unset); ignore_eos:
    end-of-generation tokens are never sampled; lora: LoRA adapter id -> scale (those left
    out: 0; None or empty: the scales the caller's tenant has, `set_lora_scales`). A
    logit_bias of -math.inf bans a token.
    """
    if isinstance(stop, str):
        stop = (stop,)
    sampling, context = _split_options(options)
    request = infer_pb2.GenerateRequest(
        prompt=prompt,
        sampling=sampling_pb(**sampling),
        max_tokens=max_tokens,
        stop=list(stop),
        session_id=session_id,
        logit_bias=logit_bias or {},
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        turn_note=turn_note,
        cache_salt=cache_salt,
        ignore_eos=ignore_eos,
        lora=lora_pb(lora),
    )
    if constraint is not None:
        request.constraint.CopyFrom(constraint.to_pb())
    if speculative is not None:
        request.speculative.CopyFrom(speculative.to_pb())
    if reasoning is not None:  # (Prepared.reasoning.options(): thoughts, and their budget)
        request.reasoning.CopyFrom(reasoning.to_pb())
    if expect_turns is not None:
        request.expect_turns = expect_turns
    ctx = context_pb(**context)
    if ctx is not None:
        request.context.CopyFrom(ctx)
    return request


def lora_pb(
    lora: Mapping[int, float] | Sequence[tuple[int, float]] | None,
) -> list[infer_pb2.LoraScale]:
    """LoRA adapter id -> scale (a mapping, or pairs) as the contract's list."""
    pairs = lora.items() if isinstance(lora, Mapping) else lora or ()
    return [infer_pb2.LoraScale(id=i, scale=s) for i, s in pairs]


def create_session_request(
    session_id: str = "", *, title: str = "", **options: Any
) -> infer_pb2.CreateSessionRequest:
    """A CreateSessionRequest: its title, and the session's default sampling and context
    options (as for generate_request) for its turns."""
    sampling, context = _split_options(options)
    request = infer_pb2.CreateSessionRequest(
        session_id=session_id, sampling=sampling_pb(**sampling), title=title
    )
    ctx = context_pb(**context)
    if ctx is not None:
        request.context.CopyFrom(ctx)
    return request
