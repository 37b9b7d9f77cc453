"""The infer side's one mapping between its domain and the contract's messages (the engine
imports no generated stub; the servicer converts here and nowhere else): requests into checked
domain values (`GenerateParams.from_pb`, raising one ProblemError that names the field), domain
values into answers, and a ProblemError raised anywhere in a handler into the call's status
(`answering`), once.

An enum maps by name (slotwise_core.enum_names): a domain member maps to the proto value of the
same name after the enum's prefix (Policy.GAP <-> SHIFT_POLICY_GAP); a member without its twin
fails at import.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import singledispatch
from typing import Any

import grpc

from infer_service.events import (
    ContextShift,
    ErrorKind,
    Finished,
    FinishReason,
    Persistence,
    PrefillProgress,
    Problem,
    ProblemError,
    Reason,
    Started,
    TokenChoice,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from infer_service.kv.ledger import ContextConfig, EvictionUnit, Policy
from infer_service.kv.pool import PoolFigures
from infer_service.kv.view import CellKind, CellRun, SharedPicture, SlotPicture, SlotState
from infer_service.runner.lora import LoraAdapters, LoraError, LoraSet
from infer_service.runner.reasoning import Thoughts
from infer_service.runner.runtime import SamplingConfig
from infer_service.runner.stats import TenantStats
from infer_service.sessions.session import SessionView, public_id, scoped
from infer_service.sessions.store import SessionIdError, check_session_id
from infer_service.spec.drafting import SpecConfig, SpecType
from slotwise.v1 import infer_pb2
from slotwise_core.descriptors import DescriptorError, PreparedPrompt, TextChunk, memory_kind_pb
from slotwise_core.enum_names import from_numbers, to_numbers
from slotwise_core.limits import (
    MAX_CACHE_SALT,
    MAX_DRAFTS,
    MAX_NGRAM,
    MAX_TITLE_CHARS,
    MAX_TOKENS,
    MAX_TURN_NOTE,
)
from slotwise_core.serving import abort

POLICY_TO_PB = to_numbers(Policy, infer_pb2.ShiftPolicy, "SHIFT_POLICY_")
UNIT_TO_PB = to_numbers(EvictionUnit, infer_pb2.EvictionUnit, "EVICTION_UNIT_")
FINISH_REASON_TO_PB = to_numbers(FinishReason, infer_pb2.FinishReason, "FINISH_REASON_")
PERSISTENCE_TO_PB = to_numbers(Persistence, infer_pb2.Persistence, "PERSISTENCE_")
CELL_KIND_TO_PB = to_numbers(CellKind, infer_pb2.CellKind, "CELL_KIND_")
SLOT_STATE_TO_PB = to_numbers(SlotState, infer_pb2.SlotState, "SLOT_STATE_")
SPEC_TYPES: Mapping[int, SpecType] = from_numbers(SpecType, infer_pb2.SpecType, "SPEC_TYPE_")
# requests: an unset policy or unit means the default
POLICIES: Mapping[int, Policy] = from_numbers(
    Policy, infer_pb2.ShiftPolicy, "SHIFT_POLICY_", unset=Policy.AUTO
)
UNITS: Mapping[int, EvictionUnit] = from_numbers(
    EvictionUnit, infer_pb2.EvictionUnit, "EVICTION_UNIT_", unset=EvictionUnit.TOKEN
)
CODES = {kind: getattr(grpc.StatusCode, kind.value) for kind in ErrorKind}


@singledispatch
def event_pb(event: Any) -> infer_pb2.GenerateResponse:
    raise TypeError(f"no message for {type(event).__name__}")


@event_pb.register
def _(e: Started) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        started=infer_pb2.Started(
            slot=e.slot,
            num_prompt_cells=e.num_prompt_cells,
            num_prompt_positions=e.num_prompt_positions,
            num_capacity_cells=e.num_capacity_cells,
            num_truncated_cells=e.num_truncated_cells,
            num_truncated_chunks=e.num_truncated_chunks,
            truncated_media_ids=e.truncated_media_ids,
            num_reused_cells=e.num_reused_cells,
        )
    )


@event_pb.register
def _(e: PrefillProgress) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        prefill=infer_pb2.PrefillProgress(
            num_cells_done=e.num_cells_done, num_cells_total=e.num_cells_total
        )
    )


@event_pb.register
def _(e: TokenDelta) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        delta=infer_pb2.TokenDelta(
            token_ids=e.token_ids, text=e.text, logprobs=[_logprobs_pb(lp) for lp in e.logprobs]
        )
    )


@event_pb.register
def _(e: ContextShift) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(shift=shift_pb(e))


@event_pb.register
def _(e: Finished) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        finished=infer_pb2.Finished(
            reason=FINISH_REASON_TO_PB[e.reason],
            usage=usage_pb(e.usage),
            stop_string=e.stop_string,
            error=e.error,
            persistence=PERSISTENCE_TO_PB[e.persistence],
        )
    )


def shift_pb(s: ContextShift) -> infer_pb2.ContextShift:
    return infer_pb2.ContextShift(
        policy=POLICY_TO_PB[s.policy],
        num_cells_evicted=s.num_cells_evicted,
        num_positions_evicted=s.num_positions_evicted,
        media_ids_evicted=s.media_ids_evicted,
        num_cells_used_after=s.num_cells_used_after,
        next_position_after=s.next_position_after,
    )


def usage_pb(u: Usage | Mapping[str, Any]) -> infer_pb2.Usage:
    """A usage, or one kept with a turn record (its fields by name)."""
    return infer_pb2.Usage(**(u if isinstance(u, Mapping) else u.__dict__))


def _choice_pb(c: TokenChoice) -> infer_pb2.TokenLogprob:
    return infer_pb2.TokenLogprob(token_id=c.token_id, piece=c.piece, logprob=c.logprob)


def _logprobs_pb(lp: TokenLogprobs) -> infer_pb2.TokenLogprobs:
    return infer_pb2.TokenLogprobs(chosen=_choice_pb(lp.chosen), top=map(_choice_pb, lp.top))


# -- requests: the contract's options as the domain's values, checked -----------------------------


@dataclass(frozen=True)
class GenerateLimits:
    default_max_tokens: int = 1024
    max_tokens: int = MAX_TOKENS
    max_stop_strings: int = 16
    max_stop_chars: int = 1000  # of each (every token's text is searched for each)
    speculative: SpecConfig = SpecConfig()  # what a request leaves unset (--spec-*)
    draft_model: bool = False  # whether a draft model is loaded (--model-draft)


MAX_STREAM_TOKENS = 256


def bad_request(message: str, field: str = "") -> ProblemError:
    return ProblemError(
        Problem(ErrorKind.INVALID_ARGUMENT, message, Reason.BAD_REQUEST, field=field)
    )


@dataclass(frozen=True)
class GenerateParams:
    """A GenerateRequest's options, checked, with a session's defaults for what it leaves
    unset (its constraint is checked against the model, in the servicer)."""

    context: ContextConfig
    sampling: SamplingConfig
    max_tokens: int
    stop: tuple[str, ...]
    stream_tokens: int
    speculative: SpecConfig
    note: bytes
    cache_salt: str
    reasoning: Thoughts | None = None

    @classmethod
    def from_pb(
        cls,
        r: infer_pb2.GenerateRequest,
        limits: GenerateLimits,
        session: SessionView | None = None,
    ) -> GenerateParams:
        """ProblemError (INVALID_ARGUMENT, naming the field) for an option that can never work."""
        max_tokens = r.max_tokens or limits.default_max_tokens
        if max_tokens > limits.max_tokens:
            raise bad_request(f"max_tokens {max_tokens} is over the limit {limits.max_tokens}",
                              "max_tokens")  # fmt: skip
        if len(r.stop) > limits.max_stop_strings:
            raise bad_request(f"at most {limits.max_stop_strings} stop strings", "stop")
        if any(len(s) > limits.max_stop_chars for s in r.stop):
            raise bad_request(f"a stop string has at most {limits.max_stop_chars} characters",
                              "stop")  # fmt: skip
        if r.stream_tokens > MAX_STREAM_TOKENS:
            raise bad_request(f"stream_tokens must be at most {MAX_STREAM_TOKENS}, got "
                              f"{r.stream_tokens}", "stream_tokens")  # fmt: skip
        if len(r.turn_note) > MAX_TURN_NOTE:
            raise bad_request(f"turn_note: at most {MAX_TURN_NOTE} bytes", "turn_note")
        if r.turn_note and session is None:
            raise bad_request("turn_note goes with a session turn", "turn_note")
        if len(r.cache_salt) > MAX_CACHE_SALT:
            raise bad_request(f"cache_salt: at most {MAX_CACHE_SALT} characters", "cache_salt")
        return cls(
            context=context_of(r.context, session.context if session else ContextConfig()),
            sampling=sampling_of(r.sampling, session.sampling if session else SamplingConfig()),
            max_tokens=max_tokens,
            stop=tuple(r.stop),
            stream_tokens=max(1, r.stream_tokens),
            speculative=speculative_of(r.speculative, limits.speculative, limits.draft_model),
            note=r.turn_note,
            cache_salt=r.cache_salt,
            reasoning=reasoning_of(r.reasoning) if r.HasField("reasoning") else None,
        )


def reasoning_of(pb: infer_pb2.ReasoningOptions) -> Thoughts:
    """A request's reasoning options (their token ids are checked against the vocabulary in
    the servicer)."""
    budget = pb.budget_tokens if pb.HasField("budget_tokens") else None
    if budget is not None and budget > MAX_TOKENS:
        raise bad_request(f"reasoning.budget_tokens: at most {MAX_TOKENS}",
                          "reasoning.budget_tokens")  # fmt: skip
    try:
        return Thoughts(
            tuple(pb.start_token_ids), tuple(pb.end_token_ids), pb.started, budget,
            tuple(pb.forced_token_ids),
        )  # fmt: skip
    except ValueError as e:
        raise bad_request(f"reasoning: {e}", "reasoning") from None


def context_of(c: infer_pb2.ContextOptions, base: ContextConfig) -> ContextConfig:
    """The fields the request sets, over base (a session's options, or the defaults)."""
    if c.HasField("policy") and c.policy not in POLICIES:
        raise bad_request(f"unknown shift policy {c.policy}", "context.policy")
    if c.HasField("unit") and c.unit not in UNITS:
        raise bad_request(f"unknown eviction unit {c.unit}", "context.unit")
    fraction = c.discard_fraction if c.HasField("discard_fraction") else base.discard_fraction
    if not 0.0 <= fraction <= 1.0:  # NaN fails too
        raise bad_request(f"discard_fraction must be within [0, 1], got {fraction}",
                          "context.discard_fraction")  # fmt: skip
    return ContextConfig(
        policy=POLICIES[c.policy] if c.HasField("policy") else base.policy,
        keep=c.keep if c.HasField("keep") else base.keep,
        discard_fraction=fraction,
        unit=UNITS[c.unit] if c.HasField("unit") else base.unit,
        truncate_prompt=c.truncate_prompt
        if c.HasField("truncate_prompt")
        else base.truncate_prompt,
    )


def sampling_of(pb: infer_pb2.SamplingParams, d: SamplingConfig) -> SamplingConfig:
    def get(name: str, default: float) -> float:
        return getattr(pb, name) if pb.HasField(name) else default

    s = SamplingConfig(
        temperature=get("temperature", d.temperature),
        top_k=int(get("top_k", d.top_k)),
        top_p=get("top_p", d.top_p),
        min_p=get("min_p", d.min_p),
        repeat_penalty=get("repeat_penalty", d.repeat_penalty),
        penalty_last_n=int(get("penalty_last_n", d.penalty_last_n)),
        presence_penalty=get("presence_penalty", d.presence_penalty),
        frequency_penalty=get("frequency_penalty", d.frequency_penalty),
        seed=int(get("seed", d.seed)),
    )
    _within("sampling", [
        ("temperature", s.temperature, 0.0, 100.0),
        ("top_k", s.top_k, 0, 1 << 20),
        ("top_p", s.top_p, 0.0, 1.0),
        ("min_p", s.min_p, 0.0, 1.0),
        ("repeat_penalty", s.repeat_penalty, 1e-3, 100.0),
        ("penalty_last_n", s.penalty_last_n, -1, 1 << 20),
        ("presence_penalty", s.presence_penalty, -100.0, 100.0),
        ("frequency_penalty", s.frequency_penalty, -100.0, 100.0),
    ])  # fmt: skip
    return s


def speculative_of(
    pb: infer_pb2.SpeculativeOptions, d: SpecConfig, draft_model: bool = False
) -> SpecConfig:
    """The request's speculative options over the server's."""
    if pb.type and pb.type not in SPEC_TYPES:
        raise bad_request(f"speculative.type {pb.type} is not a known type", "speculative.type")

    def get(name: str, default: float) -> float:
        return getattr(pb, name) if pb.HasField(name) else default

    s = SpecConfig(
        type=SPEC_TYPES[pb.type] if pb.type else d.type,
        n_max=int(get("n_max", d.n_max)),
        n_min=int(get("n_min", d.n_min)),
        p_min=get("p_min", d.p_min),
        size_n=int(get("ngram_size_n", d.size_n)),
        size_m=int(get("ngram_size_m", d.size_m)),
        min_hits=int(get("ngram_min_hits", d.min_hits)),
    )
    _within("speculative", [
        ("n_max", s.n_max, 0, MAX_DRAFTS),
        ("n_min", s.n_min, 0, s.n_max),
        ("p_min", s.p_min, 0.0, 1.0),
        ("ngram_size_n", s.size_n, 1, MAX_NGRAM),
        ("ngram_size_m", s.size_m, 1, 1024),
        ("ngram_min_hits", s.min_hits, 1, 1 << 16),
    ])  # fmt: skip
    if s.type is SpecType.DRAFT_SIMPLE and not draft_model:
        raise bad_request("speculative.type draft-simple needs a draft model: start "
                          "infer_service with --model-draft", "speculative.type")  # fmt: skip
    return s


def _within(where: str, checks: list[tuple[str, float, float, float]]) -> None:
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:  # NaN fails too
            raise bad_request(f"{where}.{name} must be within [{lo}, {hi}], got {value}",
                              f"{where}.{name}")  # fmt: skip


def lora_of(
    lora: LoraAdapters, tenant: str, scales: Sequence[infer_pb2.LoraScale], field: str = "lora"
) -> LoraSet:
    """A request's LoRA adapter set: those it lists (the others at 0), or its tenant's scales
    when it lists none; INVALID_ARGUMENT for an id not loaded or a scale not finite."""
    try:
        return lora.resolve(tenant, [(s.id, s.scale) for s in scales])
    except LoraError as e:
        raise bad_request(str(e), field) from None


def set_lora_scales(
    lora: LoraAdapters, tenant: str, scales: Sequence[infer_pb2.LoraScale]
) -> list[infer_pb2.LoraAdapter]:
    """The tenant's scales from now on (those not listed: 0), and the adapters as they are."""
    try:
        lora.set_scales(tenant, [(s.id, s.scale) for s in scales])
    except LoraError as e:
        raise bad_request(str(e), "scales") from None
    return lora_adapters_pb(lora, tenant)


def lora_adapters_pb(lora: LoraAdapters, tenant: str) -> list[infer_pb2.LoraAdapter]:
    scales = lora.scales(tenant)
    return [
        infer_pb2.LoraAdapter(
            id=a.id,
            path=a.path,
            scale=scales[a.id],
            task_name=a.task_name,
            prompt_prefix=a.prompt_prefix,
        )
        for a in lora.adapters
    ]


def title_of(title: str) -> str:
    if len(title) > MAX_TITLE_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in title):
        raise bad_request(
            f"a title has at most {MAX_TITLE_CHARS} characters and no control characters", "title"
        )
    return title


