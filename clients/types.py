"""What goes into the client (messages and their images) and what comes back (model and
server info, counts, prepared prompts, sessions), each result read from its proto by `from_pb`.

Pillow is optional: a PIL image is accepted wherever an image is when Pillow is installed, and
nothing here imports it (a PIL image exists only once PIL.Image has been imported).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

from clients.enums import FinishReason, Policy, SpecType, ToolFormat, Unit, from_pb, to_pb
from slotwise.v1 import infer_pb2, prep_pb2, prompt_pb2

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

__all__ = [
    "Audio",
    "ChunkCount",
    "Constraint",
    "Count",
    "Embedding",
    "EngineStats",
    "ImageInput",
    "ImageSize",
    "LoraAdapter",
    "Message",
    "ModelInfo",
    "Part",
    "Prepared",
    "PromptInput",
    "ServerInfo",
    "SessionInfo",
    "Tokens",
    "Tool",
    "ToolCall",
    "TurnRecord",
    "is_pil_image",
    "is_size",
]


# ---------------------------------------------------------------------------------------------
# inputs


def memory_kind(number: int) -> str:
    """The contract's MemoryKind as a word: attention, hybrid or recurrent."""
    return prompt_pb2.MemoryKind.Name(number).removeprefix("MEMORY_KIND_").lower()


@dataclass(frozen=True)
class ImageSize:
    """An image known by its size only: CountTokens counts it without pixels."""

    width: int
    height: int


@dataclass(frozen=True, repr=False)
class Audio:
    """A sound, for models whose projector takes audio (GetModelInfo's supports_audio): a WAV,
    MP3 or FLAC file (`data`: its bytes, or a path), mono float32 little-endian samples at the
    model's audio_sample_rate (`pcm`), or, for counting only, a length (`seconds`)."""

    data: bytes | os.PathLike[Any] | None = None
    pcm: bytes | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.data, self.pcm, self.seconds) if v is not None]
        if len(given) != 1:
            raise ValueError("Audio takes one of data, pcm or seconds")

    def __repr__(self) -> str:  # never print the sound
        if self.seconds is not None:
            return f"Audio(seconds={self.seconds})"
        if isinstance(self.data, os.PathLike):
            return f"Audio({os.fspath(self.data)!r})"
        return f"Audio({len(self.data or self.pcm or b'')} bytes{' of PCM' if self.pcm else ''})"


if TYPE_CHECKING:
    ImageInput: TypeAlias = (
        bytes | bytearray | os.PathLike[Any] | PILImage | ImageSize | tuple[int, int]
    )
else:  # the same, less the type of PIL images (is_pil_image tells those)
    ImageInput = bytes | bytearray | os.PathLike | ImageSize | tuple[int, int]
Part: TypeAlias = str | ImageInput | Audio


def is_pil_image(value: object) -> TypeGuard[PILImage]:
    """Whether value is a PIL image, without importing Pillow (absent: nothing is one)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def is_size(value: object) -> bool:
    """An ImageSize, or a (width, height) tuple of ints."""
    return isinstance(value, ImageSize) or (
        isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)
    )


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is the JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant message made (or that the model wrote): arguments as JSON text."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(frozen=True)
class Constraint:
    """Constrained decoding for Generate: a GBNF grammar, or a JSON Schema (as text or as a
    dict); trigger_patterns make it lazy (free text until one of them is found)."""

    grammar: str = ""
    json_schema: str | dict[str, Any] = ""
    trigger_patterns: tuple[str, ...] = ()

    def to_pb(self) -> prompt_pb2.Constraint:
        if bool(self.grammar) == bool(self.json_schema):
            raise ValueError("a Constraint has a grammar or a json_schema")
        pb = prompt_pb2.Constraint(trigger_patterns=list(self.trigger_patterns))
        if self.grammar:
            pb.grammar = self.grammar
        else:
            schema = self.json_schema
            pb.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
        return pb

    @classmethod
    def from_pb(cls, pb: prompt_pb2.Constraint) -> Constraint:
        return cls(pb.grammar, pb.json_schema, tuple(pb.trigger_patterns))


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding for Generate (None fields: the server's --spec-* flags). The text
    is what it would be without drafts; only copy-heavy replies come faster."""

    type: SpecType | str = SpecType.UNSPECIFIED  # (or several: "ngram-mod,suffix")
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    ngram_size_n: int | None = None
    ngram_size_m: int | None = None
    ngram_min_hits: int | None = None
    ngram_mod_n_match: int | None = None
    ngram_mod_n_min: int | None = None
    ngram_mod_n_max: int | None = None

    def to_pb(self) -> infer_pb2.SpeculativeOptions:
        names = [n.strip() for n in str(self.type).split(",") if n.strip()]
        if len(names) > 1:  # (several types: llama-server's --spec-type a,b)
            pb = infer_pb2.SpeculativeOptions(types=[to_pb(SpecType, n) for n in names])
        else:
            pb = infer_pb2.SpeculativeOptions(type=to_pb(SpecType, self.type))  # type: ignore[arg-type]
        for name in SPECULATIVE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(pb, name, value)
        return pb


