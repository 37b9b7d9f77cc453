"""python -m infer_service --model PATH [--mmproj PATH] ...: the inference service."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_service.api.metrics import engine_metrics
from infer_service.api.request import GenerateLimits, speculative_of
from infer_service.api.servicer import InferServicer
from infer_service.engine.client import EngineClient
from infer_service.engine.loop import Engine
from infer_service.engine.scheduler import TenantLimits
from infer_service.events import ProblemError
from infer_service.flags import OPTIONS, lora_in_order
from infer_service.runner.cache_types import CacheTypeError, CacheTypes
from infer_service.runner.draft_model import DraftModel
from infer_service.runner.embedder import Embedder
from infer_service.runner.media import VerifiedMedia
from infer_service.runner.runtime import Runtime, RuntimeConfig
from infer_service.sessions.session import SessionLimits
from infer_service.sessions.store import SessionStore
from infer_service.spec.config import SpecConfig, SpecType, spec_types
from infer_service.spec.synthetic import synth_rates
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.flags import add_options, settings
from slotwise_core.metrics import ServiceMetrics
from slotwise_core.model_files import ModelMismatchError
from slotwise_core.native import NativeError
from slotwise_core.serving import (
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_MESSAGE_BYTES,
    Security,
    Server,
    add_service_arguments,
    configure_logging,
    create_server,
    run_until_signal,
    security_from_args,
)

log = logging.getLogger("slotwise.infer")
SERVICE = infer_pb2.DESCRIPTOR.services_by_name["InferService"].full_name


EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: compose and Kubernetes restart the process


@dataclass
class RunningInfer:
    server: Server
    engine: Engine
    died: asyncio.Event  # the engine thread died: health is NOT_SERVING, the process must go
    embedder: Embedder | None = None
    verified: VerifiedMedia | None = None  # images checked before

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await asyncio.to_thread(self.engine.stop)
        if self.embedder is not None:
            await asyncio.to_thread(self.embedder.close)
        await asyncio.to_thread(self.engine.runtime.close)  # (it waits for borrowers)


VERIFIED_SHARE = 4  # one part in this of --media-cache-mb keeps checked images


async def start(
    config: RuntimeConfig,
    *,
    address: str = "127.0.0.1:0",
    max_queue: int = 64,
    cache_bytes: int = 1 << 30,
    limits: GenerateLimits = GenerateLimits(),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
    sessions_dir: Path | None = None,
    host_sequence_bytes: int = 256 << 20,
    security: Security = Security(),
    metrics_port: int | None = None,
    embeddings_ctx: int = 0,
    tenant_limits: TenantLimits = TenantLimits(),
    fair: bool = True,
    session_limits: SessionLimits = SessionLimits(),
    model_draft: Path | None = None,
    cache_types_draft: CacheTypes | None = None,
    spec_cache_bytes: int = 256 << 20,
) -> RunningInfer:
    """Listen first (health NOT_SERVING), load the model, then report SERVING."""
    _check_speculative_defaults(limits, model_draft is not None, config.mtp)
    metrics = ServiceMetrics("infer")
    server = await create_server(
        address,
        [SERVICE],
        max_message_bytes=max_message_bytes,
        security=security,
        metrics=metrics,
        max_concurrent_rpcs=max_concurrent_rpcs,
    )
    await server.server.start()
    runtime, embedder, draft = await _load_models(
        server,
        config,
        embeddings_ctx=embeddings_ctx,
        model_draft=model_draft,
        cache_types_draft=cache_types_draft,
    )
    if draft is not None:
        limits = dataclasses.replace(limits, draft_model=True)
    if runtime.mtp is not None:
        limits = dataclasses.replace(limits, mtp=True)
    store = SessionStore(sessions_dir) if sessions_dir else None
    # the media budget: checked images (decoded, preprocessed) and the projector's outputs
    verified_bytes = cache_bytes // VERIFIED_SHARE
    on_death, died = _engine_death_reporter(server)
    engine = await asyncio.to_thread(
        Engine,
        runtime,
        max_queue=max_queue,
        cache_bytes=cache_bytes - verified_bytes,
        store=store,
        host_sequence_bytes=host_sequence_bytes,
        tenant_limits=tenant_limits,
        fair=fair,
        draft_model=draft,
        session_limits=session_limits,
        on_death=on_death,
        spec_cache_bytes=spec_cache_bytes,
    )
    metrics.collect_from(engine_metrics(engine))
    engine.start()
    server.bind(
        infer_pb2_grpc.add_InferServiceServicer_to_server,
        InferServicer(
            EngineClient(engine),
            engine.runtime,
            limits=limits,
            embedder=embedder,
            draining=server.draining,
            verified=(verified := VerifiedMedia(verified_bytes)),
        ),
    )
    if metrics_port is not None:
        metrics.serve(metrics_port)
    await server.set_serving()
    return RunningInfer(server, engine, died, embedder, verified)


def _check_speculative_defaults(limits: GenerateLimits, draft_model: bool, mtp: bool) -> None:
    """The server's own speculative defaults (ValueError): wrong ones would refuse every
    request."""
    try:
        speculative_of(infer_pb2.SpeculativeOptions(), limits.speculative, draft_model, mtp)
    except ProblemError as e:
        raise ValueError(f"--spec-* options: {e.problem.message}") from None


async def _load_models(
    server: Server,
    config: RuntimeConfig,
    *,
    embeddings_ctx: int,
    model_draft: Path | None,
    cache_types_draft: CacheTypes | None,
) -> tuple[Runtime, Embedder | None, DraftModel | None]:
    """The model, then the embedder and the draft model where asked for, each loaded off the
    event loop. A failure closes what was loaded and stops the server: no port is left open
    that will never serve."""
    try:
        runtime = await asyncio.to_thread(Runtime, config)
    except BaseException:
        await server.stop(0)  # don't leave a port open that will never serve
        raise
    embedder = None
    if embeddings_ctx:
        try:
            embedder = await asyncio.to_thread(
                Embedder, runtime, ctx_size=embeddings_ctx, threads=config.threads
            )
        except BaseException:
            runtime.close()
            await server.stop(0)
            raise
    draft = None
    if model_draft is not None:  # (its own context: a sequence per slot, as many cells)
        # (a draft sequence mirrors its slot's: per-slot cells, no pool of its own to share)
        draft_config = dataclasses.replace(
            config, model=model_draft, mmproj=None, kv_unified=False,
            cache_types=cache_types_draft or config.cache_types, lora=(),
        )  # fmt: skip
        try:
            draft = await asyncio.to_thread(DraftModel, draft_config, runtime)
        except BaseException:
            if embedder is not None:
                embedder.close()
            runtime.close()
            await server.stop(0)
            raise
    return runtime, embedder, draft


def _engine_death_reporter(
    server: Server,
) -> tuple[Callable[[BaseException], None], asyncio.Event]:
    """The engine's `on_death`, and an event it sets once health turns NOT_SERVING (called on
    the event loop, which the dying engine thread tells)."""
    loop = asyncio.get_running_loop()
    died = asyncio.Event()

    async def report_death() -> None:
        await server.set_not_serving()
        died.set()

    def on_death(error: BaseException) -> None:  # on the dying engine thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            asyncio.run_coroutine_threadsafe(report_death(), loop)

    return on_death, died


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotwise-infer", description=__doc__)
    add_options(p, OPTIONS)
    add_service_arguments(p, port=50052)
    return p


def start_arguments(s: Mapping[str, Any]) -> tuple[RuntimeConfig, dict[str, Any]]:
    """The runtime and `start`'s arguments from settings named as OPTIONS names them (this
    service's parser and `slotwise serve` alike)."""
    config = RuntimeConfig(
        model=s["model"],
        mmproj=s["mmproj"],
        ctx_size=s["ctx_size"],
        parallel=s["parallel"],
        kv_unified=s["kv_unified"],
        max_cells_per_slot=s["kv_unified_per_slot"],
        shared_prefixes=s["shared_prefixes"],
        batch_size=s["batch_size"],
        ubatch_size=s["ubatch_size"],
        gpu_layers=s["gpu_layers"],
        threads=s["threads"],
        threads_batch=s["threads_batch"],
        encode_threads=s["encode_threads"],
        encode_nice=s["encode_nice"],
        extra_bufts={"auto": None, "on": True, "off": False}[s["extra_bufts"]],
        grammar_ms=s["max_grammar_ms"],
        ctx_checkpoints=max(0, s["ctx_checkpoints"]),
        checkpoint_min_step=s["checkpoint_min_step"],
        spec_rollback=max(0, s["spec_rollback"]),
        mtp=SpecType.DRAFT_MTP in speculative_flags(s).kinds,
        cache_types=CacheTypes(s["cache_type_k"], s["cache_type_v"], s["flash_attn"]),
        lora=lora_in_order(s["lora"], s["lora_scaled"]),
        lora_init_without_apply=s["lora_init_without_apply"],
    )
    return config, {
        "max_queue": s["max_queue"],
        "cache_bytes": s["media_cache_mb"] << 20,
        "limits": GenerateLimits(
            default_max_tokens=s["default_max_tokens"],
            speculative=speculative_flags(s),
        ),
        "spec_cache_bytes": max(0, s["spec_cache_mb"]) << 20,
        "max_message_bytes": s["max_message_mb"] << 20,
        "sessions_dir": s["sessions_dir"],
        "host_sequence_bytes": s["state_cache_mb"] << 20,
        "embeddings_ctx": s["embeddings_ctx"] if s["embeddings"] else 0,
        "tenant_limits": TenantLimits(s["tenant_max_active"], s["tenant_max_queued"]),
        "fair": s["queue"] == "fair",
        "model_draft": s["model_draft"],
        "cache_types_draft": CacheTypes(
            s["cache_type_k_draft"], s["cache_type_v_draft"], s["flash_attn"]
        ),
        "session_limits": SessionLimits(
            s["tenant_max_sessions"], s["tenant_max_session_mb"] << 20, float(s["session_ttl"])
        ),
    }


