"""What several APIs share of a chat: OpenAI's chat messages read into slotwise's (Chat
Completions, and llama-server's /apply-template and input_tokens), a final assistant message
continued as llama-server does (its prefill), a token's log-probabilities in Chat Completions'
shape (its replies and the Responses API's), and the fingerprint replies carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from clients.client import (
    AsyncSlotwiseClient,
    Audio,
    Message,
    Prepared,
    TokenLogprobs,
    ToolCall,
    ToolOptions,
)
from clients.gateway.errors import bad_request, translated
from clients.gateway.media import MediaPolicy, check_images, image_bytes
from clients.gateway.schema import AudioPart, ChatMessage, ImagePart
from clients.gateway.sounds import audio_part, sound_format
from slotwise.v1 import prompt_pb2

# what llama-server calls build_info, and sends as system_fingerprint
SYSTEM_FINGERPRINT = "slotwise-0.1.0"


async def chat_messages(messages: Sequence[ChatMessage], media: MediaPolicy) -> list[Message]:
    check_images((m.content for m in messages), media, "messages", image="image_url",
                 sound="input_audio")  # fmt: skip
    return [await _message(m, i, media) for i, m in enumerate(messages)]


async def _message(m: ChatMessage, i: int, media: MediaPolicy) -> Message:
    role = "system" if m.role == "developer" else m.role
    parts: list[str | bytes | Audio] = []
    if m.content is None or isinstance(m.content, str):
        parts = [m.content or ""]
    else:
        for j, part in enumerate(m.content):
            if isinstance(part, ImagePart):
                param = f"messages.{i}.content.{j}.image_url"
                data = await image_bytes(part.image_url.url, media, param)
                # a sound in an image_url is a sound, as libmtmd tells them (llama-server too)
                parts.append(Audio(data) if sound_format(data) else data)
            elif isinstance(part, AudioPart):
                sound = part.input_audio
                where = f"messages.{i}.content.{j}.input_audio"
                parts.append(audio_part(sound.data, sound.format, media, where))
            else:
                parts.append(part.text)
    if role == "tool":
        if not m.tool_call_id:
            raise bad_request("a tool message needs tool_call_id", f"messages.{i}.tool_call_id")
        text = "".join(p for p in parts if isinstance(p, str))
        return Message.tool(m.tool_call_id, text, m.name or "")
    calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    if calls and role != "assistant":
        raise bad_request("only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
    return Message(role, parts if parts != [""] or not calls else (), tool_calls=calls)


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """llama-server's refusals of a chat's messages (oaicompat_chat_params_parse)."""
    for m in messages:
        given = "content" in m.model_fields_set
        if m.role != "assistant" and not given:
            raise bad_request("All non-assistant messages must contain 'content'", "messages")
        if m.role == "assistant" and not given and m.tool_calls is None:
            raise bad_request(
                "Assistant message must contain either 'content' or 'tool_calls'!", "messages"
            )


def continuation(
    messages: Sequence[ChatMessage], continue_final: Any = None, add_generation_prompt: Any = True
) -> bool:
    """Whether the final assistant message is continued (llama-server's prefill, on unless
    started with --no-prefill-assistant), and the combinations it refuses."""
    last = messages[-1] if messages else None
    if continue_final is None:
        if last is None or last.role != "assistant":
            return False
        if len(messages) >= 2 and messages[-2].role == "assistant":
            raise bad_request(
                "Cannot have 2 or more assistant messages at the end of the list.", "messages"
            )
    elif not continue_final:
        return False
    elif add_generation_prompt is not False:
        raise bad_request(
            "Cannot set both add_generation_prompt and continue_final_message to true.",
            "continue_final_message",
        )
    if last is None or last.role != "assistant":
        raise bad_request(
            "continue_final_message: the last message is not the assistant's", "messages"
        )
    if last.tool_calls:
        raise bad_request(
            "Cannot continue an assistant message that contains tool calls.", "messages"
        )
    return True


def with_tokens(prepared: Prepared, ids: Sequence[int], message_index: int) -> Prepared:
    """prepared, followed by these tokens (a continued message's text)."""
    if not ids:
        return prepared
    pb = prompt_pb2.PreparedPrompt()
    pb.CopyFrom(prepared.prompt)
    pb.chunks.append(
        prompt_pb2.Chunk(
            message_index=message_index, text=prompt_pb2.TextChunk(token_ids=list(ids))
        )
    )
    pb.num_cells += len(ids)
    pb.num_positions += len(ids)
    return replace(prepared, prompt=pb)


async def prefilled(
    client: AsyncSlotwiseClient,
    messages: Sequence[Message],
    tools: ToolOptions | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Prepared:
    """The chat up to its last message, as the template writes it with the generation prompt,
    and then the last (assistant) message's text: the reply goes on from there."""
    with translated():
        head = await client.prepare(
            list(messages[:-1]), tools=tools, template_kwargs=template_kwargs
        )
        text = messages[-1].text
        ids = (await client.tokenize(text)).token_ids if text else ()
    return replace(
        with_tokens(head, ids, len(messages) - 1), rendered_text=head.rendered_text + text
    )


def piece_text(piece: bytes) -> str:
    """A token's piece as text (bytes that are not UTF-8 replaced)."""
    return piece.decode("utf-8", errors="replace")


def token_logprobs(infos: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat Completions' (and the Responses API's) shape of a token's log-probabilities."""

    def one(c: Any) -> dict[str, Any]:
        return {"token": piece_text(c.piece), "logprob": c.logprob, "bytes": list(c.piece)}

    return [{**one(lp.chosen), "top_logprobs": [one(t) for t in lp.top]} for lp in infos]
