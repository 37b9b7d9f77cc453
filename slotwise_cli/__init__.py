"""slotwise: talk to the slotwise services, or run them.

  slotwise generate --prompt TEXT [--image PATH ...]   one reply, streamed to stdout
  slotwise chat                                        interactive conversation on stdin
  slotwise count --prompt TEXT [--image-size WxH ...]  KV cells and positions of a prompt
  slotwise info                                        both services' model and engine info
  slotwise serve --model PATH --mmproj PATH            both services in one process
  slotwise demo                                        tiny models, a conversation, a table

Addresses default to $SLOTWISE_PREP / $SLOTWISE_INFER, else localhost:50051 / localhost:50052.
Exit status: 0 ok, 1 the server reported an error (its status code and message are printed),
2 usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from clients.cli import (
    EXIT_OK,
    EXIT_SERVER,
    EXIT_USAGE,
    ServerError,
    UsageError,
    cmd_chat,
    cmd_count,
    cmd_gateway,
    cmd_generate,
    cmd_info,
    connection_arguments,
    generation_arguments,
    http_arguments,
    positive_int,
    prompt_arguments,
)
from clients.client import SlotwiseError

# ---------------------------------------------------------------------------------------------
# the parser


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotwise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--log-level", default="warning", help="client-side logging (default warning)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = sub.add_parser("generate", help="one reply, streamed to stdout; a summary on stderr")
    prompt_arguments(g, sizes=False)
    generation_arguments(g)
    g.add_argument(
        "--truncate", action="store_true", help="drop the oldest part of a prompt too long"
    )
    g.add_argument("-v", "--verbose", action="store_true", help="report context shifts on stderr")
    connection_arguments(g)

    c = sub.add_parser("chat", help="an interactive conversation (stdin); /help for commands")
    c.add_argument("--system", help="the system message")
    generation_arguments(c, keep_default="system")
    c.add_argument(
        "--no-truncate",
        action="store_true",
        help="refuse a conversation longer than the context instead of dropping its oldest part",
    )
    connection_arguments(c)

    n = sub.add_parser("count", help="KV cells and positions of a prompt (images may be sizes)")
    prompt_arguments(n, sizes=True)
    n.add_argument("-v", "--verbose", action="store_true", help="one line per chunk")
    connection_arguments(n, infer=False)

    i = sub.add_parser("info", help="both services' model and engine information")
    connection_arguments(i)

    # (its options are the services' own: slotwise_serve.serve_command parses them)
    sub.add_parser("serve", add_help=False, help="both services in one process (slotwise serve -h)")

    w = sub.add_parser("gateway", help="the OpenAI-compatible HTTP API over running services")
    w.add_argument("--prep", required=True, metavar="HOST:PORT", help="the PrepService")
    w.add_argument("--infer", required=True, metavar="HOST:PORT", help="the InferService")
    w.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    w.add_argument("--port", type=int, default=8080, help="HTTP port (default %(default)s)")
    w.add_argument(
        "--token-file", type=Path,
        help="bearer token for the gRPC services (without --api-key-file: with it, each "
        "caller's own key goes on to them)",
    )  # fmt: skip
    http_arguments(w)

    sub.add_parser("bench", help="throughput and latency ratios (see: slotwise bench -h)")
    d = sub.add_parser("demo", help="a multimodal conversation that forces context shifts")
    d.add_argument("--model", type=Path, help="a real text model GGUF (default: tiny models)")
    d.add_argument("--mmproj", type=Path, help="its projector GGUF (with --model)")
    d.add_argument("--turns", type=positive_int, default=5, help="turns (default %(default)s)")
    d.add_argument("--ctx-size", type=positive_int, help="KV cells (tiny: 256, real: 1024)")
    d.add_argument("--max-tokens", type=positive_int, help="per turn (tiny: 64, real: 96)")
    d.add_argument("--threads", type=positive_int, help="inference threads (tiny: 1)")
    d.add_argument("--gpu-layers", type=int, default=0, help="layers offloaded (CUDA builds)")
    return p


# ---------------------------------------------------------------------------------------------
# the commands that need the serve extra (imported when run, behind serve_extra_present)


def cmd_serve(args: argparse.Namespace) -> int:
    from slotwise_serve import serve_command

    return serve_command.main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from slotwise_serve.demo import run_demo

    if (args.model is None) != (args.mmproj is None):
        raise UsageError("--model and --mmproj go together (the demo sends images)")
    for path in (args.model, args.mmproj):
        if path is not None and not path.is_file():
            raise UsageError(f"no such file: {path}")
    return run_demo(
        args.model,
        args.mmproj,
        num_turns=args.turns,
        ctx_size=args.ctx_size,
        max_tokens=args.max_tokens,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
    )


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "count": cmd_count,
    "info": cmd_info,
    "serve": cmd_serve,
    "gateway": cmd_gateway,
    "demo": cmd_demo,
}


# What `pip install 'slotwise[serve]'` adds; the client commands run without it.
SERVE_EXTRA = ("llama_cpp", "PIL", "numpy", "gguf")
NEEDS_SERVE_EXTRA = ("serve", "demo", "bench")


def serve_extra_present(command: str) -> bool:
    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"slotwise {command}: needs the serve extra (missing: {', '.join(missing)}): "
            "pip install 'slotwise[serve]'",
            file=sys.stderr,
        )
    return not missing


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own options (python -m benchmarks.bench -h)
        if not serve_extra_present("bench"):
            return EXIT_USAGE
        from benchmarks import bench

        return bench.main(argv[1:])
    args, rest = parser().parse_known_args(argv)
    if args.command == "serve":  # what follows it is serve's (a --log-level before it too)
        args.rest = ["--log-level", args.log_level, *rest]
    elif rest:
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in NEEDS_SERVE_EXTRA and not serve_extra_present(args.command):
        return EXIT_USAGE
    if args.command != "serve":
        logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING))
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"slotwise {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ServerError as e:
        print(f"slotwise {args.command}: error: {e}", file=sys.stderr)
        return EXIT_SERVER
    except SlotwiseError as e:
        print(f"slotwise {args.command}: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_SERVER
    except ValueError as e:  # e.g. an image given by size to prepare, a bad option value
        print(f"slotwise {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