def session_key(tenant: str, session_id: str) -> str:
    """The caller's session of that id (INVALID_ARGUMENT for an id that cannot be one)."""
    try:
        return scoped(tenant, check_session_id(session_id))
    except SessionIdError as e:
        raise bad_request(str(e), "session_id") from None


def prompt_of(pb: Any, num_vocab: int) -> PreparedPrompt:
    """The descriptor, read; token ids outside the vocabulary refused (llama.cpp would refuse
    the whole batch they go in with, other clients' tokens included)."""
    try:
        prompt = PreparedPrompt.from_pb(pb)
    except DescriptorError as e:
        raise bad_request(str(e), "prompt") from None
    for i, chunk in enumerate(prompt.chunks):
        if isinstance(chunk, TextChunk) and (
            min(chunk.token_ids) < 0 or max(chunk.token_ids) >= num_vocab
        ):
            bad = next(t for t in chunk.token_ids if not 0 <= t < num_vocab)
            raise bad_request(
                f"chunk {i}: token id {bad} is outside this model's vocabulary [0, {num_vocab})",
                f"prompt.chunks[{i}].text.token_ids",
            )
    return prompt


# -- answers ------------------------------------------------------------------------------------


def server_info_pb(
    rt: Any, snap: Any, mine: TenantStats, tenant: str
) -> infer_pb2.GetServerInfoResponse:
    """The server as a caller may see it: the media cache's counts and the pool's figures
    (bar its size) are its tenant's own. Another tenant's cells in use, polled, would tell
    how long its prompts and replies are."""
    st = snap.stats
    return infer_pb2.GetServerInfoResponse(
        fingerprint=rt.fingerprint.to_pb(),
        num_slots=rt.num_slots,
        num_cells_per_slot=rt.num_cells_per_slot,
        n_ctx_train=rt.n_ctx_train,
        can_shift=rt.can_shift,
        uses_mrope=rt.uses_mrope,
        batch_size=rt.batch_size,
        ubatch_size=rt.ubatch_size,
        num_queued=snap.waiting,
        num_active=snap.active,
        stats=infer_pb2.EngineStats(
            num_decodes=st.num_decodes,
            num_multi_seq_decodes=st.num_multi_seq_decodes,
            num_media_decodes=st.num_media_decodes,
            num_generated_tokens=st.num_generated_tokens,
            num_shifts=st.num_shifts,
            num_media_cache_hits=mine.num_media_cache_hits,
            num_media_cache_misses=mine.num_media_cache_misses,
            num_shared_prefixes=mine.num_shared_prefixes,
            num_shared_cells=mine.num_shared_cells,
            num_pool_waits=mine.num_pool_waits,
            num_checkpoints=st.num_checkpoints,
            num_checkpoint_restores=st.num_checkpoint_restores,
            num_preemptions=mine.num_preemptions,
            num_sessions_reclaimed=mine.num_sessions_reclaimed,
        ),
        pool=kv_pool_pb(snap.pool, snap.pool_by_tenant.get(tenant)),
        memory_kind=memory_kind_pb(rt.memory_kind),
        num_checkpoints_per_slot=rt.config.ctx_checkpoints if rt.recurrent else 0,
        num_checkpoint_bytes=rt.checkpoint_bytes,
        cache_type_k=rt.cache_types.k,
        cache_type_v=rt.cache_types.v,
        flash_attn=rt.cache_types.flash_attn,
        num_bytes_per_cell=rt.bytes_per_cell,
    )


