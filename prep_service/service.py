"""PrepService: the gRPC edge. Protobuf in, domain calls on worker threads, protobuf out."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from prep_service.chat import TemplateError
from prep_service.image_cache import DEFAULT_IMAGE_CACHE_BYTES, ImageCache
from prep_service.preparer import (
    AudioRef,
    ImageRef,
    InputError,
    Message,
    Part,
    Preparer,
    RawPrompt,
    UnsupportedError,
)
from prep_service.reasoning import template_kwargs
from prep_service.tools import Choice, Tool, ToolCall, ToolFormat, Tools
from slotwise.v1 import prep_pb2, prep_pb2_grpc
from slotwise_core import native
from slotwise_core.descriptors import MediaChunk, memory_kind_pb
from slotwise_core.enum_names import from_numbers, to_numbers
from slotwise_core.images import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_TOTAL_PIXELS,
    ImageError,
    ImageFacts,
    image_facts,
    image_size,
)
from slotwise_core.limits import DEFAULT_MAX_MESSAGES, MAX_TOKENIZE_TEXTS
from slotwise_core.lru import SizedLRU
from slotwise_core.serving import abort, current_tenant
from slotwise_core.sounds import (
    DEFAULT_MAX_SECONDS,
    MAX_SOUNDS_PER_REQUEST,
    AudioError,
    AudioTooLongError,
    audio_id,
)

log = logging.getLogger("slotwise.prep")

_FORMATS = to_numbers(ToolFormat, prep_pb2.ToolFormat, "TOOL_FORMAT_")
_CHOICES = from_numbers(Choice, prep_pb2.ToolChoice, "TOOL_CHOICE_", unset=Choice.AUTO)

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_side: int = 0  # > 0: downscale larger images so neither side exceeds it
    max_images: int = 64
    max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS  # all images of one request together
    max_messages: int = DEFAULT_MAX_MESSAGES  # a chat's, before its template renders any
    max_audio_seconds: float = DEFAULT_MAX_SECONDS  # one sound's length (its header's)


class TooManyTokens(ValueError):
    """A text past a Tokenize's max_tokens: refused before its tokens are sent."""

    def __init__(self, num_tokens: int, max_tokens: int):
        super().__init__(f"the text is {num_tokens} tokens: at most {max_tokens} here")
        self.num_tokens, self.max_tokens = num_tokens, max_tokens