SPECULATIVE_FIELDS = (
    "n_max", "n_min", "p_min", "ngram_size_n", "ngram_size_m", "ngram_min_hits",
    "ngram_mod_n_match", "ngram_mod_n_min", "ngram_mod_n_max",
)  # fmt: skip


@dataclass(frozen=True)
class ReasoningOptions:
    """A reasoning model's thoughts in a generation (GenerateRequest.reasoning): what opens and
    closes them, whether the prompt opened one, and a budget (None: none) past which a thought
    is ended by writing `forced_ids` (a message's tokens and the end's; empty: the end's)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    started: bool = False
    budget_tokens: int | None = None
    forced_ids: tuple[int, ...] = ()

    def to_pb(self) -> infer_pb2.ReasoningOptions:
        pb = infer_pb2.ReasoningOptions(
            start_token_ids=self.start_ids, end_token_ids=self.end_ids, started=self.started,
            forced_token_ids=self.forced_ids,
        )  # fmt: skip
        if self.budget_tokens is not None:
            pb.budget_tokens = self.budget_tokens
        return pb


@dataclass(frozen=True)
class Reasoning:
    """Where the chat template writes a reasoning model's thoughts (Prepared.reasoning): its
    start and end ("<think>", "</think>") as text and as token ids, and whether the
    generation prompt opened a thought, with what it wrote after the start (the thought's
    first text, of num_opened tokens)."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    started: bool = False
    opened_text: str = ""
    num_opened: int = 0

    @classmethod
    def from_pb(cls, pb: prep_pb2.Reasoning) -> Reasoning:
        return cls(
            pb.start, pb.end, tuple(pb.start_token_ids), tuple(pb.end_token_ids), pb.started,
            pb.opened_text, pb.num_opened_tokens,
        )  # fmt: skip

    def options(
        self, budget_tokens: int | None = None, message_ids: Sequence[int] = ()
    ) -> ReasoningOptions:
        """The generation's ReasoningOptions: a budget of thought tokens (as llama-server
        counts them: the generation prompt's tokens after the start count too), ended by
        `message_ids` and the end."""
        budget = None if budget_tokens is None else max(0, budget_tokens - self.num_opened)
        if budget_tokens is not None and self.started and budget_tokens <= self.num_opened:
            budget = 0
        forced = (*message_ids, *self.end_ids) if budget is not None else ()
        return ReasoningOptions(self.start_ids, self.end_ids, self.started, budget, forced)


@dataclass(frozen=True)
class Message:
    """One chat message: a role and parts, each text (`str`), an image or a sound (`Audio`).

    Images: encoded file `bytes` (PNG, JPEG, WebP, GIF, BMP), a `pathlib.Path` (a plain `str` is
    text, never a path), a PIL image, or, for counting only, `ImageSize` / `(width, height)`.
    Sounds: `Audio(data)` (a WAV, MP3 or FLAC file), or `Message.user(..., audio=...)`.
    An assistant message may carry the tool calls it made; a `tool` message answers one
    (tool_call_id, and the function's name).
    """

    role: str
    parts: tuple[Part, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def __init__(
        self,
        role: str,
        parts: Part | Sequence[Part] = (),
        *,
        tool_calls: Sequence[ToolCall] = (),
        tool_call_id: str = "",
        name: str = "",
    ):
        one = isinstance(parts, str | bytes | bytearray | os.PathLike | Audio)
        one = one or is_pil_image(parts)
        one = one or is_size(parts)  # (w, h) is one size, not two parts
        items: tuple[Part, ...] = (parts,) if one else tuple(parts)  # type: ignore[assignment,arg-type]
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "parts", items)
        object.__setattr__(self, "tool_calls", tuple(tool_calls))
        object.__setattr__(self, "tool_call_id", tool_call_id)
        object.__setattr__(self, "name", name)

    @classmethod
    def tool(cls, tool_call_id: str, content: str, name: str = "") -> Message:
        return cls("tool", content, tool_call_id=tool_call_id, name=name)

    @classmethod
    def system(cls, *parts: Part) -> Message:
        return cls("system", parts)

    @classmethod
    def user(cls, *parts: Part, audio: Audio | bytes | os.PathLike[Any] | None = None) -> Message:
        """A user message; `audio` (a sound file's bytes or path, or an Audio) comes last."""
        if audio is not None:
            parts = (*parts, audio if isinstance(audio, Audio) else Audio(audio))
        return cls("user", parts)

    @classmethod
    def assistant(cls, *parts: Part) -> Message:
        return cls("assistant", parts)

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def num_images(self) -> int:
        return sum(1 for p in self.parts if not isinstance(p, str))