def kv_pool_pb(pool: PoolFigures | None, own: PoolFigures | None) -> infer_pb2.KvPool | None:
    """The pool's size, and the caller's own part of it (nothing: it holds none)."""
    if pool is None:
        return None
    return infer_pb2.KvPool(
        num_cells=pool.num_cells,
        num_cells_used=own.num_used if own else 0,
        num_shared_cells=own.num_held if own else 0,
        num_holders=own.num_holders if own else 0,
        num_holders_in_use=own.num_holders_in_use if own else 0,
    )


def embed_pb(embedded: Sequence[Any]) -> infer_pb2.EmbedResponse:
    return infer_pb2.EmbedResponse(
        embeddings=[
            infer_pb2.Embedding(values=e.values.tolist(), num_tokens=e.num_tokens) for e in embedded
        ]
    )


def session_info(s: SessionView) -> infer_pb2.SessionInfo:
    c = s.context
    return infer_pb2.SessionInfo(
        records=[
            infer_pb2.TurnRecord(
                turn=r.turn,
                text=r.text,
                reason=r.reason,  # type: ignore[arg-type]
                usage=usage_pb(r.usage),
                note=r.note,
                created=r.created,
            )
            for r in s.records
        ],
        session_id=public_id(s.key),
        title=s.title,
        num_turns=s.num_turns,
        num_cells=s.num_cells,
        next_position=s.next_position,
        resident=s.resident,
        context=infer_pb2.ContextOptions(
            policy=POLICY_TO_PB[c.policy],
            keep=c.keep,
            discard_fraction=c.discard_fraction,
            unit=UNIT_TO_PB[c.unit],
            truncate_prompt=c.truncate_prompt,
        ),
        sampling=infer_pb2.SamplingParams(**asdict(s.sampling)),
        num_shifts=s.num_shifts,
        num_media=s.num_media,
    )


