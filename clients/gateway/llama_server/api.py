"""llama-server's native HTTP API over slotwise, for the tools built for llama-server.

/completion, /infill, /tokenize, /detokenize, /apply-template, /props, /slots and its
actions, /embedding, /rerank and the input_tokens counts answer with llama-server's field
names, defaults and shapes, and its error body: {"error": {"code", "message", "type"}}. A
completion is a turn (turns.py) like any other API's, on the same engine: shift policies,
tenants, limits, images and sounds (multimodal_data, at the media markers /props names, each
told by its bytes: sounds.py) and grammars.
A native slot (id_slot, /slots/{id}) is a session (slots.py).

Its bodies are read in settings.py. README.md ("llama-server's native API") lists where
slotwise answers differently, and why. A request's work is bounded before it starts: the
generations one /completion starts (max_completions), the tokens a /tokenize answers with, the
texts tokenized (all of one request in one TokenizeBatch call), a chat's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from clients.client import (
    AsyncSlotwiseClient,
    FinishReason,
    LoraAdapter,
    Message,
    ModelInfo,
    Prepared,
    ServerInfo,
    SlotwiseError,
    TokenLogprobs,
)
from clients.gateway import generation, sse
from clients.gateway.bodies import parse
from clients.gateway.chat import (
    SYSTEM_FINGERPRINT,
    chat_messages,
    check_messages,
    continuation,
    prefilled,
)
from clients.gateway.choices import choices, interleaved, start_all, wholes
from clients.gateway.config import DEFAULT_MAX_COMPLETIONS
from clients.gateway.errors import (
    ApiError,
    call,
    check_message_count,
    from_slotwise,
    invalid,
    translated,
)
from clients.gateway.llama_server.settings import (
    ERROR_TYPES,
    Settings,
    bad,
    bias_texts,
    get,
    lora_of,
    n_cmpl_of,
    native_error,
    settings_of,
)
from clients.gateway.llama_server.slots import Lease, Slots
from clients.gateway.media import MediaPolicy, check_image_count
from clients.gateway.schema import ChatMessage
from clients.gateway.sounds import multimodal_item
from clients.gateway.turns import (
    Progress,
    StreamClock,
    Text,
    Thinking,
    Turn,
    TurnEnd,
    TurnRequest,
    per_token,
)
from slotwise.v1 import prompt_pb2
from slotwise_core.limits import DEFAULT_MAX_MESSAGES, MAX_TOKENIZE_TEXTS

__all__ = ["LlamaServer", "error_body", "error_response"]

BUILD_INFO = SYSTEM_FINGERPRINT

# what one request may ask of the services, bounded before any of it starts (and the
# generations of one /completion: config.py's DEFAULT_MAX_COMPLETIONS)
MAX_TOKENIZE_TOKENS = 1 << 20  # tokens a /tokenize answers with (about 4 MB of text)
MAX_PIECE_TOKENS = 1 << 16  # ... with each one's piece (an object each: 1 GB for 2 MB of text)
TOKEN_IDS = 1 << 31  # ids are int32 on the wire (a vocabulary is far smaller)

# -- errors ----------------------------------------------------------------------------------


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(e.retry_after)))} if e.retry_after else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def check_token_id(t: int, field: str) -> None:
    """A token id as the contract carries one (int32): past that it is named here, not by
    protobuf's range error (prep then refuses an id outside the vocabulary)."""
    if not -TOKEN_IDS <= t < TOKEN_IDS:
        raise bad(f"Field '{field}': {t} is not a token id")


def too_many_tokens(field: str, limit: int) -> ApiError:
    return bad(f"Field '{field}': more than {limit} tokens; send it in parts")