class PrepServicer(prep_pb2_grpc.PrepServiceServicer):
    def __init__(
        self,
        preparer: Preparer,
        *,
        limits: Limits = Limits(),
        workers: int = 2,
        image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
    ):
        self.preparer = preparer
        self.limits = limits
        self.image_cache = ImageCache(image_cache_bytes)
        # a sound file's length by its hash and tenant (a chat resends its sounds every turn:
        # each is decoded once); an entry is an int, so the bound is a count
        self._sound_lengths: SizedLRU[tuple[str, str], int] = SizedLRU(4096, lambda _: 1)
        # mtmd_tokenize is thread-safe: calls proceed in parallel, off the event loop
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prep")
        # the template's thoughts per chat_template_kwargs text (two renderings each)
        self._thoughts = functools.lru_cache(maxsize=64)(
            lambda text: preparer.thoughts(template_kwargs(text))
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def GetModelInfo(self, request, context):
        i = self.preparer.info
        return prep_pb2.GetModelInfoResponse(
            info=prep_pb2.ModelInfo(
                fingerprint=i.fingerprint.to_pb(),
                media_marker=i.media_marker,
                uses_mrope=i.uses_mrope,
                media_non_causal=i.media_non_causal,
                supports_vision=i.supports_vision,
                supports_audio=i.supports_audio,
                n_ctx_train=i.n_ctx_train,
                num_vocab=i.num_vocab,
                bos_token_id=i.bos_token_id if i.bos_token_id >= 0 else None,
                eos_token_id=i.eos_token_id if i.eos_token_id >= 0 else None,
                has_chat_template=i.has_chat_template,
                model_description=i.description,
                chat_template=i.chat_template,
                add_bos=i.add_bos,
                **{f"fim_{name}_token_id": t for name, t in i.fim.items()},
                memory_kind=memory_kind_pb(i.memory_kind),
                audio_sample_rate=i.audio_sample_rate,
                max_audio_seconds=self.limits.max_audio_seconds if i.supports_audio else 0,
            )
        )

    async def Tokenize(self, request, context):
        return await self._run(lambda: self._tokenize(request), context)

    async def TokenizeBatch(self, request, context):
        """Every text in one call, on one worker: a prompt of 20,000 strings is one round trip,
        not 20,000 (their count is bounded, their bytes by the message size)."""
        if len(request.texts) > MAX_TOKENIZE_TEXTS:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.texts)} texts in one call: at most {MAX_TOKENIZE_TEXTS}",
                field="texts",
            )

        def work() -> prep_pb2.TokenizeBatchResponse:
            return prep_pb2.TokenizeBatchResponse(texts=[self._tokenize(t) for t in request.texts])

        return await self._run(work, context)

    def _tokenize(self, request) -> prep_pb2.TokenizeResponse:
        ids = self.preparer.tokenize(
            request.text, add_special=request.add_special, parse_special=request.parse_special
        )
        if request.max_tokens and len(ids) > request.max_tokens:
            raise TooManyTokens(len(ids), request.max_tokens)
        pieces = self.preparer.pieces(ids) if request.with_pieces else []
        return prep_pb2.TokenizeResponse(token_ids=ids, pieces=pieces)

    async def Detokenize(self, request, context):
        def work() -> prep_pb2.DetokenizeResponse:
            pieces = self.preparer.pieces(request.token_ids)
            text = b"".join(pieces).decode("utf-8", errors="replace")
            return prep_pb2.DetokenizeResponse(pieces=pieces, text=text)

        return await self._run(work, context)

    async def Prepare(self, request, context):
        tenant = current_tenant()  # (the pool's threads do not carry the call's context)

        def work() -> prep_pb2.PrepareResponse:
            tools = _tools(request)
            kwargs = _kwargs(request)
            prompt, text = self.preparer.prepare(
                self._request(request, sizes_allowed=False, tenant=tenant),
                request.first_message,
                tools,
                kwargs,
                scope=tenant,
            )
            response = prep_pb2.PrepareResponse(prompt=prompt.to_pb(), rendered_text=text)
            g = self.preparer.tool_grammar(tools) if tools is not None else None
            if g is not None:
                response.tool_calling.format = _FORMATS[self.preparer.tool_format]
                response.tool_calling.constraint.grammar = g.gbnf
                response.tool_calling.constraint.trigger_patterns.extend(g.trigger_patterns)
            chat = kwargs is not None
            thoughts = self._thoughts(request.chat.template_kwargs_json) if chat else None
            if thoughts is not None:
                r = response.reasoning
                r.start, r.end = thoughts.tags.start, thoughts.tags.end
                r.start_token_ids.extend(thoughts.start_ids)
                r.end_token_ids.extend(thoughts.end_ids)
                r.started = thoughts.opened is not None
                r.opened_text, r.num_opened_tokens = thoughts.opened or "", thoughts.num_opened
            return response

        return await self._run(work, context)

    async def CountTokens(self, request, context):
        tenant = current_tenant()

        def work() -> prep_pb2.CountTokensResponse:
            chunks = self.preparer.count(
                self._request(request, sizes_allowed=True, tenant=tenant),
                request.first_message,
                _tools(request),
                _kwargs(request),
                scope=tenant,
            )
            return prep_pb2.CountTokensResponse(
                num_cells=sum(c.num_cells for c in chunks),
                num_positions=sum(c.num_positions for c in chunks),
                chunks=[
                    prep_pb2.ChunkCount(
                        message_index=c.message_index,
                        media_group=c.media_group,
                        is_media=isinstance(c, MediaChunk),
                        is_audio=isinstance(c, MediaChunk) and c.is_audio,
                        num_cells=c.num_cells,
                        num_positions=c.num_positions,
                    )
                    for c in chunks
                ],
            )

        return await self._run(work, context)

    async def _run(self, work, context):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        except TooManyTokens as e:
            await abort(
                context,
                grpc.StatusCode.OUT_OF_RANGE,
                str(e),
                reason="TOO_MANY_TOKENS",
                metadata={"num_tokens": str(e.num_tokens), "max_tokens": str(e.max_tokens)},
            )
        except AudioTooLongError as e:
            await abort(context, grpc.StatusCode.OUT_OF_RANGE, str(e), reason="AUDIO_TOO_LONG")
        except (InputError, ImageError, AudioError, TemplateError) as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnsupportedError as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except native.NativeError as e:
            log.exception("libmtmd failed")
            await abort(context, grpc.StatusCode.INTERNAL, str(e))
        except ValueError as e:  # libmtmd refused the input (e.g. an image it cannot preprocess)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # -- protobuf -> domain -----------------------------------------------------------------

    def _check_total_pixels(self, request) -> None:
        """All images of a request together stay within max_total_pixels, read from the file
        headers before any is decoded (64 images of 33 MP each never reach a decoder)."""
        which = request.WhichOneof("input")
        if which == "raw":
            pbs = list(request.raw.images)
        elif which == "chat":
            pbs = [
                p.image
                for m in list(request.chat.messages)[request.first_message :]
                for p in m.parts
                if p.HasField("image")
            ]
        else:
            return
        if len(pbs) > self.limits.max_images:
            raise InputError(f"more than {self.limits.max_images} images in one request")
        total = 0
        for k, pb in enumerate(pbs):
            if pb.WhichOneof("source") == "data":
                w, h = image_size(pb.data)
            elif pb.WhichOneof("source") == "size":
                w, h = pb.size.width, pb.size.height
            else:
                continue
            total += w * h
            if total > self.limits.max_total_pixels:
                raise InputError(
                    f"the images of this request have more than {self.limits.max_total_pixels} "
                    f"pixels together (image {k} reaches {total}); send fewer or smaller images"
                )

    def _request(self, request, *, sizes_allowed: bool, tenant: str) -> list[Message] | RawPrompt:
        """The request's chat or raw prompt as prepare takes it, each limit checked before the
        work it bounds: the messages' number, then the images' pixels from their headers, then
        each medium as it is read; images are decoded last, once every part was read."""
        which = request.WhichOneof("input")
        if which == "chat" and len(request.chat.messages) > self.limits.max_messages:
            # (before anything is read of them: the template's cost grows with their number)
            raise InputError(
                f"{len(request.chat.messages)} messages in one request: at most "
                f"{self.limits.max_messages} (--max-messages)"
            )
        self._check_total_pixels(request)
        media = _RequestMedia(self, sizes_allowed=sizes_allowed, tenant=tenant)
        if which == "raw":
            return media.decoded(_raw_prompt(request.raw, media))
        if which == "chat":
            first = request.first_message
            messages = [
                _message(m, i, held=i < first, media=media)
                for i, m in enumerate(request.chat.messages)
            ]
            return media.decoded(messages)
        raise InputError("request has neither chat nor raw input")

    def _sound(self, pb, sizes_allowed: bool, tenant: str) -> AudioRef:
        """A sound part as prepare takes it: a file's length from libmtmd's decoder (once per
        file and tenant), float32 samples as they are, or (CountTokens) a length alone."""
        source, limit = pb.WhichOneof("source"), self.limits.max_audio_seconds
        if source == "pcm_f32":
            return self.preparer.samples(pb.pcm_f32, max_seconds=limit)
        if source == "seconds" and sizes_allowed:
            return self.preparer.sound_of_length(pb.seconds, max_seconds=limit)
        if source == "seconds":
            raise InputError("Prepare needs the sound itself, not just its length")
        if source != "data":
            raise InputError("audio has neither data, pcm_f32 nor seconds")
        key = (tenant, audio_id(pb.data))
        n = self._sound_lengths.get(key)
        if n is None:
            ref = self.preparer.sound(pb.data, max_seconds=limit)
            self._sound_lengths.put(key, ref.num_samples)
            return ref
        return AudioRef(n, key[1], data=pb.data)

    def _image_facts(self, files: list[tuple[bytes, str]], tenant: str) -> list[ImageFacts]:
        """Each file's facts, in order: from the cache, or decoded (a file sent twice, once).
        The first file that does not decode is the error, named by where it was.

        (One after the other: several side by side on a second pool gained nothing measurable
        on 2 busy cores, where concurrent requests already use them, and would double the
        decodes, and their memory, in flight.)"""
        cache, limits = self.image_cache, self.limits
        found: list[ImageFacts | None] = [None] * len(files)
        todo: dict[bytes | int, list[int]] = {}  # what to decode -> the files it answers
        for n, (data, _) in enumerate(files):
            key = None
            if cache.enabled:
                key = cache.key(
                    data, max_pixels=limits.max_pixels, max_side=limits.max_side, scope=tenant
                )
            if key is not None and key in todo:
                todo[key].append(n)  # (the same file again in this request)
            elif (facts := cache.find(key)) is not None:
                found[n] = facts
            else:
                todo[n if key is None else key] = [n]

        def decode(n: int) -> ImageFacts:
            data, where = files[n]
            try:
                return image_facts(data, max_pixels=limits.max_pixels, max_side=limits.max_side)
            except ImageError as e:
                raise ImageError(f"{where}: {e}") from None

        for what, ns in todo.items():  # (in order: dicts keep it)
            facts = decode(ns[0])
            for n in ns:
                found[n] = facts
            if isinstance(what, bytes):
                cache.put(what, facts)  # (a file that does not decode never gets here)
        return [f for f in found if f is not None]


