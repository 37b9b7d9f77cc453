"""A GenerateRequest, checked once, here, before its job is queued (TGI's ValidGenerateRequest):
the contract's options as the domain's values, then what only the model can judge (the prompt's
token ids, a constraint, logit biases, the media), then the Job the engine runs, carrying its
mailbox. Every refusal is one ProblemError that names the field (INVALID_ARGUMENT, or
FAILED_PRECONDITION for a stale descriptor or a session that moved on).

The order is the contract's: what costs nothing first (the session id, the prompt's ids, the
options), then a place in the queue (a request refused there costs no grammar and no image
decoding), then the session's turn (its defaults fill the options a turn leaves unset), then the
work off the event loop (a grammar or schema parsed, images and sounds verified).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from infer_service.api.mailbox import EventRelay, Mailbox
from infer_service.engine.client import EngineClient
from infer_service.engine.scheduler import Reservation
from infer_service.events import EngineStoppedError, ErrorKind, Problem, ProblemError, Reason
from infer_service.kv.ledger import ContextConfig, EvictionUnit, Policy
from infer_service.runner.job import Job, prompt_items
from infer_service.runner.lora import LoraAdapters, LoraError, LoraSet
from infer_service.runner.media import (
    MediaLimits,
    StaleDescriptorError,
    VerifiedMedia,
    verify_prompt,
)
from infer_service.runner.reasoning import Thoughts
from infer_service.runner.runtime import Runtime, SamplingConfig
from infer_service.runner.sampling import (
    Constraint,
    ConstraintError,
    SamplerSpec,
    check_spec,
    json_schema_grammar,
)
from infer_service.sessions.session import SessionView, scoped
from infer_service.sessions.store import SessionIdError, check_session_id
from infer_service.spec.config import SpecConfig, SpecType
from slotwise.v1 import infer_pb2
from slotwise_core.descriptors import DescriptorError, PreparedPrompt, TextChunk
from slotwise_core.enum_names import from_numbers
from slotwise_core.limits import MAX_CACHE_SALT, MAX_DRAFTS, MAX_NGRAM, MAX_TOKENS, MAX_TURN_NOTE
from slotwise_core.native import NativeError
from slotwise_core.sounds import DEFAULT_MAX_SECONDS

T = TypeVar("T")

SPEC_TYPES: Mapping[int, SpecType] = from_numbers(SpecType, infer_pb2.SpecType, "SPEC_TYPE_")
# an unset policy or unit means the default
POLICIES: Mapping[int, Policy] = from_numbers(
    Policy, infer_pb2.ShiftPolicy, "SHIFT_POLICY_", unset=Policy.AUTO
)
UNITS: Mapping[int, EvictionUnit] = from_numbers(
    EvictionUnit, infer_pb2.EvictionUnit, "EVICTION_UNIT_", unset=EvictionUnit.TOKEN
)


class Admission:
    """Turns a GenerateRequest into a queued Job, or refuses it (the handler's one call)."""

    def __init__(
        self,
        engine: EngineClient,
        runtime: Runtime,
        limits: GenerateLimits,
        verified: VerifiedMedia | None = None,
    ):
        self._engine = engine
        self._runtime = runtime  # (its model: prompts are checked off the event loop)
        self.limits = limits
        self._verified = verified  # media checked before: a resent one is not decoded again
        mtmd = runtime.mtmd
        self._media_limits = MediaLimits(
            runtime.ubatch_size,
            bool(mtmd and mtmd.non_causal),
            max_samples=round(DEFAULT_MAX_SECONDS * (mtmd.sample_rate if mtmd else 0)),
        )
        self._relays: dict[asyncio.AbstractEventLoop, EventRelay] = {}

    async def admit(
        self, request: infer_pb2.GenerateRequest, tenant: str, time_remaining: float | None
    ) -> tuple[Job, Mailbox]:
        """The request's job, queued; its mailbox, where its events come."""
        read = _Read.of(request, tenant, self._runtime.num_vocab)
        # a place in the queue first: a request refused costs no image decoding
        reservation = self._engine.reserve(tenant)
        try:
            return await self._queue(read, reservation, time_remaining)
        finally:
            reservation.release()  # (the job's now, unless it was refused)

    async def _queue(
        self, read: _Read, reservation: Reservation, time_remaining: float | None
    ) -> tuple[Job, Mailbox]:
        """Begin the session's turn, check the rest and queue the job in the reserved place
        (a refusal: ProblemError, the turn ended again)."""
        session = None
        if read.session_id is not None:
            session = await self._engine.begin_turn(read.session_id)
        try:
            # (the turn is ours now: no other can change num_turns under it)
            expected = read.expect_turns
            if session is not None and expected is not None and session.num_turns != expected:
                raise ProblemError(
                    Problem(
                        ErrorKind.FAILED_PRECONDITION,
                        f"the session has {session.num_turns} turns, not the {expected} this "
                        "turn expects",
                        Reason.SESSION_MOVED_ON,
                        (("num_turns", str(session.num_turns)),),
                    )
                )
            job, mailbox = await self._job(read, session, time_remaining)
            try:
                self._engine.submit(job, reservation)
            except BaseException:
                job.release()
                raise
        except BaseException:
            if read.session_id is not None:
                self._engine.end_turn_later(read.session_id)  # it must happen even if we go
            raise
        return job, mailbox

    async def _job(
        self, read: _Read, session: SessionView | None, time_remaining: float | None
    ) -> tuple[Job, Mailbox]:
        """Check what the model must judge (off the event loop) and make the job."""
        rt = self._runtime
        params = GenerateParams.from_pb(read.request, self.limits, session)
        # a grammar (or schema) is parsed off the event loop: it may be large
        sampler = await asyncio.to_thread(
            _borrowing, rt, _sampler_fields, rt, read.request, params.sampling
        )
        lora = lora_of(rt.lora, read.tenant, read.request.lora)
        try:
            media, decoded = await asyncio.to_thread(
                _borrowing, rt, verify_prompt, read.prompt, fingerprint=rt.fingerprint,
                mtmd=rt.mtmd, limits=self._media_limits, cache=self._verified,
                scope=f"{read.tenant}\0{params.cache_salt}",
            )  # fmt: skip
        except StaleDescriptorError as e:
            raise ProblemError(
                Problem(ErrorKind.FAILED_PRECONDITION, str(e), Reason.STALE_DESCRIPTOR)
            ) from None
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        items, pixels = prompt_items(read.prompt)
        # admission is the engine's: a resent conversation longer than the context may continue
        # what a slot holds (only its new part is decoded)
        if items[-1].media_id:
            for h in media.values():
                h.close()
            raise bad_request(
                "the prompt ends with media: add text after it (the model needs a text token "
                "to produce the first logits)", "prompt",
            )  # fmt: skip
        mailbox = Mailbox(self._relay())
        job = Job(
            items=items,
            media=media,
            pixels=pixels,
            # a session keeps the pixels it holds until they are on disk
            rgb=decoded if session is not None else {},
            mailbox=mailbox,
            sampling=params.sampling,
            context=params.context,
            max_tokens=params.max_tokens,
            stop=params.stop,
            deadline=time.monotonic() + time_remaining if time_remaining is not None else None,
            session_id=session.key if session else None,
            stream_tokens=params.stream_tokens,
            note=params.note,
            tenant=read.tenant,
            cache_salt=params.cache_salt,
            lora=lora,
            speculative=params.speculative,
            reasoning=params.reasoning,
            **sampler,
        )
        return job, mailbox

    def _relay(self) -> EventRelay:
        loop = asyncio.get_running_loop()
        if self._relays.get(loop) is None:
            self._relays[loop] = EventRelay(loop)
        return self._relays[loop]


@dataclass(frozen=True)
class _Read:
    """What a request says that costs nothing to check: read before it takes a place."""

    request: infer_pb2.GenerateRequest
    tenant: str
    session_id: str | None  # the caller's session (scoped to its tenant)
    expect_turns: int | None
    prompt: PreparedPrompt

    @classmethod
    def of(cls, request: infer_pb2.GenerateRequest, tenant: str, num_vocab: int) -> _Read:
        session_id = session_key(tenant, request.session_id) if request.session_id else None
        prompt = prompt_of(request.prompt, num_vocab)
        if session_id is None and request.HasField("expect_turns"):
            raise bad_request("expect_turns goes with a session_id", "expect_turns")
        expect = request.expect_turns if request.HasField("expect_turns") else None
        return cls(request, tenant, session_id, expect, prompt)


@dataclass(frozen=True)
class GenerateLimits:
    default_max_tokens: int = 1024
    max_tokens: int = MAX_TOKENS
    max_stop_strings: int = 16
    max_stop_chars: int = 1000  # of each (every token's text is searched for each)
    speculative: SpecConfig = SpecConfig()  # what a request leaves unset (--spec-*)
    draft_model: bool = False  # whether a draft model is loaded (--model-draft)
    mtp: bool = False  # whether the model's MTP head drafts (--spec-type draft-mtp)


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
            speculative=speculative_of(
                r.speculative, limits.speculative, limits.draft_model, limits.mtp
            ),
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
    pb: infer_pb2.SpeculativeOptions, d: SpecConfig, draft_model: bool = False, mtp: bool = False
) -> SpecConfig:
    """The request's speculative options over the server's."""
    for field, given in (("type", [pb.type]), ("types", list(pb.types))):
        if any(k and k not in SPEC_TYPES for k in given):
            raise bad_request(f"speculative.{field}: {given} holds an unknown type",
                              f"speculative.{field}")  # fmt: skip
    if len(pb.types) > len(SPEC_TYPES):
        raise bad_request("speculative.types: each type once", "speculative.types")

    def get(name: str, default: float) -> float:
        return getattr(pb, name) if pb.HasField(name) else default

    listed = [SPEC_TYPES[k] for k in pb.types if k]
    if listed:  # (several: the first in llama-server's order with a draft drafts)
        kind, others = listed[0], tuple(listed[1:])
    elif pb.type:
        kind, others = SPEC_TYPES[pb.type], ()
    else:
        kind, others = d.type, d.types
    s = SpecConfig(
        type=kind,
        types=others,
        synth=d.synth,  # (the server's alone: a benchmarking aid)
        mod_n_match=int(get("ngram_mod_n_match", d.mod_n_match)),
        mod_n_min=int(get("ngram_mod_n_min", d.mod_n_min)),
        mod_n_max=int(get("ngram_mod_n_max", d.mod_n_max)),
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
        ("ngram_mod_n_match", s.mod_n_match, 1, MAX_NGRAM),
        ("ngram_mod_n_min", s.mod_n_min, 0, 1024),
        ("ngram_mod_n_max", s.mod_n_max, 0, 1024),
    ])  # fmt: skip
    if SpecType.DRAFT_SIMPLE in s.kinds and not draft_model:
        raise bad_request("speculative.type draft-simple needs a draft model: start "
                          "infer_service with --model-draft", "speculative.type")  # fmt: skip
    if SpecType.DRAFT_MTP in s.kinds and not mtp:
        raise bad_request("speculative.type draft-mtp needs the model's MTP head: start "
                          "infer_service with --spec-type draft-mtp on a model with nextn "
                          "layers", "speculative.type")  # fmt: skip
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


