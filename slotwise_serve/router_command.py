"""`slotwise serve --models-dir DIR` or `--models-preset FILE`: several models behind one HTTP
endpoint (llama-server's router mode). Each loaded model runs in a `slotwise serve` process of
its own, with the router's other flags (a preset's section and `[*]` below them) and a sessions
folder of its own that outlives the process: a conversation goes on where it was when its model
comes back."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from model_router.app import RouterApp, create_app
from model_router.catalog import Catalog, CatalogError, ModelEntry, read_catalog
from model_router.child import Child, spawn
from model_router.fleet import Fleet, FleetConfig
from model_router.memory import Footprint, available_bytes, estimate, fmt_bytes, parse_bytes

log = logging.getLogger("slotwise.router")

ROUTER_FLAGS = ("--models-dir", "--models-preset", "--models-max", "--models-autoload",
                "--no-models-autoload", "--sleep-idle-seconds", "--models-memory",
                "--models-queue", "--models-wait-seconds", "--models-load-seconds",
                "--models-queue-per-tenant")  # fmt: skip
# the router's own place on the network (each model's process listens on loopback ports it picks)
_SERVING = ("--host", "--http-port", "--prep-port", "--infer-port", "--prep-metrics-port",
            "--infer-metrics-port", "--sessions-dir", "--model-name", "--log-level")  # fmt: skip


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models (llama-server's router mode; README: Several models)")
    g.add_argument("--models-dir", type=Path, help="serve every model in this folder "
                   "(NAME.gguf, or NAME/ with the model and its mmproj*.gguf)")  # fmt: skip
    g.add_argument("--models-preset", type=Path, help="llama-server's INI of models and options")
    g.add_argument("--models-max", type=int, default=4, help="models loaded at once (0: no limit; "
                   "default %(default)s)")  # fmt: skip
    g.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                   help="load a model a request names (?autoload= per request)")  # fmt: skip
    g.add_argument("--sleep-idle-seconds", type=float, help="unload a model idle this long "
                   "(status sleeping; the next request loads it again)")  # fmt: skip
    g.add_argument("--models-memory", help="memory for all loaded models, e.g. 12G (default: "
                   "available memory less 10%%; `none`: no check)")  # fmt: skip
    g.add_argument("--models-queue", type=int, default=64, help="requests waiting for a model to "
                   "load (beyond: 503 with Retry-After; default %(default)s)")  # fmt: skip
    g.add_argument("--models-queue-per-tenant", type=int, default=16,
                   help="of them, one tenant's (keys file; default %(default)s)")  # fmt: skip
    g.add_argument("--models-wait-seconds", type=float, default=600.0,
                   help="longest a request waits for its model (default %(default)s)")  # fmt: skip
    g.add_argument("--models-load-seconds", type=float, default=600.0,
                   help="a model not ready this long after its process started has failed "
                   "(default %(default)s)")  # fmt: skip


def is_router(argv: Sequence[str]) -> bool:
    """Several models, or one that sleeps when idle (its process is what sleeps; llama-server's
    -1 or 0 is no sleep)."""
    flags = {a.split("=")[0] for a in argv}
    return bool(flags & {"--models-dir", "--models-preset"}) or (_sleep_seconds(argv) or 0) > 0


def _sleep_seconds(argv: Sequence[str]) -> float | None:
    value = None
    for i, word in enumerate(argv):
        flag, eq, rest = word.partition("=")
        if flag == "--sleep-idle-seconds":
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # (argparse says what is wrong with it)


def child_arguments(argv: Sequence[str], takes_value: dict[str, bool]) -> list[str]:
    """The router's command line less its own flags and its place on the network: what every
    model's process gets, after its preset's options (so the command line wins)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        flag, eq, _ = word.partition("=")
        n = 1
        if not eq and takes_value.get(flag, False):
            n = 2
            while i + n < len(argv) and not argv[i + n].startswith("-") and flag in _MULTI:
                n += 1
        if flag not in ROUTER_FLAGS and flag not in _SERVING:
            out += argv[i : i + n]
        i += n
    return out


_MULTI = ("--model-aliases", "--model-tags", "--cors-origins", "--lora")