class _RequestMedia:
    """The images and sounds of one request as its parts are read: counted, and the sounds'
    lengths added up, as each comes (the first past a limit is the one named); encoded images
    wait in their places as ImageRef(0, 0), decoded together once the whole request was read."""

    def __init__(self, servicer: PrepServicer, *, sizes_allowed: bool, tenant: str):
        self._servicer = servicer
        self._limits = servicer.limits
        self._sizes_allowed = sizes_allowed
        self._tenant = tenant
        self._count = 0  # images and sounds
        self._seconds = 0.0  # the request's sounds together
        self._files: list[tuple[bytes, str]] = []  # the encoded images, in order
        self._holes: list[tuple[list[Any], int]] = []  # where each one's ImageRef goes

    def medium(self, pb, where: str, parts: list[Any]) -> None:
        kind = pb.WhichOneof("kind")
        if kind == "image":
            self.image(pb.image, where, parts)
        elif kind == "audio":
            self.audio(pb.audio, where, parts)
        else:
            raise InputError(f"{where}: a raw prompt's media are images or sounds, not {kind}")

    def image(self, pb, where: str, parts: list[Any]) -> None:
        limits = self._limits
        self._count += 1
        if self._count > limits.max_images:
            raise InputError(f"more than {limits.max_images} images in one request")
        source = pb.WhichOneof("source")
        if source == "data":
            self._files.append((pb.data, where))
            self._holes.append((parts, len(parts)))
            parts.append(ImageRef(0, 0))  # (filled in by decoded, once the request is read)
            return
        if source == "size" and self._sizes_allowed:
            w, h = pb.size.width, pb.size.height
            if w == 0 or h == 0 or w * h > limits.max_pixels:
                raise InputError(
                    f"{where}: size {w}x{h} must be positive and at most {limits.max_pixels} pixels"
                )
            parts.append(ImageRef(w, h))
            return
        if source == "size":
            raise InputError(f"{where}: Prepare needs the image bytes, not just a size")
        raise InputError(f"{where}: image has neither data nor size")

    def audio(self, pb, where: str, parts: list[Any]) -> None:
        limits = self._limits
        self._count += 1
        if self._count > limits.max_images:
            raise InputError(f"more than {limits.max_images} images and sounds in one request")
        try:
            ref = self._servicer._sound(pb, self._sizes_allowed, self._tenant)
        except AudioError as e:
            raise type(e)(f"{where}: {e}") from None
        rate = self._servicer.preparer.info.audio_sample_rate
        self._seconds += ref.num_samples / rate
        if self._seconds > MAX_SOUNDS_PER_REQUEST * limits.max_audio_seconds:
            raise AudioTooLongError(
                f"{where}: the sounds of this request are {self._seconds:.1f} s together, over "
                f"{MAX_SOUNDS_PER_REQUEST} x --max-audio-seconds"
            )
        parts.append(ref)

    def decoded(self, result: T) -> T:
        """result, each encoded image's place in it now its decoded facts and file."""
        all_facts = self._servicer._image_facts(self._files, self._tenant)
        for (parts, k), (data, _), facts in zip(self._holes, self._files, all_facts, strict=True):
            parts[k] = ImageRef(facts.width, facts.height, facts.media_id, facts.reencoded or data)
        return result


