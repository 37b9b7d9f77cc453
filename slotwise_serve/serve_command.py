"""`slotwise serve`: both services in one process, their options taken from the services'
own definitions (infer_service/flags.py, prep_service/flags.py): a flag either service
takes, `slotwise serve` takes too, with the same default, and hands on the same way."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from clients.cli import (
    EXIT_OK,
    EXIT_SERVER,
    EXIT_USAGE,
    UsageError,
    gateway_config,
    http_arguments,
    one_keys_file,
)
from infer_service.flags import OPTIONS as INFER
from prep_service.flags import OPTIONS as PREP
from slotwise_core.flags import add_options, defaults, settings
from slotwise_core.serving import (
    DEFAULT_MAX_CONCURRENT_RPCS,
    add_drain_argument,
    add_tls_arguments,
)
from slotwise_serve import router_command
from slotwise_serve.launch import ServeConfig, Services, serve_until_signal
from slotwise_serve.router_command import add_router_arguments

SHARED = ("--model", "--mmproj", "--max-message-mb")  # one value for both services
PREP_FLAGS = {"--threads": "--prep-threads"}  # prep's, where infer has a flag of that name
PREP_ONLY = tuple(o for o in PREP if o.flag not in SHARED)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotwise serve", description="Both services in one process, until SIGTERM/SIGINT."
    )
    add_options(p.add_argument_group("inference (as infer_service takes them)"), INFER,
                prefix="infer_")  # fmt: skip
    add_options(p.add_argument_group("preparation (as prep_service takes them)"), PREP_ONLY,
                prefix="prep_", rename=PREP_FLAGS)  # fmt: skip
    s = p.add_argument_group("serving")
    s.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    s.add_argument("--prep-port", type=int, default=50051, help="0: any free port")
    s.add_argument("--infer-port", type=int, default=50052, help="0: any free port")
    s.add_argument("--max-concurrent-rpcs", type=int, default=DEFAULT_MAX_CONCURRENT_RPCS,
                   help="calls each service serves at once; more: RESOURCE_EXHAUSTED")  # fmt: skip
    add_drain_argument(s, "--grace")
    s.add_argument("--log-level", default="warning", help="default warning")
    h = p.add_argument_group("hardening")
    add_tls_arguments(h)
    h.add_argument(
        "--token-file", type=Path, metavar="KEYS",
        help="the keys file for prep, infer and the HTTP API (`TENANT KEY` lines, or one "
        "key); SIGHUP re-reads it",
    )  # fmt: skip
    h.add_argument("--prep-metrics-port", type=int, help="Prometheus metrics of the prep service")
    h.add_argument("--infer-metrics-port", type=int, help="Prometheus metrics of the infer service")
    p.add_argument(
        "--http-port", type=int, help="also serve the OpenAI-compatible HTTP API on this port"
    )
    http_arguments(p, max_images=False)  # prep's --max-images and --max-messages: the gateway's
    add_router_arguments(p)
    for action in p._actions:  # (a router has none of its own: --models-dir or -preset instead)
        if action.dest == "infer_model":
            action.required = False
    return p


def config_from(args: argparse.Namespace, keys: Any = None) -> ServeConfig:
    infer = settings(args, INFER, prefix="infer_")
    shared = {o.name: infer[o.name] for o in INFER if o.flag in SHARED}
    return ServeConfig(
        prep={**settings(args, PREP_ONLY, prefix="prep_"), **shared},
        infer=infer,
        host=args.host,
        prep_port=args.prep_port,
        infer_port=args.infer_port,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        keys=keys,
        prep_metrics_port=args.prep_metrics_port,
        infer_metrics_port=args.infer_metrics_port,
    )


def main(argv: list[str]) -> int:
    if router_command.is_router(argv):
        return router_command.main(argv, parser(), default_ctx=defaults(INFER)["ctx_size"])
    args = parser().parse_args(argv)
    try:
        if args.infer_model is None:
            raise UsageError("--model is required (or --models-dir / --models-preset: a router)")
        for path in (args.infer_model, args.infer_mmproj, args.tls_cert, args.tls_key,
                     args.tls_client_ca):  # fmt: skip
            if path is not None and not path.is_file():
                raise UsageError(f"no such file: {path}")
        if bool(args.tls_cert) != bool(args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        keys = one_keys_file(args.token_file, args.api_key_file)
    except UsageError as e:
        print(f"slotwise serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    config = config_from(args, keys)

    def ready(s: Services) -> None:
        rt = s.infer.engine.runtime
        http = f", HTTP API on {args.host}:{s.gateway.port}" if s.gateway else ""
        print(
            f"slotwise serve: prep on {s.prep_address}, infer on {s.infer_address}{http} "
            f"({rt.num_slots} slots x {rt.num_cells_per_slot} cells, memory={rt.memory_kind}, "
            f"can_shift={rt.can_shift}, mrope={rt.uses_mrope}); SIGTERM or Ctrl-C stops",
            flush=True,
        )

    def gateway(s: Services) -> Any:  # one keys file for all three: callers' keys go on
        return gateway_config(
            args, s.prep_address, s.infer_address, None, keys,
            max_images=args.prep_max_images, max_messages=args.prep_max_messages,
        )  # fmt: skip

    http = (gateway, args.http_port) if args.http_port is not None else None
    try:
        asyncio.run(serve_until_signal(config, ready, grace=args.drain_seconds, http=http))
    except UsageError as e:
        print(f"slotwise serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the model failed to load, a port is taken, ...
        name = type(e).__name__
        print(f"slotwise serve: {name}: {e}", file=sys.stderr)
        return EXIT_USAGE if name in ("ModelMismatchError", "FileNotFoundError") else EXIT_SERVER
    print("slotwise serve: stopped", flush=True)
    return EXIT_OK