def _folder_of(name: str) -> str:
    """A model's sessions folder: its name made safe for a path, with a digest (two names that
    read the same once made safe stay apart)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:64]
    return f"{safe}-{hashlib.blake2b(name.encode(), digest_size=4).hexdigest()}"


def main(argv: list[str], parser: argparse.ArgumentParser, default_ctx: int) -> int:
    args = parser.parse_args(argv)
    level = getattr(logging, args.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per proxied request)
    takes_value = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}
    switches = {o: a.nargs == 0 for a in parser._actions for o in a.option_strings}
    is_switch = switches.get
    single = args.infer_model is not None
    try:
        if single and (args.models_dir or args.models_preset):
            raise CatalogError("--model and --models-dir/--models-preset: one model, or a router")
        if single:  # one model that sleeps: its process goes when idle, and comes back
            name = args.model_name if args.model_name != "slotwise" else None
            entry = ModelEntry(name or args.infer_model.stem, args.infer_model, args.infer_mmproj,
                               load_on_startup=True, source="single")  # fmt: skip
            load = lambda: Catalog.of([entry])  # noqa: E731
        else:
            load = lambda: read_catalog(args.models_dir, args.models_preset, is_switch)  # noqa: E731
        catalog = load()
        budget = _budget(args.models_memory)
        if min(args.models_max, args.models_queue, args.models_queue_per_tenant) < 0:
            raise ValueError("--models-max, --models-queue, --models-queue-per-tenant: 0 or more")
    except (CatalogError, ValueError) as e:
        print(f"slotwise serve: error: {e}", file=sys.stderr)
        return 2
    passed = child_arguments(argv, takes_value)
    own_sessions = args.infer_sessions_dir is None
    sessions = (
        Path(tempfile.mkdtemp(prefix="slotwise-router-"))
        if own_sessions
        else args.infer_sessions_dir
    )

    async def launch(entry: ModelEntry) -> Child:
        folder = Path(sessions) / _folder_of(entry.name)
        words = [*entry.command(), *passed, "--host", "127.0.0.1", "--http-port", "0",
                 "--prep-port", "0", "--infer-port", "0", "--model-name", entry.name,
                 "--sessions-dir", str(folder), "--log-level", args.log_level]  # fmt: skip
        return await spawn(entry.name, words)

    def footprint(entry: ModelEntry) -> Footprint:
        assert entry.model is not None
        try:
            return estimate(entry.model, entry.mmproj, [*entry.args, *passed], default_ctx)
        except Exception as e:  # (a damaged header: the load says what is wrong, in its words)
            log.warning(
                "%s: no estimate from its header (%s); its files' size instead", entry.name, e
            )
            files = [p for p in (entry.model, entry.mmproj) if p is not None and p.is_file()]
            return Footprint(sum(p.stat().st_size for p in files), 0, 0, 0)

    config = FleetConfig(
        models_max=args.models_max, memory_budget=budget, queue_max=args.models_queue,
        tenant_queue_max=args.models_queue_per_tenant,
        wait_seconds=args.models_wait_seconds, load_seconds=args.models_load_seconds,
        sleep_idle_seconds=args.sleep_idle_seconds if (args.sleep_idle_seconds or 0) > 0 else None,
    )  # fmt: skip
    fleet = Fleet(catalog, config, launch, footprint)
    try:
        refused = _never_fit(fleet, budget)
        if refused:
            print(f"slotwise serve: error: {refused}", file=sys.stderr)
            return 2
        only = catalog.entries[0].name if single else None
        keys = _keys(args)
        app = create_app(RouterApp(fleet, keys, args.models_autoload, read_catalog=load,
                                   only_model=only, ui_dir=_ui_dir(args)))  # fmt: skip
        port = 8080 if args.http_port is None else args.http_port
        asyncio.run(_serve(app, args.host, port, fleet, keys))
    finally:
        if own_sessions:
            shutil.rmtree(sessions, ignore_errors=True)
    print("slotwise serve: stopped", flush=True)
    return 0


def _budget(text: str | None) -> int | None:
    if text is not None and text.lower() == "none":
        return None
    return parse_bytes(text) if text else available_bytes()


def _never_fit(fleet: Fleet, budget: int | None) -> str | None:
    """A model of the preset that loads on startup but can never fit: refused at start."""
    if budget is None:
        return None
    for inst in fleet.instances.values():
        e = inst.entry
        if e.load_on_startup and e.model is not None:
            need = fleet.footprint(e)
            if need.total > budget:
                return (f"model {e.name!r} needs about {need.describe()}, more than the memory "
                        f"budget of {fmt_bytes(budget)} (--models-memory)")  # fmt: skip
    return None


def _ui_dir(args: argparse.Namespace) -> Path | None:
    """The web page's files (the gateway's own), unless --no-ui or one model."""
    if getattr(args, "no_ui", False) or args.infer_model is not None:
        return None
    from clients.gateway.ui_api import UI_DIR

    return Path(UI_DIR)


def _keys(args: argparse.Namespace) -> Any:
    from clients.cli import one_keys_file

    return one_keys_file(args.token_file, args.api_key_file)


async def _serve(app: Any, host: str, port: int, fleet: Fleet, keys: Any) -> None:
    # (a /models/sse reader or a queued request would hold a graceful shutdown up for ever)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)  # fmt: skip
    server = uvicorn.Server(config)
    loop = asyncio.get_running_loop()
    if keys is not None:
        from slotwise_core.keys import reload_on_sighup

        reload_on_sighup(keys)  # (as slotwise serve: SIGHUP re-reads the keys file)
    task = asyncio.ensure_future(server.serve())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()[1]
        names = ", ".join(fleet.instances) or "none"
        print(f"slotwise serve: router on {host}:{bound} ({len(fleet.instances)} models: {names}; "
              f"at most {fleet.config.models_max or 'any number'} loaded); SIGTERM or Ctrl-C "
              "stops", flush=True)  # fmt: skip
    await task