def speculative_flags(s: Mapping[str, Any]) -> SpecConfig:
    """The --spec-* flags (--spec-default: llama-server's, ngram-mod 24/48/64)."""
    kinds = spec_types(s["spec_type"])
    mod = (s["spec_ngram_mod_n_match"], s["spec_ngram_mod_n_min"], s["spec_ngram_mod_n_max"])
    if s["spec_default"]:
        kinds, mod = tuple(dict.fromkeys((*kinds, SpecType.NGRAM_MOD))), (24, 48, 64)
    rates = [float(r) for r in (s["spec_synth_rates"] or "").split(",") if r.strip()]
    synth = synth_rates(rates, s["spec_synth_len"], s["spec_draft_n_max"])
    if synth:
        log.warning("synthetic speculative acceptance (--spec-synth-*): the output is not valid")
    return SpecConfig(
        kinds[0] if kinds else SpecType.NONE,
        s["spec_draft_n_max"],
        s["spec_draft_n_min"],
        s["spec_draft_p_min"],
        s["spec_ngram_size_n"],
        s["spec_ngram_size_m"],
        s["spec_ngram_min_hits"],
        types=kinds[1:],
        mod_n_match=mod[0],
        mod_n_min=mod[1],
        mod_n_max=mod[2],
        synth=synth,
    )


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config, arguments = start_arguments(settings(args, OPTIONS))
    except (CacheTypeError, ValueError) as e:  # (llama.cpp would refuse; --spec-synth-*)
        p.error(str(e))

    async def run() -> int:
        infer = await start(
            config,
            address=f"{args.host}:{args.port}",
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            security=security_from_args(args),
            metrics_port=args.metrics_port,
            **arguments,
        )
        rt = infer.engine.runtime
        log.info(
            "infer_service serving on %s:%d: %d slots x %d cells (%s: %d bytes a cell), "
            "memory=%s, can_shift=%s, mrope=%s%s",
            args.host, infer.port, rt.num_slots, rt.num_cells_per_slot,
            rt.cache_types.describe(), rt.bytes_per_cell, rt.memory_kind, rt.can_shift,
            rt.uses_mrope,
            f" ({rt.config.ctx_checkpoints} checkpoints of the recurrent state per slot; "
            "evictions re-prefill from the pinned prefix's)" if rt.recurrent else "",
        )  # fmt: skip
        await run_until_signal(infer.server, args.drain_seconds, failed=infer.died)
        await asyncio.to_thread(infer.engine.stop)
        if infer.died.is_set():
            log.critical(
                "the engine died: exiting with %d so that it is restarted", EXIT_ENGINE_DIED
            )
            return EXIT_ENGINE_DIED
        return 0

    try:
        return asyncio.run(run())
    except (FileNotFoundError, ModelMismatchError, NativeError, ValueError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