def broken_session_info(key: str, why: str) -> infer_pb2.SessionInfo:
    return infer_pb2.SessionInfo(session_id=public_id(key), error=why)


def _run_pb(r: CellRun) -> infer_pb2.CellRun:
    return infer_pb2.CellRun(
        kind=CELL_KIND_TO_PB[r.kind],
        pinned=r.pinned,
        message_index=r.message_index,
        media_id=r.media_id,
        num_cells=r.num_cells,
        num_positions=r.num_positions,
        pos_start=r.pos_start,
        preview=r.preview,
    )


def slot_view(p: SlotPicture, tenant: str) -> infer_pb2.SlotView:
    """A slot as `tenant` may see it: whole when the sequence is its own; another tenant's as
    its state only (not even its size: a cell count a few times a second would tell how long
    others' prompts and replies are). Whose the slot is decides, never what it holds now: a
    sequence between a REPREFILL and its decode, or waiting for its image, holds no cells
    yet still has its session and its shifts."""
    state = SLOT_STATE_TO_PB[p.state]
    nobodys = not p.tenant and p.state is SlotState.FREE and not (p.runs or p.shifts)
    if p.tenant != tenant and not nobodys:
        return infer_pb2.SlotView(slot=p.slot, state=state)
    return infer_pb2.SlotView(
        slot=p.slot,
        visible=True,
        session_id=public_id(p.session_id) if p.session_id else "",
        state=state,
        num_cells=p.num_cells,
        next_position=p.next_position,
        runs=map(_run_pb, p.runs),
        num_shared_cells=p.num_shared_cells,
        shared_prefix=p.shared_prefix if p.shared_prefix >= 0 else None,
        num_recurrent_bytes=p.num_recurrent_bytes,
        num_checkpoints=p.num_checkpoints,
        num_checkpoint_bytes=p.num_checkpoint_bytes,
        shifts=[
            infer_pb2.ShiftMark(
                id=m.id,
                shift=shift_pb(m.shift),
                at_cell=m.at_cell,
                evicted=map(_run_pb, m.evicted),
                time=m.time,
            )
            for m in p.shifts
        ],
    )


