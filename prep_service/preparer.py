"""Text + images + sounds -> PreparedPrompt, with every count read from libmtmd."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import llama_cpp

from prep_service.chat import (
    ROLES,
    BuiltinTemplate,
    TemplateError,
    TemplateMessage,
    _Template,
    load_template,
)
from prep_service.reasoning import ThoughtTags, template_reasoning
from prep_service.token_cache import DEFAULT_TOKEN_CACHE_BYTES, TokenCache
from prep_service.tools import (
    JSON,
    Choice,
    Grammar,
    ToolCall,
    ToolFormat,
    Tools,
    call_id,
    check_tools,
    grammar,
    json_call_text,
    json_result_text,
    json_system_prompt,
    template_format,
    template_tools,
)
from slotwise_core import model_files, native, sounds
from slotwise_core.descriptors import Chunk, Fingerprint, MediaChunk, PreparedPrompt, TextChunk
from slotwise_core.images import RgbImage


class InputError(ValueError):
    """A request that can never work: empty, mismatched, malformed."""


class UnsupportedError(ValueError):
    """A request this model cannot serve (images without an mmproj, chat without a template)."""


@dataclass(frozen=True, repr=False)
class ImageRef:
    """An image as prepare needs it: its size, the hash of its pixels and a file that decodes
    to exactly them (or raw RGB); or (CountTokens) just a size."""

    width: int
    height: int
    media_id: str = ""
    encoded: bytes = b""
    rgb: bytes = b""  # only without an encoded form

    @classmethod
    def of(cls, image: RgbImage) -> ImageRef:
        rgb = b"" if image.encoded else image.rgb
        return cls(image.width, image.height, image.media_id, image.encoded, rgb)

    def __repr__(self) -> str:  # never print the file
        return f"ImageRef({self.width}x{self.height}, {self.media_id[:12] or 'size only'})"


@dataclass(frozen=True, repr=False)
class AudioRef:
    """A sound as prepare needs it: its length in samples at the projector's rate, its hash and
    its bytes (a file, or float32 samples); or (CountTokens) just a length."""

    num_samples: int
    media_id: str = ""
    data: bytes = b""  # a WAV, MP3 or FLAC file
    pcm: bytes = b""  # or float32 samples

    def __repr__(self) -> str:  # never print the sound
        return f"AudioRef({self.num_samples} samples, {self.media_id[:12] or 'length only'})"


Media = ImageRef | AudioRef
Part = str | Media


def _held(media: Media) -> bool:
    """A medium a session holds: only its marker is rendered (see prep_service.service._message)."""
    return (media.num_samples if isinstance(media, AudioRef) else media.width) == 0


@dataclass(frozen=True)
class Message:
    role: str
    parts: Sequence[Part]
    tool_calls: Sequence[ToolCall] = ()  # assistant: the calls it made
    tool_call_id: str = ""  # tool: the call it answers
    name: str = ""  # tool: the function


@dataclass(frozen=True)
class RawPrompt:
    text: str
    images: Sequence[Media] = ()  # images and sounds, in the order of their markers
    add_special: bool = True


@dataclass(frozen=True)
class Thoughts:
    """Where a reasoning model's thoughts are, as this vocabulary's tokens, and whether the
    generation prompt opened one (with what it wrote after the start, of num_opened tokens)."""

    tags: ThoughtTags
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    opened: str | None
    num_opened: int


@dataclass(frozen=True)
class ModelInfo:
    fingerprint: Fingerprint
    media_marker: str
    uses_mrope: bool
    media_non_causal: bool
    supports_vision: bool
    supports_audio: bool
    n_ctx_train: int
    num_vocab: int
    bos_token_id: int
    eos_token_id: int
    has_chat_template: bool
    description: str
    chat_template: str = ""  # a Jinja template's text, or a built-in template's name
    add_bos: bool = False
    fim: dict[str, int] = field(default_factory=dict)  # pre, suf, mid, rep, sep: token ids
    memory_kind: str = "attention"  # attention, hybrid or recurrent (slotwise_core.native)
    audio_sample_rate: int = 0  # what the audio projector takes (0: no audio)


@dataclass
class _Segment:
    """Text to tokenize together: one chat message (or the whole raw prompt)."""

    text: str
    images: list[Media] = field(default_factory=list)
    message_index: int = 0
    add_special: bool = False
    first_group: int = 1  # media group number of this segment's first image


class Preparer:
    """Owns a vocab-only text model and (optionally) an mtmd context; thread-safe to call."""

    def __init__(
        self,
        model: Path,
        mmproj: Path | None = None,
        *,
        n_threads: int = 2,
        chat_template: str | None = None,
        token_cache_bytes: int = DEFAULT_TOKEN_CACHE_BYTES,
    ):
        if mmproj is not None:
            model_files.check_embedding_sizes(model, mmproj)
        self.fingerprint = model_files.fingerprint(model, mmproj)
        self._model = native.load_model(model, vocab_only=True)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        try:
            self.mtmd = (
                native.Multimodal(mmproj, self._model, n_threads=n_threads) if mmproj else None
            )
        except Exception:
            native.free_model(self._model)
            raise
        self.marker = self.mtmd.marker if self.mtmd else mtmd_default_marker()
        # the chunks libmtmd makes of one image alone depend on its size only (for this model
        # and projector): remembered for the sizes seen last
        self._group_shape = functools.lru_cache(maxsize=1024)(self._shape_of)
        self.token_cache = TokenCache(token_cache_bytes)
        bos = llama_cpp.llama_vocab_bos(self._vocab)
        eos = llama_cpp.llama_vocab_eos(self._vocab)
        try:
            self.template = load_template(
                chat_template,
                native.chat_template(self._model),
                bos_token=self._piece(bos),
                eos_token=self._piece(eos),
            )
        except Exception:
            self.close()
            raise
        self.info = ModelInfo(
            fingerprint=self.fingerprint,
            media_marker=self.marker,
            uses_mrope=bool(self.mtmd and self.mtmd.uses_mrope),
            media_non_causal=bool(self.mtmd and self.mtmd.non_causal),
            supports_vision=bool(self.mtmd and self.mtmd.supports_vision),
            supports_audio=bool(self.mtmd and self.mtmd.supports_audio),
            n_ctx_train=_n_ctx_train(self._model),
            num_vocab=llama_cpp.llama_vocab_n_tokens(self._vocab),
            bos_token_id=bos,
            eos_token_id=eos,
            has_chat_template=self.template is not None,
            description=native.meta_string(self._model, "general.name") or model.name,
            chat_template=_template_text(self.template),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(self._vocab)),
            fim=_fim_tokens(self._vocab),
            memory_kind=native.memory_kind(self._model),
            audio_sample_rate=self.mtmd.sample_rate
            if self.mtmd and self.mtmd.supports_audio
            else 0,
        )

    def close(self) -> None:
        if self.mtmd:
            self.mtmd.close()
        if self._model:
            native.free_model(self._model)
            self._model = 0

    def _piece(self, token: int) -> str:
        return (
            native.token_piece(self._vocab, token).decode("utf-8", "replace") if token >= 0 else ""
        )

    # -- the two operations ---------------------------------------------------------------

    def prepare(
        self,
        request: Sequence[Message] | RawPrompt,
        first_message: int = 0,
        tools: Tools | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        scope: str = "",
    ) -> tuple[PreparedPrompt, str]:
        """Chunks with pixels; also returns the rendered prompt text. kwargs: the template's
        variables beside the messages (checked by prep_service.reasoning). scope: whose long
        texts' tokens are kept for the next time they come (the caller's tenant)."""
        segments = self._segments(request, first_message, tools, kwargs)
        chunks = [c for s in _numbered_images(segments) for c in self._tokenize(s, scope)]
        return PreparedPrompt(self.fingerprint, tuple(chunks)), "".join(s.text for s in segments)

    def count(
        self,
        request: Sequence[Message] | RawPrompt,
        first_message: int = 0,
        tools: Tools | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        scope: str = "",
    ) -> list[Chunk]:
        """Like prepare, but images may be sizes only; media chunks come back without pixels."""
        segments = _numbered_images(self._segments(request, first_message, tools, kwargs))
        return [c for s in segments for c in self._tokenize(s, scope)]

    def thoughts(self, kwargs: Mapping[str, Any] | None = None) -> Thoughts | None:
        """The template's thoughts (None: it writes none), and whether its generation prompt,
        rendered with these variables, opens one: the generation prompt is what a chat's
        rendering with it adds to its rendering without (as llama.cpp finds it)."""
        tags = template_reasoning(self.template.source if self.template else None)
        if tags is None or self.template is None:
            return None
        template = self.template.with_context(kwargs or {})
        probe = [TemplateMessage("user", "\ue000slotwise-probe\ue001")]
        try:
            with_prompt = template.render(probe, add_generation_prompt=True)
            without = template.render(probe, add_generation_prompt=False)
        except TemplateError:
            return None
        common = 0
        while common < min(len(with_prompt), len(without)) and (
            with_prompt[common] == without[common]
        ):
            common += 1
        opened = tags.opened(with_prompt[common:])

        def ids(text: str) -> tuple[int, ...]:
            return tuple(self.tokenize(text, add_special=False, parse_special=True))

        num_opened = len(ids(opened)) if opened else 0
        return Thoughts(tags, ids(tags.start), ids(tags.end), opened, num_opened)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Text as it is: no chat template, no media."""
        return native.tokenize_text(
            self._vocab, text, add_special=add_special, parse_special=parse_special
        )

    def pieces(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's bytes (special tokens rendered); ids outside the vocabulary refused."""
        n = self.info.num_vocab
        for k, t in enumerate(token_ids):
            if not 0 <= t < n:
                raise InputError(
                    f"token {k}: {t} is not a token id of this vocabulary (0..{n - 1})"
                )
        return [native.token_piece(self._vocab, t) for t in token_ids]

    def sound(self, data: bytes, *, max_seconds: float) -> AudioRef:
        """A sound file's length as libmtmd decodes it, refused before decoding when its header
        says it is too long."""
        self._check_kinds([AudioRef(1)])
        assert self.mtmd is not None
        sounds.sound_header(data, max_seconds=max_seconds)
        try:
            n = self.mtmd.sound_length(data)
        except ValueError as e:
            raise sounds.AudioError(str(e)) from None
        sounds.check_seconds(n / self.mtmd.sample_rate, max_seconds)
        return AudioRef(n, sounds.audio_id(data), data=data)

    def samples(self, pcm: bytes, *, max_seconds: float) -> AudioRef:
        """A sound given as float32 samples at the projector's rate."""
        self._check_kinds([AudioRef(1)])
        assert self.mtmd is not None
        n = sounds.check_pcm(pcm, self.mtmd.sample_rate, max_seconds)
        return AudioRef(n, sounds.pcm_id(pcm), pcm=pcm)

    def sound_of_length(self, seconds: float, *, max_seconds: float) -> AudioRef:
        """A sound counted by its length alone (CountTokens)."""
        self._check_kinds([AudioRef(1)])
        assert self.mtmd is not None
        if not seconds > 0:
            raise sounds.AudioError(f"a sound's length must be positive, got {seconds}")
        sounds.check_seconds(seconds, max_seconds)
        return AudioRef(max(sounds.MIN_SAMPLES, round(seconds * self.mtmd.sample_rate)))

    @property
    def tool_format(self) -> ToolFormat:
        return template_format(self.template.source if self.template else None)

    def tool_grammar(self, tools: Tools) -> Grammar | None:
        """The constraint a reply with these tools follows (None: the model calls none)."""
        if tools.choice is Choice.NONE or not tools.tools:
            return None
        for t in tools.callable:  # a schema the converter cannot follow, named by its tool
            try:
                grammar(self.tool_format, Tools((t,), tools.choice, t.name, tools.parallel))
            except RecursionError:
                raise InputError(f"tool {t.name!r}: its parameters nest too deeply") from None
            except Exception as e:  # the converter's assertions, lookups and type errors
                raise InputError(
                    f"tool {t.name!r}: not a schema this server can follow: {e!r}"
                ) from None
        return grammar(self.tool_format, tools)

    # -- internals --------------------------------------------------------------------------

    def _segments(
        self,
        request: Sequence[Message] | RawPrompt,
        first: int = 0,
        tools: Tools | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[_Segment]:
        """The text to tokenize, in segments: a raw prompt whole; a chat a message at a time as
        its template renders it (from message first on, for a session that holds the ones
        before), the generation prompt last."""
        if isinstance(request, RawPrompt):
            return [self._raw_segment(request, first)]
        turns, images = self._turns(request, tools)
        if self.template is None:
            raise UnsupportedError(
                "the model has no chat template: start prep with --chat-template NAME|FILE "
                "(a llama.cpp built-in name such as chatml or gemma, or a Jinja file), or send "
                "a raw prompt"
            )
        template = self.template.with_context(kwargs or {})
        shown = tools if tools is not None and tools.choice is not Choice.NONE else None
        template_tools_ = template_tools(shown) if shown and self.tool_format is not JSON else None
        prompt = json_system_prompt(shown) if shown and self.tool_format is JSON else ""
        plan, pieces, holders = self._render(template, turns, template_tools_, prompt)
        segments, held_by = _message_segments(self.marker, plan, pieces, holders, images)
        if first:
            if any(m < first <= h for m, h in enumerate(held_by)):
                raise InputError(
                    f"first_message {first}: this chat template renders message(s) before it "
                    "together with it (it moves text across messages), so the turn cannot "
                    "continue a session that holds them: send the conversation from 0"
                )
            head = [t for t, src in plan if not src or max(src) < first]
            return self._continuation(template, turns, segments, first, head, template_tools_)
        return self._with_bos(segments)

    def _raw_segment(self, request: RawPrompt, first: int) -> _Segment:
        """A raw prompt as one segment, once its markers and media agree in number."""
        if first:
            raise InputError("first_message applies to chat input only")
        if not request.text:
            raise InputError("raw prompt is empty")
        n_markers = request.text.count(self.marker)
        if n_markers != len(request.images):
            raise InputError(
                f"raw prompt has {n_markers} media markers ({self.marker!r}) "
                f"but {len(request.images)} images and sounds"
            )
        return _Segment(request.text, list(request.images), 0, request.add_special)

    def _turns(
        self, request: Sequence[Message], tools: Tools | None
    ) -> tuple[list[TemplateMessage], list[list[Media]]]:
        """Each message as the template takes it (its media as markers in its text) and each
        one's media, in order; the chat and its tools checked first, then message by message."""
        if not request:
            raise InputError("chat has no messages")
        if tools is not None:
            try:
                check_tools(tools)
            except ValueError as e:
                raise InputError(str(e)) from None
        turns = []
        images: list[list[Media]] = []
        for i, message in enumerate(request):
            turns.append(self._template_message(message, self._message_text(i, message)))
            images.append([p for p in message.parts if not isinstance(p, str)])
        return turns, images

    def _message_text(self, i: int, message: Message) -> str:
        """Message i's text, a marker where each medium goes; refused for an unknown role, no
        parts nor calls, calls from other than an assistant, or a marker in its text (it would
        be taken for a medium)."""
        if message.role not in ROLES:
            raise InputError(f"message {i}: unknown role {message.role!r} (use {', '.join(ROLES)})")
        if not message.parts and not message.tool_calls:
            raise InputError(f"message {i} has no parts")
        if message.tool_calls and message.role != "assistant":
            raise InputError(f"message {i}: only assistant messages make tool calls")
        text = []
        for j, part in enumerate(message.parts):
            if isinstance(part, str):
                if self.marker in part:
                    raise InputError(
                        f"message {i} part {j}: text contains the media marker "
                        f"{self.marker!r}; send images and sounds as their own parts"
                    )
                text.append(part)
            else:
                text.append(self.marker)
        return "".join(text)

    def _with_bos(self, segments: list[_Segment]) -> list[_Segment]:
        """The segments with text, BOS once in front of the first (a message the template wrote
        nothing for alone has none): from the vocabulary's add_special unless the template
        wrote it."""
        segments = [s for s in segments if s.text]
        bos = self._piece(self.info.bos_token_id)
        if segments:
            segments[0].add_special = not (bos and segments[0].text.startswith(bos))
        return segments

    def _render(
        self,
        template: _Template,
        turns: list[TemplateMessage],
        tools: list[dict[str, Any]] | None,
        prompt: str,
    ) -> tuple[list[tuple[TemplateMessage, list[int]]], list[str], list[int]]:
        """The turns as the template takes them, each with the messages it renders, and the
        pieces. A tool prompt (templates without tools) is a system message of its own, or the
        start of the first one; templates that refuse that, or consecutive messages of one role
        (tool results become user messages), get it merged (Gemma's insist on alternation)."""
        plan = [(t, [i]) for i, t in enumerate(turns)]
        plans = [plan]
        if prompt and turns[0].role == "system":
            plans = [
                [(replace(turns[0], content=f"{prompt}\n\n{turns[0].content}"), [0]), *plan[1:]]
            ]
        elif prompt:
            first = replace(turns[0], content=f"{prompt}\n\n{turns[0].content}")
            plans = [[(TemplateMessage("system", prompt), []), *plan], [(first, [0]), *plan[1:]]]
        plans += [merged for p in plans if (merged := _merge_runs(p)) != p]
        error: TemplateError | None = None
        for candidate in plans:
            try:
                pieces, holders = template.pieces([t for t, _ in candidate], tools)
                return candidate, pieces, holders
            except TemplateError as e:
                error = error or e
        assert error is not None
        raise error

    def _template_message(self, message: Message, content: str) -> TemplateMessage:
        """A message as the template is given it: tool calls and results in the template's
        own form, or (templates without tools) as the JSON text the generic format uses."""
        fmt = self.tool_format
        if fmt is ToolFormat.JSON:
            if message.role == "tool":
                return TemplateMessage(
                    "user", json_result_text(message.name, message.tool_call_id, content)
                )
            if message.tool_calls:
                written = json_call_text(message.tool_calls)
                return TemplateMessage("assistant", f"{content}\n{written}" if content else written)
            return TemplateMessage(message.role, content)
        calls: tuple[dict[str, Any], ...] = tuple(
            {
                "id": call_id(fmt, c.id),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in message.tool_calls
        )
        return TemplateMessage(
            message.role, content, calls, call_id(fmt, message.tool_call_id), message.name
        )

    def _continuation(
        self,
        template: _Template,
        turns: list[TemplateMessage],
        segments: list[_Segment],
        first: int,
        head: list[TemplateMessage],
        tools: list[dict] | None = None,
    ) -> list[_Segment]:
        """Segments of messages[first:], for a session that holds everything before (head:
        the turns the template rendered for them)."""
        if first >= len(turns):
            raise InputError(f"first_message {first} is past the last message ({len(turns) - 1})")
        rest = [s for s in segments if s.message_index >= first]
        if turns[first].role == "assistant":
            before = template.render(head, add_generation_prompt=False, tools=tools)
            prompt = template.render(head, add_generation_prompt=True, tools=tools)
            prompt = prompt[len(before) :]
            reply = rest[0] if rest and rest[0].message_index == first else None
            if reply is not None and reply.text.startswith(prompt):
                reply.text = reply.text[len(prompt) :]
            elif reply is not None and not reply.images and self._thoughtful(template, prompt):
                reply.text = turns[first].content + _after_reply(template, head, tools)
        return [s for s in rest if s.text]

    def _thoughtful(self, template: _Template, prompt: str) -> bool:
        """Whether a generation prompt opens a reasoning model's thought: a reply after it is
        shown without its thoughts (DeepSeek-R1's template drops them), so that a session
        turn, which holds the reply as the model wrote it, continues from that instead."""
        tags = template_reasoning(template.source)
        return tags is not None and tags.opened(prompt) is not None

    def _tokenize(self, segment: _Segment, scope: str) -> list[Chunk]:
        if any(_held(m) for m in segment.images):
            raise InputError(
                "this chat template moves text across messages, so the media before "
                "first_message are part of what is returned: send first_message 0"
            )
        if not segment.images:
            tokens = self.token_cache.tokens(
                scope, segment.text, segment.add_special,
                lambda: native.tokenize_text(
                    self._vocab, segment.text, add_special=segment.add_special, parse_special=True
                ),
            )  # fmt: skip
            return [TextChunk(tokens, segment.message_index)] if tokens else []
        self._check_kinds(segment.images)
        assert self.mtmd is not None
        # counted from their sizes and lengths (placeholder bitmaps): prep never preprocesses
        # pixels or samples; infer tokenizes the real ones and checks that its counts are these
        bitmaps = [_placeholder(m) for m in segment.images]
        raw = self.mtmd.count(segment.text, bitmaps, add_special=segment.add_special)
        groups = [self._group_shape(b) for b in bitmaps]
        return _group(raw, groups, segment)

    def _check_kinds(self, media: Sequence[Media]) -> None:
        if self.mtmd is None:
            raise UnsupportedError(
                "this model was loaded without an mmproj: it takes no images or sounds"
            )
        if not self.mtmd.supports_audio and any(isinstance(m, AudioRef) for m in media):
            raise UnsupportedError(
                self.mtmd.audio_refusal or "this model's projector takes images, not audio"
            )
        if not self.mtmd.supports_vision and any(isinstance(m, ImageRef) for m in media):
            raise UnsupportedError("this model's projector takes audio, not images")

    def _shape_of(self, bitmap: native.Bitmap) -> tuple[native.RawChunk, ...]:
        assert self.mtmd is not None
        return tuple(self.mtmd.media_group(bitmap))


def _after_reply(template: _Template, head: list[TemplateMessage], tools: Any) -> str:
    """What the template writes after a reply's text (its end of turn), found by rendering a
    reply of a sentinel after head."""
    mark = "\ue000slotwise-reply\ue001"
    text = template.render([*head, TemplateMessage("assistant", mark)],
                           add_generation_prompt=False, tools=tools)  # fmt: skip
    return text[text.find(mark) + len(mark) :] if mark in text else ""


def _audio_rate(mtmd: native.Multimodal | None) -> int:
    return mtmd.sample_rate if mtmd is not None and mtmd.supports_audio else 0


def _n_ctx_train(model: int) -> int:
    # vocab-only models skip hparams, so llama_model_n_ctx_train says 0: read the metadata
    arch = native.meta_string(model, "general.architecture")
    value = native.meta_string(model, f"{arch}.context_length") if arch else None
    return int(value) if value and value.isdigit() else 0


def _template_text(template: object) -> str:
    if isinstance(template, BuiltinTemplate):
        return template.name
    return getattr(template, "source", None) or ""


def _fim_tokens(vocab: int) -> dict[str, int]:
    found = {
        name: getattr(llama_cpp, f"llama_vocab_fim_{name}")(vocab)
        for name in ("pre", "suf", "mid", "rep", "sep")
    }
    return {name: t for name, t in found.items() if t >= 0}  # (LLAMA_TOKEN_NULL is -1)


def mtmd_default_marker() -> str:
    from llama_cpp import mtmd_cpp

    marker = mtmd_cpp.mtmd_default_marker()
    return marker.decode() if isinstance(marker, bytes) else str(marker)


def _placeholder(media: Media) -> native.Bitmap:
    if isinstance(media, AudioRef):
        return native.Bitmap.of_sound(media.num_samples, "pcm" if media.pcm else "audio")
    return native.Bitmap(media.width, media.height)


def _numbered_images(segments: list[_Segment]) -> list[_Segment]:
    """Give every image and sound its 1-based media group number across the whole prompt."""
    n = 0
    for s in segments:
        s.first_group = n + 1
        n += len(s.images)
    return segments


def _group(
    raw: list[native.RawChunk], groups: Sequence[Sequence[native.RawChunk]], segment: _Segment
) -> list[Chunk]:
    """Attach group numbers, cutting off the wrapper tokens libmtmd merged into neighbours.

    libmtmd writes e.g. `<|vision_start|>` into the text chunk before an image and
    `<|vision_end|>` into the one after (`<|audio_bos|>` ... around a sound). Tokenizing the
    medium alone gives its group's shape (a sound longer than the projector's window: several
    media chunks); those wrapper tokens are cut from the neighbours so that the group leaves the
    cache whole.
    """
    out: list[Chunk] = []
    msg = segment.message_index
    first_group = segment.first_group
    i = 0
    k = 0
    while i < len(raw):
        c = raw[i]
        if not c.is_media:
            if c.token_ids:
                out.append(TextChunk(c.token_ids, msg))
            i += 1
            continue
        shape = groups[k]
        image = segment.images[k]
        group = first_group + k
        first = next(j for j, g in enumerate(shape) if g.is_media)
        last = max(j for j, g in enumerate(shape) if g.is_media)
        lead = tuple(t for g in shape[:first] for t in g.token_ids)
        trail = tuple(t for g in shape[last + 1 :] for t in g.token_ids)
        if lead:
            prev = out.pop() if out else None
            if not isinstance(prev, TextChunk) or prev.token_ids[-len(lead) :] != lead:
                raise native.NativeError("libmtmd's media wrapper tokens are not where expected")
            if prev.token_ids[: -len(lead)]:
                out.append(TextChunk(prev.token_ids[: -len(lead)], msg, prev.media_group))
            out.append(TextChunk(lead, msg, group))
        for g, c in zip(shape[first : last + 1], raw[i : i + last - first + 1], strict=True):
            if g.is_media != c.is_media or g.num_cells != c.num_cells:
                raise native.NativeError("a medium tokenized alone differs from in context")
            if c.is_media:
                out.append(_media(c, image, msg, group))
            else:
                out.append(TextChunk(c.token_ids, msg, group))
        i += last - first + 1
        k += 1
        if trail:
            nxt = raw[i] if i < len(raw) else None
            if nxt is None or nxt.is_media or nxt.token_ids[: len(trail)] != trail:
                raise native.NativeError("libmtmd's media wrapper tokens are not where expected")
            out.append(TextChunk(trail, msg, group))
            rest = nxt.token_ids[len(trail) :]
            raw[i] = native.RawChunk(False, len(rest), len(rest), rest)
    return out


def _media(c: native.RawChunk, image: Media, msg: int, group: int) -> MediaChunk:
    if isinstance(image, AudioRef):
        return MediaChunk(
            image.media_id, c.num_cells, c.num_positions, image.num_samples, 1, b"", msg, group,
            kind="pcm" if image.pcm else "audio", audio=image.data, pcm=image.pcm,
        )  # fmt: skip
    return MediaChunk(
        media_id=image.media_id,
        num_cells=c.num_cells,
        num_positions=c.num_positions,
        width=image.width,
        height=image.height,
        rgb=b"" if image.encoded else image.rgb,
        message_index=msg,
        media_group=group,
        encoded=image.encoded,
    )


def _message_segments(
    marker: str,
    plan: list[tuple[TemplateMessage, list[int]]],
    pieces: list[str],
    holders: list[int],
    images: list[list[Media]],
) -> tuple[list[_Segment], list[int]]:
    """A segment per message, and the generation prompt's last, from the rendered pieces; and
    for each message, the message whose segment holds its text."""
    n = len(images)
    # each message's piece: a rendered turn made of several messages is the first one's,
    # and a turn the template gave no boundary of its own is its holder's
    texts = [""] * n
    owned: list[list[Media]] = [[] for _ in range(n)]
    held_by = list(range(n))  # message -> the message whose piece holds it
    for k, ((_, sources), piece) in enumerate(zip(plan, pieces, strict=False)):
        holder = plan[holders[k]][1]
        owner = holder[0] if holder else 0  # (the tools' system message: message 0's)
        texts[owner] += piece
        owned[owner] += [im for m in sources for im in images[m]]
        for m in sources:
            held_by[m] = owner
    segments = [_Segment(t, im, i) for i, (t, im) in enumerate(zip(texts, owned, strict=True))]
    if any(s.text.count(marker) != len(s.images) for s in segments):
        # the template moved text across messages: one segment, owned by the last message
        segments = [_Segment("".join(pieces[:-1]), [im for imgs in images for im in imgs], n - 1)]
    segments.append(_Segment(pieces[-1], [], n))  # the generation prompt
    return segments, held_by


def _merge_runs(
    plan: list[tuple[TemplateMessage, list[int]]],
) -> list[tuple[TemplateMessage, list[int]]]:
    """Consecutive user (or assistant) turns as one, their contents joined (each run joined
    once: a run of 4,000 messages is not copied 4,000 times)."""
    runs: list[list[tuple[TemplateMessage, list[int]]]] = []
    for turn, sources in plan:
        last = runs[-1][-1][0] if runs else None
        if last is not None and last.role == turn.role and turn.role in ("user", "assistant"):
            runs[-1].append((turn, sources))
        else:
            runs.append([(turn, sources)])
    out: list[tuple[TemplateMessage, list[int]]] = []
    for run in runs:
        first = run[0][0]
        if len(run) > 1:
            first = replace(
                first,
                content="\n\n".join(t.content for t, _ in run),
                tool_calls=tuple(c for t, _ in run for c in t.tool_calls),
            )
        out.append((first, [m for _, sources in run for m in sources]))
    return out
