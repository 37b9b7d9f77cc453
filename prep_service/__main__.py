"""python -m prep_service --model PATH [--mmproj PATH] ...: the CPU preparation service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prep_service.flags import OPTIONS
from prep_service.image_cache import DEFAULT_IMAGE_CACHE_BYTES
from prep_service.preparer import Preparer
from prep_service.service import Limits, PrepServicer
from prep_service.token_cache import DEFAULT_TOKEN_CACHE_BYTES
from slotwise.v1 import prep_pb2, prep_pb2_grpc
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

log = logging.getLogger("slotwise.prep")
SERVICE = prep_pb2.DESCRIPTOR.services_by_name["PrepService"].full_name


@dataclass
class RunningPrep:
    server: Server
    servicer: PrepServicer

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        self.servicer.close()
        self.servicer.preparer.close()


async def start(
    model: Path,
    mmproj: Path | None = None,
    *,
    address: str = "127.0.0.1:0",
    threads: int = 2,
    limits: Limits = Limits(),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
    security: Security = Security(),
    metrics_port: int | None = None,
    chat_template: str | None = None,
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
    token_cache_bytes: int = DEFAULT_TOKEN_CACHE_BYTES,
) -> RunningPrep:
    """Listen first (health NOT_SERVING), load the models, then report SERVING."""
    metrics = ServiceMetrics("prep")
    server = await create_server(
        address,
        [SERVICE],
        max_message_bytes=max_message_bytes,
        security=security,
        metrics=metrics,
        max_concurrent_rpcs=max_concurrent_rpcs,
    )
    await server.server.start()
    try:
        preparer = await asyncio.to_thread(
            Preparer, model, mmproj, n_threads=threads, chat_template=chat_template,
            token_cache_bytes=token_cache_bytes,
        )  # fmt: skip
    except BaseException:
        await server.stop(0)  # don't leave a port open that will never serve
        raise
    servicer = PrepServicer(
        preparer, limits=limits, workers=threads, image_cache_bytes=image_cache_bytes
    )
    server.bind(prep_pb2_grpc.add_PrepServiceServicer_to_server, servicer)
    if metrics_port is not None:
        metrics.serve(metrics_port)
    await server.set_serving()
    return RunningPrep(server, servicer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotwise-prep", description=__doc__)
    add_options(p, OPTIONS)
    add_service_arguments(p, port=50051)
    return p


def start_arguments(s: Mapping[str, Any]) -> tuple[Path, Path | None, dict[str, Any]]:
    """The model, the projector and `start`'s arguments from settings named as OPTIONS names
    them (this service's parser and `slotwise serve` alike)."""
    limits = Limits(
        s["max_pixels"], s["max_side"], s["max_images"], s["max_total_pixels"], s["max_messages"],
        s["max_audio_seconds"],
    )  # fmt: skip
    arguments = {
        "threads": s["threads"],
        "limits": limits,
        "max_message_bytes": s["max_message_mb"] << 20,
        "chat_template": s["chat_template"],
        "image_cache_bytes": s["image_cache_mb"] << 20,
        "token_cache_bytes": s["token_cache_mb"] << 20,
    }
    return s["model"], s["mmproj"], arguments


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level)
    model, mmproj, arguments = start_arguments(settings(args, OPTIONS))

    async def run() -> None:
        prep = await start(
            model,
            mmproj,
            address=f"{args.host}:{args.port}",
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            security=security_from_args(args),
            metrics_port=args.metrics_port,
            **arguments,
        )
        log.info("prep_service serving on %s:%d", args.host, prep.port)
        await run_until_signal(prep.server, args.drain_seconds)
        prep.servicer.close()

    try:
        asyncio.run(run())
    except (FileNotFoundError, ModelMismatchError, NativeError, ValueError) as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
