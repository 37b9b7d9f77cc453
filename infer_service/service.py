"""InferService: the gRPC edge. Validates everything before a request reaches the engine."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import grpc

from infer_service.engine import ContextConfig, Engine, Job, QueueFullError, prompt_items
from infer_service.events import Event, Finished, TokenDelta
from infer_service.ledger import CannotFit, EvictionUnit, Policy
from infer_service.media import MediaLimits, StaleDescriptorError, verify_prompt
from infer_service.runtime import SamplingConfig
from prep_service.descriptors import DescriptorError, PreparedPrompt
from prep_service.serving import abort
from slotwise.v1 import infer_pb2, infer_pb2_grpc

POLICIES = {
    infer_pb2.SHIFT_POLICY_UNSPECIFIED: Policy.AUTO,
    infer_pb2.SHIFT_POLICY_AUTO: Policy.AUTO,
    infer_pb2.SHIFT_POLICY_SHIFT: Policy.SHIFT,
    infer_pb2.SHIFT_POLICY_GAP: Policy.GAP,
    infer_pb2.SHIFT_POLICY_REPREFILL: Policy.REPREFILL,
    infer_pb2.SHIFT_POLICY_STOP: Policy.STOP,
}
UNITS = {
    infer_pb2.EVICTION_UNIT_UNSPECIFIED: EvictionUnit.TOKEN,
    infer_pb2.EVICTION_UNIT_TOKEN: EvictionUnit.TOKEN,
    infer_pb2.EVICTION_UNIT_MESSAGE: EvictionUnit.MESSAGE,
}


class RequestError(ValueError):
    """INVALID_ARGUMENT: the request can never work as sent."""


@dataclass(frozen=True)
class GenerateLimits:
    default_max_tokens: int = 1024
    max_tokens: int = 1 << 20
    max_stop_strings: int = 16


class InferServicer(infer_pb2_grpc.InferServiceServicer):
    def __init__(self, engine: Engine, *, limits: GenerateLimits = GenerateLimits()):
        self.engine = engine
        self.limits = limits

    async def GetServerInfo(self, request, context):  # noqa: N802
        rt, st = self.engine.rt, self.engine.stats
        return infer_pb2.GetServerInfoResponse(
            fingerprint=rt.fingerprint.to_pb(),
            num_slots=rt.num_slots,
            num_cells_per_slot=rt.num_cells_per_slot,
            n_ctx_train=rt.n_ctx_train,
            can_shift=rt.can_shift,
            uses_mrope=rt.uses_mrope,
            batch_size=rt.batch_size,
            ubatch_size=rt.ubatch_size,
            num_queued=self.engine.num_waiting,
            num_active=self.engine.num_active,
            stats=infer_pb2.EngineStats(
                num_decodes=st.num_decodes,
                num_multi_seq_decodes=st.num_multi_seq_decodes,
                num_media_decodes=st.num_media_decodes,
                num_generated_tokens=st.num_generated_tokens,
                num_shifts=st.num_shifts,
                num_media_cache_hits=self.engine.cache.hits,
                num_media_cache_misses=self.engine.cache.misses,
            ),
        )

    async def Generate(self, request, context):  # noqa: N802
        try:
            job_args = self._parse(request)
            prompt = PreparedPrompt.from_pb(request.prompt)
        except (RequestError, DescriptorError) as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        rt = self.engine.rt
        limits = MediaLimits(rt.ubatch_size, bool(rt.mtmd and rt.mtmd.non_causal))
        try:
            media = await asyncio.to_thread(
                verify_prompt, prompt, fingerprint=rt.fingerprint, mtmd=rt.mtmd, limits=limits
            )
        except StaleDescriptorError as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
            return
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        items = prompt_items(prompt)
        ctx: ContextConfig = job_args["context"]
        admission = self.engine.new_ledger(ctx).admit(items, truncate=ctx.truncate_prompt)
        if isinstance(admission, CannotFit):
            _release(media)
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
            return
        if admission.kept[-1].media_id:
            _release(media)
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "the prompt ends with media: add text after it (the model needs a text token "
                "to produce the first logits)",
            )
            return

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        remaining = context.time_remaining()
        job = Job(
            admission=admission,
            media=media,
            emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            deadline=time.monotonic() + remaining if remaining is not None else None,
            **job_args,
        )
        try:
            self.engine.submit(job)
        except QueueFullError as e:
            job.release()
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        finished = False
        try:
            while not finished:
                event = await events.get()
                # a slow reader gets the deltas that piled up as one message
                while isinstance(event, TokenDelta) and not events.empty():
                    nxt = events.get_nowait()
                    if not isinstance(nxt, TokenDelta):
                        yield event.to_pb()
                        event = nxt
                        break
                    event = event.merged(nxt)
                finished = isinstance(event, Finished)
                yield event.to_pb()
        finally:
            if not finished:
                job.cancel()  # client went away or the deadline passed: free the slot

    def _parse(self, request: infer_pb2.GenerateRequest) -> dict:
        if request.context.policy not in POLICIES:
            raise RequestError(f"unknown shift policy {request.context.policy}")
        if request.context.unit not in UNITS:
            raise RequestError(f"unknown eviction unit {request.context.unit}")
        c = request.context
        fraction = c.discard_fraction if c.HasField("discard_fraction") else 0.5
        if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
            raise RequestError(f"discard_fraction must be within [0, 1], got {fraction}")
        max_tokens = request.max_tokens or self.limits.default_max_tokens
        if max_tokens > self.limits.max_tokens:
            raise RequestError(f"max_tokens {max_tokens} is over the limit {self.limits.max_tokens}")
        if len(request.stop) > self.limits.max_stop_strings:
            raise RequestError(f"at most {self.limits.max_stop_strings} stop strings")
        return {
            "context": ContextConfig(
                POLICIES[c.policy], c.keep, fraction, UNITS[c.unit], c.truncate_prompt
            ),
            "sampling": _sampling(request.sampling),
            "max_tokens": max_tokens,
            "stop": tuple(request.stop),
        }


def _sampling(pb: infer_pb2.SamplingParams) -> SamplingConfig:
    d = SamplingConfig()

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
    checks = [
        ("temperature", s.temperature, 0.0, 100.0),
        ("top_k", s.top_k, 0, 1 << 20),
        ("top_p", s.top_p, 0.0, 1.0),
        ("min_p", s.min_p, 0.0, 1.0),
        ("repeat_penalty", s.repeat_penalty, 1e-3, 100.0),
        ("penalty_last_n", s.penalty_last_n, -1, 1 << 20),
        ("presence_penalty", s.presence_penalty, -100.0, 100.0),
        ("frequency_penalty", s.frequency_penalty, -100.0, 100.0),
    ]
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:  # NaN fails too
            raise RequestError(f"sampling.{name} must be within [{lo}, {hi}], got {value}")
    return s


def _release(media: dict) -> None:
    for h in media.values():
        h.close()