def _raw_prompt(raw, media: _RequestMedia) -> RawPrompt:
    """A raw prompt with its images, or its media, read in order (one list or the other)."""
    if raw.images and raw.media:
        raise InputError("a raw prompt has images or media, not both")
    images: list[Any] = []
    for k, im in enumerate(raw.images):
        media.image(im, f"image {k}", images)
    for k, part in enumerate(raw.media):
        media.medium(part, f"medium {k}", images)
    return RawPrompt(raw.text, images, raw.add_special)


def _message(m, i: int, *, held: bool, media: _RequestMedia) -> Message:
    """Message i with its parts read and its tool calls' arguments parsed (held: a session
    holds the message, and so its media)."""
    parts: list[Part] = []
    for j, p in enumerate(m.parts):
        kind = p.WhichOneof("kind")
        if kind == "text":
            parts.append(p.text)
        elif kind in ("image", "audio") and held:
            # a session holds it: only its marker is rendered, never decoded or
            # counted (a long session's earlier media cost nothing, and no limit)
            parts.append(ImageRef(0, 0) if kind == "image" else AudioRef(0))
        elif kind in ("image", "audio"):
            media.medium(p, f"message {i} part {j}", parts)
        else:
            raise InputError(f"message {i} part {j} is empty (neither text, image nor audio)")
    calls = [
        ToolCall(c.id, c.name, _json_object(c.arguments_json, f"message {i} call {k}"))
        for k, c in enumerate(m.tool_calls)
    ]
    return Message(m.role, parts, calls, m.tool_call_id, m.name)


def _tools(request) -> Tools | None:
    """The chat's tools and tool choice (None: a raw prompt, or a chat without tools)."""
    if request.WhichOneof("input") != "chat":
        return None
    chat = request.chat
    if chat.tool_choice not in _CHOICES:
        raise InputError(f"unknown tool_choice {chat.tool_choice}")
    if not chat.tools and chat.tool_choice in (
        prep_pb2.TOOL_CHOICE_UNSPECIFIED,
        prep_pb2.TOOL_CHOICE_NONE,
    ):
        return None
    tools = tuple(
        Tool(t.name, t.description, _json_object(t.parameters_json or "{}", f"tool {t.name!r}"))
        for t in chat.tools
    )
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
    return Tools(tools, _CHOICES[chat.tool_choice], chat.tool_name, parallel)


def _kwargs(request) -> dict[str, Any] | None:
    """A chat's template variables (None: a raw prompt)."""
    if request.WhichOneof("input") != "chat":
        return None
    try:
        return template_kwargs(request.chat.template_kwargs_json)
    except ValueError as e:
        raise InputError(str(e)) from None


def _json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InputError(f"{where}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InputError(f"{where}: a JSON object is needed, got {type(value).__name__}")
    return value