async def json_response(build: Callable[[], Any]) -> Response:
    """A large answer built and written as JSON off the event loop (as JSONResponse writes it),
    so that /health and every other request go on meanwhile."""

    def write() -> bytes:
        return json.dumps(
            build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode()

    return Response(await asyncio.to_thread(write), media_type="application/json")


def error_body(e: ApiError) -> dict[str, Any]:
    """An error in llama-server's shape: {"error": {"code", "message", "type"}}; a prompt that
    can never fit is its exceed_context_size_error, with the numbers."""
    error: dict[str, Any] = {"code": e.status, "message": e.message}
    error["type"] = e.type if e.type in ERROR_TYPES.values() else ERROR_TYPES.get(e.status, e.type)
    if e.code == "context_length_exceeded":
        needed, capacity = e.metadata.get("cells_needed"), e.metadata.get("capacity")
        if needed and capacity:
            error["message"] = (
                f"request ({needed} tokens) exceeds the available context size ({capacity} "
                "tokens), try increasing it"
            )
            error.update(n_prompt_tokens=int(needed), n_ctx=int(capacity))
        error["type"] = "exceed_context_size_error"
    return {"error": error}


# -- prompts ----------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One prompt of a /completion, prepared: its chunks, and its text as llama-server echoes
    it (the prompt's tokens detokenized; an image adds nothing)."""

    prepared: Prepared
    text: str = ""


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and any(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def split_prompts(prompt: Any) -> list[Any]:
    """llama-server's tokenize_input_prompts: one prompt (a text, tokens, tokens mixed with
    texts, or {prompt_string, multimodal_data}), or a list of them."""
    if isinstance(prompt, str | dict) or _is_tokens(prompt):
        return [prompt]
    if isinstance(prompt, list):
        if not prompt:
            raise bad('"prompt" must not be empty')
        return list(prompt)
    raise bad(
        '"prompt" elements must be a string, a list of tokens, a JSON object containing a '
        "prompt string, or a list of mixed strings & tokens."
    )


def prepared_of(info: ModelInfo, token_ids: Sequence[int]) -> Prepared:
    """A prompt of token ids as the contract carries it: one text chunk (for this model)."""
    pb = prompt_pb2.PreparedPrompt(
        fingerprint=prompt_pb2.Fingerprint(
            model=info.model_fingerprint, mmproj=info.mmproj_fingerprint
        ),
        chunks=[prompt_pb2.Chunk(text=prompt_pb2.TextChunk(token_ids=list(token_ids)))],
        num_cells=len(token_ids),
        num_positions=len(token_ids),
    )
    return Prepared(pb)


class LlamaServer:
    """The native API for one caller's client (the tenant its key names)."""

    def __init__(
        self,
        client: AsyncSlotwiseClient,
        *,
        model: str,
        media: MediaPolicy,
        slots: Slots,
        ui: bool,
        cors: bool,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        max_completions: int = DEFAULT_MAX_COMPLETIONS,
        defaults: Settings | None = None,
        model_path: str = "",
        thinking: Thinking = Thinking(),
    ):
        self.client, self.model, self.media, self.slots = client, model, media, slots
        self.ui, self.cors = ui, cors
        self.max_messages, self.max_completions = max_messages, max_completions
        # a /completion's defaults (the server's --temp and --seed), the model file's path
        self.defaults, self.model_path = defaults, model_path
        self.thinking = thinking  # (the template's variables: --chat-template-kwargs, ...)

    async def info(self) -> ModelInfo:
        return await call(self.client.model_info())

    async def server(self) -> ServerInfo:
        return await call(self.client.server_info())

    # -- tokens -----------------------------------------------------------------------------

    async def tokens_of(
        self,
        value: Any,
        *,
        add_special: bool,
        parse_special: bool,
        field: str = "prompt",
        max_tokens: int = 0,
    ) -> list[int]:
        """llama-server's tokenize_mixed: a text, or texts and token ids mixed; a text first
        in line gets the vocabulary's special tokens (BOS) when add_special. Every text in one
        call (at most MAX_TOKENIZE_TEXTS); max_tokens > 0: more tokens are refused (400)."""
        parts = value if isinstance(value, list) else [value]
        for part in parts:
            if isinstance(part, int) and not isinstance(part, bool):
                check_token_id(part, field)
            elif not isinstance(part, str):
                raise bad(f'"{field}" elements must be strings or token ids')
        texts = [p for p in parts if isinstance(p, str)]
        if len(texts) > MAX_TOKENIZE_TEXTS:
            raise bad(f'"{field}": {len(texts)} texts, at most {MAX_TOKENIZE_TEXTS} in a request')
        specials = [add_special and k == 0 for k, p in enumerate(parts) if isinstance(p, str)]
        got = await self.tokenize_texts(texts, specials, parse_special, field, max_tokens)
        tokenized = iter(got)
        out: list[int] = []
        for part in parts:
            out += next(tokenized) if isinstance(part, str) else [part]
            if max_tokens and len(out) > max_tokens:
                raise too_many_tokens(field, max_tokens)
        return out

    async def tokenize_texts(
        self,
        texts: list[str],
        add_special: list[bool],
        parse_special: bool,
        field: str,
        max_tokens: int = 0,
    ) -> list[tuple[int, ...]]:
        """Each text's tokens: one Tokenize for one text (refused by prep past max_tokens,
        before they are sent), one TokenizeBatch for several (a prompt of 20,000 strings is one
        round trip)."""
        if not texts:
            return []
        if len(texts) > 1:
            many = self.client.tokenize_batch(
                texts, add_special=add_special, parse_special=parse_special
            )
            return [t.token_ids for t in await call(many)]
        try:
            one = await self.client.tokenize(
                texts[0], add_special=add_special[0], parse_special=parse_special,
                max_tokens=max_tokens,
            )  # fmt: skip
        except SlotwiseError as e:
            too_many = e.reason == "TOO_MANY_TOKENS"
            raise too_many_tokens(field, max_tokens) if too_many else from_slotwise(e) from None
        return [one.token_ids]

    async def tokenize(self, body: dict[str, Any]) -> Response:
        """The content's tokens, at most MAX_TOKENIZE_TOKENS (MAX_PIECE_TOKENS with each one's
        piece): refused past them, and written as JSON off the event loop."""
        if "content" not in body:
            return JSONResponse({"tokens": []})
        pieces = get(body, "with_pieces", "boolean", False)
        ids = await self.tokens_of(
            body["content"],
            add_special=get(body, "add_special", "boolean", False),
            parse_special=get(body, "parse_special", "boolean", True),
            field="content",
            max_tokens=MAX_PIECE_TOKENS if pieces else MAX_TOKENIZE_TOKENS,
        )
        if not pieces:
            return await json_response(lambda: {"tokens": ids})
        shown = (await call(self.client.detokenize(ids))).pieces if ids else ()
        return await json_response(
            lambda: {
                "tokens": [{"id": t, "piece": _piece(p)} for t, p in zip(ids, shown, strict=True)]
            }
        )

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = get(body, "tokens", "array", [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("Field 'tokens': type must be array of numbers")
        for t in ids:
            check_token_id(t, "tokens")
        if not ids:
            return {"content": ""}
        return {"content": (await call(self.client.detokenize(ids))).text}

    # -- chat templates ---------------------------------------------------------------------

    async def chat_prompt(self, body: dict[str, Any]) -> Prepared:
        """The prompt a chat becomes, with llama-server's checks: a final assistant message is
        continued (prefilled), not answered."""
        messages = chat_body(body, self.max_messages)
        continued = continuation(
            messages, body.get("continue_final_message"), body.get("add_generation_prompt", True)
        )
        chat = await chat_messages(messages, self.media)
        kwargs = generation.thinking_of(self.thinking, body).kwargs  # (chat_template_kwargs, ...)
        if continued:
            return await prefilled(self.client, chat, template_kwargs=kwargs)
        if body.get("add_generation_prompt") is False:
            raise bad("add_generation_prompt false: slotwise writes the generation prompt")
        return await call(self.client.prepare(chat, template_kwargs=kwargs))

    async def apply_template(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": (await self.chat_prompt(body)).rendered_text}

    async def input_tokens(self, body: dict[str, Any], *, responses: bool) -> dict[str, Any]:
        if responses:
            body = await responses_as_chat(body)
        prepared = await self.chat_prompt(body)
        return {"input_tokens": prepared.num_cells, "object": "response.input_tokens"}

    # -- completions -------------------------------------------------------------------------

    async def prompt(self, value: Any, info: ModelInfo) -> Prompt:
        if isinstance(value, dict):
            text = value.get("prompt_string")
            data = value.get("multimodal_data") or []
            if not isinstance(text, str) or not isinstance(data, list):
                raise bad('"prompt_string" must be a string, "multimodal_data" an array')
            # no projector at all, in llama-server's words; a projector that does not take the
            # kind given is prep's to refuse (FAILED_PRECONDITION, 400), saying which it takes
            if data and not info.mmproj_fingerprint:
                raise bad(
                    "Multimodal data provided, but model does not support multimodal requests."
                )
            check_image_count(len(data), self.media, "multimodal_data", "images and sounds")
            media = [multimodal_item(d, self.media, k) for k, d in enumerate(data)]
            prepared = await call(self.client.prepare(text, media))
            return Prompt(prepared, await self.text_of(prepared))
        if isinstance(value, str):
            if not value:
                raise bad('"prompt" must not be empty')
            prepared = await call(self.client.prepare(value))
            return Prompt(prepared, await self.text_of(prepared))
        ids = await self.tokens_of(value, add_special=True, parse_special=True)
        if not ids:
            raise bad('"prompt" must not be empty')
        if any(not 0 <= t < info.num_vocab for t in ids):
            raise bad("Prompt contains invalid tokens")
        prepared = prepared_of(info, ids)
        return Prompt(prepared, await self.text_of(prepared))

    async def text_of(self, prepared: Prepared) -> str:
        ids = [t for c in prepared.prompt.chunks for t in c.text.token_ids]
        return (await call(self.client.detokenize(ids))).text if ids else ""

    async def completion(
        self, body: dict[str, Any], *, prompts: list[Prompt] | None = None
    ) -> Response:
        if prompts is None:
            if "prompt" not in body:
                raise bad('"prompt" is required')
            values = split_prompts(body["prompt"])
            self._check_fan_out(len(values), n_cmpl_of(body))
            info = await self.info()
            prompts = [await self.prompt(p, info) for p in values]
        s = settings_of(body, await self._bias_texts(body.get("logit_bias")), self.defaults)
        runs = [
            _Run(i * s.n_cmpl + j, p, s, req)
            for i, p in enumerate(prompts)
            for j, req in enumerate(choices(self._turn(p, s), s.n_cmpl))
        ]
        if len(runs) == 1 and s.id_slot >= 0:
            server = await self.server()
            if s.id_slot < server.num_slots:  # (llama-server takes any slot for another id)
                return await self._on_slot(runs[0], s.id_slot)
        return await self._respond(runs)

    async def _on_slot(self, run: _Run, slot: int) -> Response:
        """One completion on a native slot: a turn of the slot's session, sending only what
        of the prompt the session lacks; the slot is held until the answer is done."""
        prompt = run.request.prompt
        assert isinstance(prompt, Prepared)
        lease = await self.slots.acquire(self.client, slot, prompt)
        try:
            return await self._respond([_Run.leased(run, lease)], lease)
        except BaseException:
            lease.release()
            raise

    def _check_fan_out(self, num_prompts: int, n_cmpl: int) -> None:
        """Refuse a /completion of more generations than max_completions before any prompt is
        prepared: started all at once, they would fill the queue that every caller shares (and
        fail in part, the rest cancelled)."""
        if num_prompts * n_cmpl > self.max_completions:
            raise bad(
                f"{num_prompts} prompts x n_cmpl {n_cmpl} = {num_prompts * n_cmpl} completions: "
                f"at most {self.max_completions} in one request (--max-completions); send the "
                "prompts in several requests"
            )

    async def _bias_texts(self, value: Any) -> dict[str, list[int]]:
        """The texts logit_bias names, tokenized as llama-server does (no BOS, special tokens
        as text), in one call."""
        texts = list(dict.fromkeys(bias_texts(value)))
        if len(texts) > MAX_TOKENIZE_TEXTS:
            raise bad(f"logit_bias: {len(texts)} texts, at most {MAX_TOKENIZE_TEXTS}")
        ids = await self.tokenize_texts(texts, [False] * len(texts), False, "logit_bias")
        return {t: list(i) for t, i in zip(texts, ids, strict=True)}

    def _turn(self, p: Prompt, s: Settings) -> TurnRequest:
        o = s.slotwise
        cells = p.prepared.num_cells
        keep = cells if s.n_keep < 0 else min(s.n_keep, cells)
        # (llama-server never cuts a prompt: slotwise's truncate only when asked for)
        truncate = o.truncate if "truncate" in o.model_fields_set else False
        schema = (s.json_schema or {"type": "object"}) if s.json_schema is not None else None
        return TurnRequest(
            p.prepared,
            max_tokens=max(s.n_predict, 1) if s.n_predict >= 0 else None,
            stop=s.stop,
            sampling=s.sampling(),
            context=generation.context_of(o, truncate),
            keep=generation.keep_of(o, keep),
            constraint=generation.grammar_constraint(s.grammar, schema),
            constraint_param="grammar" if s.grammar else "json_schema",
            logit_bias=dict(s.logit_bias),
            logprobs=s.n_probs > 0,
            top_logprobs=s.n_probs,
            # no reuse across requests: a salt no other request has
            cache_salt=o.cache_salt if s.cache_prompt else f"no-cache-{uuid.uuid4().hex}",
            speculative=s.speculative,
            ignore_eos=s.ignore_eos,  # (every end-of-generation token, banned by the engine)
            lora=s.lora,
        )

    # -- LoRA adapters ----------------------------------------------------------------------

    async def lora_adapters(self) -> list[dict[str, Any]]:
        """GET /lora-adapters: the adapters infer loaded, with the scales the caller's
        requests get when they name none (its tenant's)."""
        return [_lora_json(a) for a in await call(self.client.lora_adapters())]

    async def set_lora_adapters(self, raw: bytes) -> dict[str, Any]:
        """POST /lora-adapters: [{"id", "scale"}, ...], the adapters not listed at 0."""
        try:
            body = parse(raw) if raw.strip() else None
        except json.JSONDecodeError as e:
            raise bad(f"the body is not JSON: {e}") from None
        if not isinstance(body, list):
            raise bad("Request body must be an array")
        await call(self.client.set_lora_scales(lora_of(body)))
        return {"success": True}

    async def _respond(self, runs: list[_Run], lease: Lease | None = None) -> Response:
        """The completions' answer: streamed, or whole. A slot's lease is released when it is
        done (a stream's when the stream ends, however it ends)."""
        turns = await start_all(self.client, [r.request for r in runs])
        for r, t in zip(runs, turns, strict=True):
            r.turn = t
        if runs[0].settings.stream:
            return sse.response(self._stream(runs, lease))
        await wholes(runs)
        out = [r.final(self.model) for r in runs]
        if lease is not None:
            lease.release()
        return JSONResponse(out[0] if len(out) == 1 else out)

    async def _stream(self, runs: list[_Run], lease: Lease | None) -> AsyncGenerator[str, None]:
        try:
            chunks = interleaved([r.chunks(self.model, self.client) for r in runs])
            async with contextlib.aclosing(chunks):
                async for _, chunk in chunks:
                    yield sse.data(chunk)
        except ApiError as e:  # the headers are out: the error goes as data
            yield sse.data(error_body(e))
        finally:
            for r in runs:
                await r.close()
            if lease is not None:
                lease.release()

    async def infill(self, body: dict[str, Any]) -> Response:
        info = await self.info()
        missing = "".join(
            f"{what} token is missing. "
            for what, name in (("prefix", "pre"), ("suffix", "suf"), ("middle", "mid"))
            if name not in info.fim
        )
        if missing:
            raise native_error(501, f"Infill is not supported by this model: {missing}")
        if "prompt" in body and not isinstance(body["prompt"], str):
            raise bad('"prompt" must be a string')
        for name in ("input_prefix", "input_suffix"):
            if name not in body:
                raise bad(f'"{name}" is required')
        extra = get(body, "input_extra", "array", [])
        for chunk in extra:
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                raise bad('extra_context chunk must contain a "text" field with a string value')
            if "filename" in chunk and not isinstance(chunk["filename"], str):
                raise bad('extra_context chunk\'s "filename" field must be a string')
        server = await self.server()
        prepared = prepared_of(info, await self._infill_tokens(body, extra, info, server))
        return await self.completion(body, prompts=[Prompt(prepared, await self.text_of(prepared))])

    async def _infill_tokens(
        self, body: dict[str, Any], extra: list[dict[str, str]], info: ModelInfo, server: ServerInfo
    ) -> list[int]:
        """llama-server's format_prompt_infill: [extra context] [BOS] PRE prefix SUF suffix MID
        prompt, the prefix and suffix cut to a batch (3:1), the extra context to what is left."""

        async def plain(text: Any) -> list[int]:
            return await self.tokens_of(text, add_special=False, parse_special=False)

        fim = info.fim
        prefix, suffix = await plain(body["input_prefix"]), await plain(body["input_suffix"])
        prompt = (
            await self.tokens_of(body.get("prompt", ""), add_special=False, parse_special=True)
            if body.get("prompt")
            else []
        )
        extra_tokens = await self._extra_tokens(extra, fim)
        # what llama-server cuts the prefix, suffix and extra context to, with its defaults
        # (--batch-size 2048, --n-predict -1)
        n_batch, n_predict, n_ctx = 2048, -1, server.num_cells_per_slot
        take_prefix = min(len(prefix), 3 * (n_batch // 4))
        take_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
        take_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
        head = [fim["pre"], *prefix[len(prefix) - take_prefix :], *prompt]
        if info.add_bos and info.bos_token_id >= 0:
            head.insert(0, info.bos_token_id)
        extra_kept = extra_tokens[len(extra_tokens) - take_extra :] if take_extra else []
        return [*extra_kept, *head, fim["suf"], *suffix[:take_suffix], fim["mid"]]

    async def _extra_tokens(self, extra: list[dict[str, str]], fim: dict[str, int]) -> list[int]:
        """format_prompt_infill's extra context: [REP myproject] then each chunk's [SEP]
        filename (or a snippet line) and text, then [SEP filename]; its texts in one call."""
        sep = [fim["sep"]] if "sep" in fim else []
        texts = ["myproject\n"] if "rep" in fim else []
        for chunk in extra:
            head = chunk.get("filename", "tmp") + "\n" if sep else "\n\n--- snippet ---\n\n"
            texts += [head, chunk["text"]]
        texts += ["filename\n"] if sep else []
        if len(texts) > MAX_TOKENIZE_TEXTS:
            raise bad(f"input_extra: {len(extra)} chunks, more than one request takes")
        tokens = iter(await self.tokenize_texts(texts, [False] * len(texts), False, "input_extra"))
        out = [fim["rep"], *next(tokens)] if "rep" in fim else []
        for _ in extra:
            out += [*sep, *next(tokens), *next(tokens)]
        return out + ([*sep, *next(tokens)] if sep else [])

    # -- the server ---------------------------------------------------------------------------

    async def props(self) -> dict[str, Any]:
        info, server = await asyncio.gather(self.info(), self.server())
        pieces = [t for t in (info.bos_token_id, info.eos_token_id) if t >= 0]
        named = (await call(self.client.detokenize(pieces))).pieces if pieces else ()
        token = dict(zip(pieces, (_text(p) for p in named), strict=True))
        return {
            "default_generation_settings": {
                "params": (self.defaults or Settings()).params(full=False),
                "n_ctx": server.num_cells_per_slot,
            },
            "total_slots": server.num_slots,
            "model_alias": self.model,
            "model_ftype": "",
            "model_path": self.model_path or info.model_description,
            "modalities": {
                "vision": info.supports_vision,
                "video": False,
                "audio": info.supports_audio,
            },
            "media_marker": info.media_marker,
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "ui": self.ui,
            "ui_settings": {},
            "chat_template": info.chat_template,
            "chat_template_caps": await self._caps(info),
            "bos_token": token.get(info.bos_token_id, ""),
            "eos_token": token.get(info.eos_token_id, ""),
            "build_info": BUILD_INFO,
            "is_sleeping": False,
            "cors_proxy_enabled": False,
            "slotwise": {
                "shift_policy": "auto",
                "num_cells_per_slot": server.num_cells_per_slot,
                "can_shift": server.can_shift,
                "uses_mrope": server.uses_mrope,
                "memory": server.memory_kind,
                "cache_type_k": server.cache_type_k,
                "cache_type_v": server.cache_type_v,
                "flash_attn": server.flash_attn,
                "bytes_per_cell": server.num_bytes_per_cell,
                "ctx_checkpoints": server.num_checkpoints_per_slot,
                "n_ctx_train": server.n_ctx_train,
                "batch_size": server.batch_size,
                "ubatch_size": server.ubatch_size,
                "media_non_causal": info.media_non_causal,
                "model_fingerprint": info.model_fingerprint,
                "mmproj_fingerprint": info.mmproj_fingerprint,
                "cors": self.cors,
            },
        }

    async def _caps(self, info: ModelInfo) -> dict[str, bool]:
        """The template's capabilities, read from its text (and the system role by rendering
        one: a template may write it from the message's role without naming it)."""
        src = info.chat_template
        system = False
        if info.has_chat_template:
            probe = "\x1fsystem-probe\x1f"
            try:
                shown = await self.client.prepare([Message.system(probe), Message.user("x")])
                system = probe in shown.rendered_text
            except SlotwiseError:
                system = False
        calls = "tool_calls" in src
        return {
            "supports_object_arguments": calls and "tojson" in src,
            "supports_parallel_tool_calls": calls,
            "supports_preserve_reasoning": "reasoning_content" in src,
            "supports_reasoning_effort": "reasoning_effort" in src,
            "supports_string_content": True,
            "supports_system_role": system,
            "supports_tool_calls": calls,
            "supports_tools": "tools" in src,
            "supports_typed_content": False,
        }

    async def get_slots(self, fail_on_no_slot: bool) -> Response:
        server = await self.server()
        view = None
        with translated():
            async for v in self.client.watch_slots(once=True):
                view = v
        busy = {3, 4}  # SLOT_STATE_PREFILLING, SLOT_STATE_DECODING
        states = {s.slot: s for s in view.slots} if view is not None else {}
        out = []
        for k in range(server.num_slots):
            s = states.get(k)
            processing = s is not None and s.state in busy
            entry: dict[str, Any] = {
                "id": k,
                "n_ctx": server.num_cells_per_slot,
                "speculative": False,
                "is_processing": processing,
            }
            if s is not None:
                entry["slotwise"] = {
                    "state": ("unspecified", "free", "idle", "prefilling", "decoding")[s.state],
                    "num_cells": s.num_cells,
                    "next_position": s.next_position,
                    "session_id": s.session_id,
                    "visible": s.visible,
                }
            out.append(entry)
        if fail_on_no_slot and all(e["is_processing"] for e in out):
            raise native_error(503, "no slot available")
        return JSONResponse(out)

    async def slot_action(self, slot: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """/slots/{id}?action=save|restore|erase (the slot and the action checked already)."""
        if action == "erase":
            return await self.slots.erase(self.client, slot)
        if "filename" not in body:
            raise native_error(400, '"filename" is required')
        act = self.slots.save if action == "save" else self.slots.restore
        return await act(self.client, slot, body["filename"])

    async def embedding(self, body: dict[str, Any]) -> Response:
        if "input" in body:
            value = body["input"]
        elif "content" in body:
            value = body["content"]
        else:
            raise bad('"input" or "content" must be provided')
        texts = value if isinstance(value, list) and not _is_tokens(value) else [value]
        if not texts:
            raise bad('"input" must not be empty')
        if not all(isinstance(t, str) for t in texts):
            raise bad("slotwise embeds texts: give strings, not token ids")
        if any(not t for t in texts):
            raise bad("Input content cannot be empty")
        norm = get(body, "embd_normalize", "integer", 2)
        try:
            out = await self.client.embed(texts, normalize=False)
        except SlotwiseError as e:
            refused = from_slotwise(e)
            if refused.status == 501:
                refused = native_error(
                    501, "This server does not support embeddings. Start it with `--embeddings`"
                )
            raise refused from None
        return JSONResponse(
            [
                {"index": i, "embedding": [_normalized(list(e.values), norm)]}
                for i, e in enumerate(out)
            ]
        )


# -- one completion's answer ------------------------------------------------------------------


@dataclass
class _Run:
    """One completion (a prompt, or one of its n_cmpl): its turn and how to show it."""

    index: int
    prompt: Prompt
    settings: Settings
    request: TurnRequest
    turn: Turn | None = None
    end: TurnEnd | None = None
    slot: int | None = None  # the native slot it ran on (id_slot)
    held: int = 0  # the prompt's cells the slot's session held: not sent again

    @staticmethod
    def leased(run: _Run, lease: Lease) -> _Run:
        """The run as a turn of the leased slot's session: only what of the prompt the
        session lacks is sent, and the turn keeps what its prompt was (its note)."""
        request = replace(
            run.request,
            prompt=lease.rest,
            session_id=lease.session_id,
            expect_turns=lease.expect_turns,
            note=lambda _: lease.note,
        )
        return replace(run, request=request, slot=lease.slot, held=lease.held)

    async def whole(self) -> TurnEnd:
        assert self.turn is not None
        self.end = await self.turn.whole()
        return self.end

    async def close(self) -> None:
        if self.turn is not None:
            await self.turn.close()

    def final(self, model: str, *, streamed: bool = False) -> dict[str, Any]:
        end, s = self.end, self.settings
        assert end is not None
        usage = end.finished.usage if end.finished else None
        prompt_cells = self.held + (end.num_prompt_cells or self.prompt.prepared.num_cells)
        stop_type = _stop_type(end)
        # llama-server counts the end-of-generation token it sampled among those predicted
        generated = end.num_completion_tokens + (stop_type == "eos")
        timings = end.timings()
        timings["cache_n"] += self.held
        timings["predicted_n"] = generated
        slot = self.slot if self.slot is not None else end.started.slot if end.started else -1
        result: dict[str, Any] = {
            "index": self.index,
            "content": "" if streamed else end.raw_text,
            "tokens": list(end.token_ids) if s.return_tokens and not streamed else [],
            "id_slot": slot,
            "stop": True,
            "model": model,
            "tokens_predicted": generated,
            "tokens_evaluated": prompt_cells,
            "generation_settings": s.params(),
            "prompt": self.prompt.text,
            "has_new_line": "\n" in end.raw_text,
            "truncated": bool(
                (end.started and end.started.num_truncated_cells) or (usage and usage.num_shifts)
            ),
            "stop_type": stop_type,
            "stopping_word": end.finished.stop_string if end.finished else "",
            "tokens_cached": prompt_cells + max(generated - 1, 0),
            "timings": timings,
        }
        if end.logprobs and not streamed:
            result["completion_probabilities"] = probabilities(end.logprobs)
        if s.response_fields:
            return _fields(result, s.response_fields)
        return result

    async def chunks(
        self, model: str, client: AsyncSlotwiseClient
    ) -> AsyncIterator[dict[str, Any]]:
        """The stream's partial results, then the final one."""
        assert self.turn is not None
        s, generated, clock = self.settings, 0, StreamClock()
        shown_progress = -1
        async for e in self.turn.all_events():
            st = self.turn.end.started
            reused = self.held + (st.num_reused_cells if st else 0)
            total = self.held + (st.num_prompt_cells if st else self.prompt.prepared.num_cells)
            if isinstance(e, Progress | Text) and s.return_progress and shown_progress < total:
                done = reused + e.done if isinstance(e, Progress) else total
                if shown_progress < 0 and done > reused:
                    yield self._progress(reused, total, reused, clock)
                yield self._progress(reused, total, done, clock)
                shown_progress = done
            if isinstance(e, Progress):
                continue
            if isinstance(e, Text):
                clock.token()
                for one in await per_token(client, e):  # (a chunk a token, as llama-server)
                    generated += len(one.token_ids)
                    chunk: dict[str, Any] = {
                        "index": self.index,
                        "content": one.text,
                        "tokens": list(one.token_ids),
                        "stop": False,
                        "id_slot": -1,
                        "tokens_predicted": generated,
                        "tokens_evaluated": total,
                    }
                    if s.timings_per_token:
                        chunk["timings"] = clock.timings(reused, total - reused, generated)
                    if one.logprobs:
                        chunk["completion_probabilities"] = probabilities(one.logprobs)
                    yield chunk
                continue
            self.end = e
            yield self.final(model, streamed=True)

    def _progress(
        self, cache: int, total: int, processed: int, clock: StreamClock
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "index": self.index,
            "content": "",
            "tokens": [],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": 0,
            "tokens_evaluated": total,
            "prompt_progress": {
                "total": total,
                "cache": cache,
                "processed": processed,
                "time_ms": int(clock.ms()),
            },
        }
        if self.settings.timings_per_token:
            chunk["timings"] = clock.timings(cache, processed - cache, 0)
        return chunk


def _lora_json(a: LoraAdapter) -> dict[str, Any]:
    return {
        "id": a.id,
        "path": a.path,
        "scale": a.scale,
        "task_name": a.task_name,
        "prompt_prefix": a.prompt_prefix,
    }


def _stop_type(end: TurnEnd) -> str:
    f = end.finished
    if f is None:
        return "none"
    if f.reason is FinishReason.STOP:
        return "word" if f.stop_string else "eos"
    return "limit"


def _piece(data: bytes) -> str | list[int]:
    """A token's piece: its text when it is whole UTF-8, else its bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _text(data: bytes) -> str:
    """A token's text with a UTF-8 character cut at its end left out (llama-server's
    validate_utf8)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace")


def probabilities(infos: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    def one(c: Any) -> dict[str, Any]:
        return {
            "id": c.token_id,
            "token": _text(c.piece),
            "bytes": list(c.piece),
            "logprob": c.logprob,
        }

    return [{**one(lp.chosen), "top_logprobs": [one(t) for t in lp.top]} for lp in infos]


def _fields(result: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """llama-server's response_fields: the fields named, "a/b" taken out of a's object."""
    out: dict[str, Any] = {}
    for name in names:
        value: Any = result
        for part in str(name).split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[str(name)] = value
    return out


def _normalized(values: list[float], norm: int) -> list[float]:
    """llama-server's embd_normalize: -1 none, 0 max-abs (to int16 range), 1 taxicab, 2
    Euclidean, >2 p-norm."""
    if norm < 0:
        return values
    if norm == 0:
        scale = max((abs(v) for v in values), default=0.0) / 32760.0
    elif norm == 2:
        scale = math.sqrt(sum(v * v for v in values))
    else:
        try:
            scale = sum(abs(v) ** norm for v in values) ** (1.0 / norm)
        except OverflowError:  # (a p-norm of a large p: a double's infinity, as in C++)
            scale = math.inf
    return [v / scale for v in values] if scale > 0 else [0.0 for _ in values]


# -- chats ------------------------------------------------------------------------------------


def chat_body(body: dict[str, Any], max_messages: int = DEFAULT_MAX_MESSAGES) -> list[ChatMessage]:
    """The messages of a chat body, with llama-server's checks (oaicompat_chat_params_parse);
    no messages at all is refused (llama-server prompts with the generation prompt alone), nor
    more than max_messages."""
    if "messages" not in body:
        raise bad("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad("Expected 'messages' to be an array")
    if not messages:
        raise bad("'messages' must not be empty: slotwise needs something to prompt with")
    check_message_count(len(messages), max_messages, "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages.{i}: a message is an object")
        role = m.get("role")
        if role != "assistant" and "content" not in m:
            raise bad("All non-assistant messages must contain 'content'")
        if role == "assistant" and "content" not in m and "tool_calls" not in m:
            raise bad("Assistant message must contain either 'content' or 'tool_calls'!")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad("Expected 'content' to be a string or an array")
        try:
            out.append(ChatMessage.model_validate(m))
        except ValidationError as e:
            raise invalid(e.errors(), f"messages.{i}") from None
    check_messages(out)
    return out


async def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses body as the chat it is (instructions, then the input)."""
    value = body.get("input")
    if value is None:
        raise bad("'input' is required")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, dict):
                raise bad("'input' must be a string or array of objects")
            content = item.get("content")
            if isinstance(content, list):
                content = [_chat_part(p) for p in content]
            role = item.get("role") or "user"
            messages.append(
                {"role": "system" if role == "developer" else role, "content": content or ""}
            )
    else:
        raise bad("'input' must be a string or array of objects")
    return {"messages": messages}


def _chat_part(part: Any) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise bad("'input' content parts are objects")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url", "")}}
    if kind == "input_audio":  # (the same part as Chat Completions': responses/api.py)
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    raise bad("'type' must be one of 'input_text', 'input_image', 'input_audio' or 'input_file'")