PromptInput: TypeAlias = str | Sequence[Message]


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class ModelInfo:
    model_fingerprint: str
    mmproj_fingerprint: str
    media_marker: str
    uses_mrope: bool
    media_non_causal: bool
    supports_vision: bool
    supports_audio: bool
    n_ctx_train: int
    num_vocab: int
    bos_token_id: int  # -1: the vocabulary has none
    eos_token_id: int
    has_chat_template: bool
    model_description: str
    chat_template: str = ""  # a Jinja template's text, or a llama.cpp built-in's name
    add_bos: bool = False
    fim: dict[str, int] = field(default_factory=dict)  # pre, suf, mid, rep, sep -> token id
    memory_kind: str = "attention"  # attention, hybrid (Qwen3.5, LFM2) or recurrent
    audio_sample_rate: int = 0  # the rate Audio(pcm=...) samples are at (0: no audio)
    max_audio_seconds: float = 0.0  # the longest sound prep takes

    @classmethod
    def from_pb(cls, pb: prep_pb2.ModelInfo) -> ModelInfo:
        return cls(
            model_fingerprint=pb.fingerprint.model,
            mmproj_fingerprint=pb.fingerprint.mmproj,
            media_marker=pb.media_marker,
            uses_mrope=pb.uses_mrope,
            media_non_causal=pb.media_non_causal,
            supports_vision=pb.supports_vision,
            supports_audio=pb.supports_audio,
            n_ctx_train=pb.n_ctx_train,
            num_vocab=pb.num_vocab,
            bos_token_id=pb.bos_token_id if pb.HasField("bos_token_id") else -1,
            eos_token_id=pb.eos_token_id if pb.HasField("eos_token_id") else -1,
            has_chat_template=pb.has_chat_template,
            model_description=pb.model_description,
            chat_template=pb.chat_template,
            add_bos=pb.add_bos,
            fim={
                name: getattr(pb, f"fim_{name}_token_id")
                for name in ("pre", "suf", "mid", "rep", "sep")
                if pb.HasField(f"fim_{name}_token_id")
            },
            memory_kind=memory_kind(pb.memory_kind),
            audio_sample_rate=pb.audio_sample_rate,
            max_audio_seconds=pb.max_audio_seconds,
        )


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter infer loaded at start, with the scale the caller's requests get when
    they name no adapters (`lora`)."""

    id: int
    path: str
    scale: float
    task_name: str = ""
    prompt_prefix: str = ""

    @classmethod
    def from_pb(cls, pb: infer_pb2.LoraAdapter) -> LoraAdapter:
        return cls(pb.id, pb.path, pb.scale, pb.task_name, pb.prompt_prefix)


@dataclass(frozen=True)
class Tokens:
    """Token ids, with each one's bytes when asked for (always from detokenize, with the text
    they make: bytes that are not UTF-8 become U+FFFD)."""

    token_ids: tuple[int, ...]
    pieces: tuple[bytes, ...] = ()
    text: str = ""

    @classmethod
    def from_pb(cls, pb: prep_pb2.TokenizeResponse | prep_pb2.DetokenizeResponse) -> Tokens:
        ids = tuple(pb.token_ids) if isinstance(pb, prep_pb2.TokenizeResponse) else ()
        text = pb.text if isinstance(pb, prep_pb2.DetokenizeResponse) else ""
        return cls(ids, tuple(pb.pieces), text)


@dataclass(frozen=True)
class EngineStats:
    num_decodes: int = 0
    num_multi_seq_decodes: int = 0
    num_media_decodes: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0
    num_media_cache_hits: int = 0
    num_media_cache_misses: int = 0
    num_shared_prefixes: int = 0
    num_shared_cells: int = 0
    num_pool_waits: int = 0
    num_checkpoints: int = 0  # (hybrid, recurrent memory) recurrent states saved
    num_checkpoint_restores: int = 0  # ... and sequences cut back to one
    num_preemptions: int = 0  # (--kv-unified) the tenant's generations put aside for another's
    num_sessions_reclaimed: int = 0  # ... its idle sessions swapped out for another's prompt


@dataclass(frozen=True)
class KvPool:
    """(--kv-unified) One pool of cells, each counted once however many sequences share it."""

    num_cells: int
    num_cells_used: int
    num_shared_cells: int  # held by shared prefixes, once
    num_holders: int
    num_holders_in_use: int


@dataclass(frozen=True)
class ServerInfo:
    model_fingerprint: str
    mmproj_fingerprint: str
    num_slots: int
    num_cells_per_slot: int
    n_ctx_train: int
    can_shift: bool
    uses_mrope: bool
    batch_size: int
    ubatch_size: int
    num_queued: int
    num_active: int
    stats: EngineStats
    pool: KvPool | None = None  # (--kv-unified)
    memory_kind: str = "attention"  # attention, hybrid (Qwen3.5, LFM2) or recurrent
    num_checkpoints_per_slot: int = 0  # (hybrid, recurrent) --ctx-checkpoints
    num_checkpoint_bytes: int = 0  # ... one checkpoint's bytes (0 until one was saved)
    cache_type_k: str = ""  # a cell's K and V types (--cache-type-k/v) and flash attention
    cache_type_v: str = ""
    flash_attn: str = ""
    num_bytes_per_cell: int = 0  # one cell's K and V over every attention layer

    @classmethod
    def from_pb(cls, pb: infer_pb2.GetServerInfoResponse) -> ServerInfo:
        s = pb.stats
        return cls(
            model_fingerprint=pb.fingerprint.model,
            mmproj_fingerprint=pb.fingerprint.mmproj,
            num_slots=pb.num_slots,
            num_cells_per_slot=pb.num_cells_per_slot,
            n_ctx_train=pb.n_ctx_train,
            can_shift=pb.can_shift,
            uses_mrope=pb.uses_mrope,
            batch_size=pb.batch_size,
            ubatch_size=pb.ubatch_size,
            num_queued=pb.num_queued,
            num_active=pb.num_active,
            stats=EngineStats(
                num_decodes=s.num_decodes,
                num_multi_seq_decodes=s.num_multi_seq_decodes,
                num_media_decodes=s.num_media_decodes,
                num_generated_tokens=s.num_generated_tokens,
                num_shifts=s.num_shifts,
                num_media_cache_hits=s.num_media_cache_hits,
                num_media_cache_misses=s.num_media_cache_misses,
                num_shared_prefixes=s.num_shared_prefixes,
                num_shared_cells=s.num_shared_cells,
                num_pool_waits=s.num_pool_waits,
                num_checkpoints=s.num_checkpoints,
                num_checkpoint_restores=s.num_checkpoint_restores,
                num_preemptions=s.num_preemptions,
                num_sessions_reclaimed=s.num_sessions_reclaimed,
            ),
            memory_kind=memory_kind(pb.memory_kind),
            num_checkpoints_per_slot=pb.num_checkpoints_per_slot,
            num_checkpoint_bytes=pb.num_checkpoint_bytes,
            cache_type_k=pb.cache_type_k,
            cache_type_v=pb.cache_type_v,
            flash_attn=pb.flash_attn,
            num_bytes_per_cell=pb.num_bytes_per_cell,
            pool=KvPool(
                pb.pool.num_cells, pb.pool.num_cells_used, pb.pool.num_shared_cells,
                pb.pool.num_holders, pb.pool.num_holders_in_use,
            ) if pb.HasField("pool") else None,
        )  # fmt: skip


@dataclass(frozen=True)
class ChunkCount:
    message_index: int
    media_group: int  # 0: plain text; k > 0: born of the k-th image or sound
    is_media: bool
    num_cells: int
    num_positions: int
    is_audio: bool = False  # a media chunk of a sound


@dataclass(frozen=True)
class Count:
    num_cells: int
    num_positions: int
    chunks: tuple[ChunkCount, ...]

    @classmethod
    def from_pb(cls, pb: prep_pb2.CountTokensResponse) -> Count:
        chunks = tuple(
            ChunkCount(
                c.message_index,
                c.media_group,
                c.is_media,
                c.num_cells,
                c.num_positions,
                c.is_audio,
            )
            for c in pb.chunks
        )
        return cls(pb.num_cells, pb.num_positions, chunks)


@dataclass(frozen=True)
class Prepared:
    """A prepared prompt (the descriptor to send to Generate) and the rendered prompt text.

    With tools: how the template's model writes calls (clients.tool_calls parses it), and the
    constraint that makes its reply a valid call (pass it to generate). With a reasoning
    model's template: where it writes the thoughts (`reasoning.options()` to generate)."""

    prompt: prompt_pb2.PreparedPrompt
    rendered_text: str = ""
    tool_format: ToolFormat = ToolFormat.UNSPECIFIED
    tool_constraint: Constraint | None = None
    reasoning: Reasoning | None = None

    @classmethod
    def from_pb(cls, pb: prep_pb2.PrepareResponse) -> Prepared:
        calling = pb.tool_calling if pb.HasField("tool_calling") else None
        return cls(
            pb.prompt,
            pb.rendered_text,
            from_pb(ToolFormat, calling.format) if calling else ToolFormat.UNSPECIFIED,
            Constraint.from_pb(calling.constraint) if calling else None,
            Reasoning.from_pb(pb.reasoning) if pb.HasField("reasoning") else None,
        )

    @property
    def num_cells(self) -> int:
        return self.prompt.num_cells

    @property
    def num_positions(self) -> int:
        return self.prompt.num_positions

    @property
    def num_images(self) -> int:
        return len({c.media_group for c in self.prompt.chunks if c.media_group})

    def num_cells_of(self, message_index: int) -> int:
        """KV cells the chunks of one chat message use (e.g. the system prompt, to `keep` it)."""
        return sum(_chunk_cells(c) for c in self.prompt.chunks if c.message_index == message_index)

    def count(self) -> Count:
        """The same per-chunk view CountTokens gives."""
        return Count(
            self.num_cells,
            self.num_positions,
            tuple(
                ChunkCount(
                    c.message_index,
                    c.media_group,
                    c.WhichOneof("kind") == "media",
                    _chunk_cells(c),
                    c.media.num_positions if c.WhichOneof("kind") == "media" else _chunk_cells(c),
                    c.media.WhichOneof("pixels") in ("audio", "pcm"),
                )
                for c in self.prompt.chunks
            ),
        )


