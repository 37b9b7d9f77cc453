"""python -m prep_service --model PATH [--mmproj PATH] ...: the CPU preparation service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from prep_service.preparer import Preparer
from prep_service.service import Limits, PrepServicer
from slotwise.v1 import prep_pb2, prep_pb2_grpc
from slotwise_core.images import DEFAULT_MAX_PIXELS, DEFAULT_MAX_TOTAL_PIXELS
from slotwise_core.metrics import ServiceMetrics
from slotwise_core.model_files import ModelMismatchError
from slotwise_core.native import NativeError
from slotwise_core.serving import (
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_MESSAGE_BYTES,
    Security,
    Server,
    add_security_arguments,
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
            Preparer, model, mmproj, n_threads=threads, chat_template=chat_template
        )
    except BaseException:
        await server.stop(0)  # don't leave a port open that will never serve
        raise
    servicer = PrepServicer(preparer, limits=limits, workers=threads)
    server.bind(prep_pb2_grpc.add_PrepServiceServicer_to_server, servicer)
    if metrics_port is not None:
        metrics.serve(metrics_port)
    await server.set_serving()
    return RunningPrep(server, servicer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotwise-prep", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="text model GGUF (loaded vocab-only)")
    p.add_argument("--mmproj", type=Path, help="multimodal projector GGUF (omit for text-only)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--threads", type=int, default=2, help="worker threads for tokenizing")
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS)
    p.add_argument("--max-side", type=int, default=0, help="downscale images above this side")
    p.add_argument("--max-images", type=int, default=64, help="images per request")
    p.add_argument(
        "--max-total-pixels",
        type=int,
        default=DEFAULT_MAX_TOTAL_PIXELS,
        help="pixels of all images of one request together (checked before decoding)",
    )
    p.add_argument("--max-message-mb", type=int, default=DEFAULT_MAX_MESSAGE_BYTES >> 20)
    p.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="a llama.cpp built-in template name (chatml, gemma, llama3, ...) or a Jinja file; "
        "default: the model's own",
    )
    add_security_arguments(p)
    p.add_argument(
        "--drain-seconds", type=float, default=30.0,
        help="on SIGTERM: health turns NOT_SERVING, new calls are refused, and calls in flight "
        "get this long to finish (default 30)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level)

    async def run() -> None:
        prep = await start(
            args.model,
            args.mmproj,
            address=f"{args.host}:{args.port}",
            threads=args.threads,
            limits=Limits(args.max_pixels, args.max_side, args.max_images, args.max_total_pixels),
            max_message_bytes=args.max_message_mb << 20,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            security=security_from_args(args),
            metrics_port=args.metrics_port,
            chat_template=args.chat_template,
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