def slots_pb(
    rt: Any, pictures: Sequence[SlotPicture], tenant: str, shared: Sequence[SharedPicture] = ()
) -> infer_pb2.WatchSlotsResponse:
    """The slots as `tenant` may see them, and its own shared prefixes (another tenant's are
    not there at all)."""
    return infer_pb2.WatchSlotsResponse(
        num_cells_per_slot=rt.num_cells_per_slot,
        uses_mrope=rt.uses_mrope,
        slots=[slot_view(p, tenant) for p in pictures],
        shared_prefixes=[
            infer_pb2.SharedPrefixView(
                holder=h.holder, num_cells=h.num_cells, slots=h.slots, runs=map(_run_pb, h.runs)
            )
            for h in shared
            if h.tenant == tenant
        ],
    )


# -- errors: raised anywhere in a handler, answered once -------------------------------------------


async def abort_problem(context: grpc.aio.ServicerContext, p: Problem) -> None:
    await abort(
        context,
        CODES[p.kind],
        p.message,
        reason=p.reason.value,
        metadata=p.metadata,
        retry_after=p.retry_after,
        field=p.field,
    )


def answering(method: Callable[..., Any]) -> Callable[..., Any]:
    """A servicer method whose ProblemError (or OSError of the sessions directory) becomes
    the call's status with its google.rpc details, once, here (streams and unary alike)."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except ProblemError as e:
                await abort_problem(context, e.problem)

        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except ProblemError as e:
            await abort_problem(context, e.problem)

    return unary