def _chunk_cells(c: prompt_pb2.Chunk) -> int:
    return c.media.num_cells if c.WhichOneof("kind") == "media" else len(c.text.token_ids)


@dataclass(frozen=True)
class TurnRecord:
    """What one completed session turn produced (GetSession with num_records)."""

    turn: int
    text: str
    reason: FinishReason
    num_prompt_cells: int
    num_reused_cells: int
    num_generated_tokens: int
    note: bytes
    created: float

    @classmethod
    def from_pb(cls, pb: infer_pb2.TurnRecord) -> TurnRecord:
        u = pb.usage
        return cls(
            pb.turn,
            pb.text,
            from_pb(FinishReason, pb.reason),
            u.num_prompt_cells,
            u.num_reused_cells,
            u.num_generated_tokens,
            pb.note,
            pb.created,
        )


@dataclass(frozen=True)
class Embedding:
    values: tuple[float, ...]
    num_tokens: int


@dataclass(frozen=True)
class SessionInfo:
    """A server-side conversation: its sequence and ledger live on between turns."""

    session_id: str
    num_turns: int
    num_cells: int
    next_position: int
    resident: bool  # in a slot now (else swapped out to disk)
    num_shifts: int
    num_media: int
    policy: Policy
    keep: int
    discard_fraction: float
    unit: Unit
    truncate_prompt: bool
    sampling: dict[str, float | int]  # the session's sampling parameters, as the server reports
    records: tuple[TurnRecord, ...] = ()  # get_session(num_records=N): the last N turns
    title: str = ""

    @classmethod
    def from_pb(cls, pb: infer_pb2.SessionInfo) -> SessionInfo:
        c = pb.context
        return cls(
            session_id=pb.session_id,
            num_turns=pb.num_turns,
            num_cells=pb.num_cells,
            next_position=pb.next_position,
            resident=pb.resident,
            num_shifts=pb.num_shifts,
            num_media=pb.num_media,
            policy=from_pb(Policy, c.policy),
            keep=c.keep,
            discard_fraction=c.discard_fraction if c.HasField("discard_fraction") else 0.5,
            unit=from_pb(Unit, c.unit),
            truncate_prompt=c.truncate_prompt,
            sampling={f.name: v for f, v in pb.sampling.ListFields()},
            records=tuple(map(TurnRecord.from_pb, pb.records)),
            title=pb.title,
        )