def _sampler_fields(
    rt: Runtime, request: infer_pb2.GenerateRequest, sampling: SamplingConfig
) -> dict[str, Any]:
    """The request's constraint, logit biases and log-probabilities, checked against the
    model (INVALID_ARGUMENT naming the field)."""
    try:
        constraint = None
        c = request.constraint
        kind = c.WhichOneof("kind")
        if kind is not None or c.trigger_patterns:
            if kind == "json_schema":
                grammar = json_schema_grammar(c.json_schema)
            elif kind == "grammar" and c.grammar.strip():
                grammar = c.grammar
            else:
                raise ConstraintError("constraint: give a grammar or a json_schema", "constraint")
            constraint = Constraint(grammar, tuple(c.trigger_patterns))
        if request.top_logprobs and not request.logprobs:
            raise ConstraintError("top_logprobs needs logprobs", "top_logprobs")
        spec = SamplerSpec(
            sampling,
            constraint,
            logit_bias=tuple(sorted(request.logit_bias.items())),
            top_logprobs=request.top_logprobs if request.logprobs else None,
        )
        check_spec(rt, spec)
    except ConstraintError as e:
        raise bad_request(str(e), e.field) from None
    r = request.reasoning
    ids = (*r.start_token_ids, *r.end_token_ids, *r.forced_token_ids)
    if any(not 0 <= t < rt.num_vocab for t in ids):
        raise bad_request(
            f"reasoning: token ids are within the vocabulary [0, {rt.num_vocab})", "reasoning"
        )
    if request.ignore_eos:  # (after the check: the vocabulary's own, not the caller's count)
        spec = replace(spec, logit_bias=spec.logit_bias + rt.eog_bans)
    return {
        "constraint": spec.constraint,
        "logit_bias": spec.logit_bias,
        "top_logprobs": spec.top_logprobs,
    }


def _borrowing(rt: Runtime, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn on a worker thread, with the runtime borrowed: it is not freed under fn (a handler
    cancelled at shutdown leaves its thread running)."""
    try:
        with rt.borrowed():
            return fn(*args, **kwargs)
    except NativeError as e:
        if rt.closing:
            raise EngineStoppedError(
                Problem(ErrorKind.UNAVAILABLE, str(e), Reason.SHUTTING_DOWN)
            ) from None
        raise
