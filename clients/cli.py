"""The `slotwise` command's client commands: generate, chat, count, info and gateway.

Their argument groups, the HTTP API's options and config (`slotwise serve` shares them), exit
codes and UsageError. The command tree (the parser, `main`, serve, demo, bench) is slotwise_cli's,
above everything it dispatches to: these commands need only `pip install .` (no llama.cpp,
Pillow, numpy or gguf).

Media: `generate` and `count` take `--image PATH` and `--audio PATH` (a WAV, MP3 or FLAC file,
for a model that takes audio), `count` also an image's size (`--image-size WxH`) or a sound's
length (`--audio-seconds S`); each is repeatable, and they go in the order given (a `--raw`
prompt's media markers take them so). `chat` attaches them with `/image PATH` and `/audio PATH`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from clients.client import (
    Audio,
    Completion,
    Count,
    Delta,
    Event,
    FinishReason,
    ImageSize,
    Message,
    Policy,
    Prefill,
    Shift,
    SlotwiseClient,
    SlotwiseError,
    Started,
    Tls,
    Unit,
)
from slotwise_core.limits import DEFAULT_MAX_IMAGES, DEFAULT_MAX_MESSAGES

EXIT_OK, EXIT_SERVER, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake on the command line that argparse could not catch (exit 2)."""


class ServerError(Exception):
    """A server that refused before any gRPC call (a router, for --model's addresses): exit 1."""


# ---------------------------------------------------------------------------------------------
# argument types


def image_size(text: str) -> ImageSize:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxHEIGHT, e.g. 640x480, got {text!r}"
        ) from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(f"width and height must be positive, got {text!r}")
    return ImageSize(w, h)


def audio_file(text: str) -> Audio:
    """A sound file's path (read when the command runs: read_images)."""
    return Audio(Path(text))


def audio_seconds(text: str) -> Audio:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, e.g. 2.5, got {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"a sound's length must be positive, got {text!r}")
    return Audio(seconds=seconds)


def keep_value(text: str) -> int | str:
    if text == "system":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of cells or 'system', got {text!r}"
        ) from None
    if n < 0:
        raise argparse.ArgumentTypeError("keep must be >= 0")
    return n


def positive_int(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


# ---------------------------------------------------------------------------------------------
# argument groups (slotwise_cli.parser puts them on the client commands)


def connection_arguments(
    p: argparse.ArgumentParser, *, prep: bool = True, infer: bool = True
) -> None:
    g = p.add_argument_group("connection")
    if prep:
        g.add_argument(
            "--prep",
            default=os.environ.get("SLOTWISE_PREP", "localhost:50051"),
            metavar="ADDR",
            help="PrepService address (default $SLOTWISE_PREP or %(default)s)",
        )
    if infer:
        g.add_argument(
            "--infer",
            default=os.environ.get("SLOTWISE_INFER", "localhost:50052"),
            metavar="ADDR",
            help="InferService address (default $SLOTWISE_INFER or %(default)s)",
        )
    g.add_argument(
        "--router", default=os.environ.get("SLOTWISE_ROUTER"), metavar="URL",
        help="a router (slotwise serve --models-dir) at http://HOST:PORT: --model's addresses "
        "come from it, the model loaded first ($SLOTWISE_ROUTER)",
    )  # fmt: skip
    g.add_argument("--model", help="with --router: which of its models")
    g.add_argument(
        "--token", default=os.environ.get("SLOTWISE_TOKEN"), help="bearer token ($SLOTWISE_TOKEN)"
    )
    g.add_argument("--token-file", type=Path, help="read the bearer token from this file")
    g.add_argument("--tls-ca", type=Path, metavar="PEM", help="use TLS, trusting these roots")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="client private key (mTLS)")
    g.add_argument("--tls", action="store_true", help="use TLS with the system's roots")
    g.add_argument("--tls-server-name", help="name to check in the server's certificate")
    g.add_argument(
        "--timeout", type=float, default=30.0, help="deadline of prepare/count/info calls (s)"
    )


def prompt_arguments(p: argparse.ArgumentParser, *, sizes: bool) -> None:
    """Images and sounds go into one list (`images`), in the order given: a raw prompt's media
    markers take them in that order."""
    p.add_argument("--prompt", help="the user message (default: read stdin)")
    p.add_argument(
        "--image",
        dest="images",
        action="append",
        type=Path,
        default=[],
        metavar="PATH",
        help="attach an image file (repeatable, in order)",
    )
    p.add_argument(
        "--audio",
        dest="images",
        action="append",
        type=audio_file,
        metavar="PATH",
        help="attach a WAV, MP3 or FLAC file, for a model that takes audio (repeatable, in "
        "order with --image)",
    )
    if sizes:
        p.add_argument(
            "--image-size",
            dest="images",
            action="append",
            type=image_size,
            metavar="WxH",
            help="count an image by its size only (repeatable)",
        )
        p.add_argument(
            "--audio-seconds",
            dest="images",
            action="append",
            type=audio_seconds,
            metavar="S",
            help="count a sound by its length only (repeatable)",
        )
    p.add_argument("--system", help="a system message before the user message")
    p.add_argument(
        "--raw",
        action="store_true",
        help="send --prompt as is (no chat template); each media marker takes the next image "
        "or sound",
    )


def generation_arguments(p: argparse.ArgumentParser, *, keep_default: int | str = 0) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=0, help="0: the server's default")
    g.add_argument("--temperature", type=float, help="0 is greedy (server default 0.8)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--repeat-penalty", type=float)
    g.add_argument("--seed", type=int, help="sampling seed (default: random)")
    g.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    g.add_argument("--timeout-generate", type=float, help="deadline of the generation (s)")
    c = p.add_argument_group("context")
    c.add_argument(
        "--policy",
        choices=[x.value for x in Policy],
        default="auto",
        help="what to do when the context is full (default %(default)s)",
    )
    c.add_argument(
        "--keep",
        type=keep_value,
        default=keep_default,
        metavar="N|system",
        help="pin the first N cells, or the system message (default %(default)s)",
    )
    c.add_argument("--unit", choices=[u.value for u in Unit], default="token", help="eviction unit")
    c.add_argument("--discard-fraction", type=float, help="share of evictable cells per shift")


def http_arguments(p: argparse.ArgumentParser, *, max_images: bool = True) -> None:
    """max_images: the gateway's own --max-images and --max-messages (`slotwise serve` has
    prep's, which it honours too). The defaults are MediaPolicy's and GatewayConfig's, not
    imported: every command builds this parser, and the gateway's imports are not light."""
    g = p.add_argument_group("HTTP API")
    _access_arguments(g)
    _size_arguments(g, max_images=max_images)
    _llama_server_arguments(g)
    _reasoning_arguments(p.add_argument_group("reasoning models (llama-server's flags)"))


def _access_arguments(g: argparse._ArgumentGroup) -> None:
    """The model's names, and who may call: keys, browser pages."""
    g.add_argument("--model-name", default="slotwise", help="the model's id in /v1/models")
    g.add_argument(
        "--strict-model-name",
        action="store_true",
        help="404 for any other model name (default: any name means the one model served)",
    )
    g.add_argument(
        "--cors-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="let browser apps on these origins call the API (* for any, localhost for any "
        "page on this machine, any port); default none",
    )
    g.add_argument(
        "--api-key-file", type=Path,
        help="the keys file (`TENANT KEY` lines, or one key): require `Authorization: Bearer "
        "KEY` or `x-api-key`; SIGHUP re-reads it",
    )  # fmt: skip


def _size_arguments(g: argparse._ArgumentGroup, *, max_images: bool) -> None:
    """What one request may carry: images fetched, their sizes and counts, messages,
    completions, the body's size."""
    g.add_argument(
        "--allow-image-urls", action="store_true", help="fetch http(s) image_url (else data:)"
    )
    g.add_argument(
        "--image-url-allow",
        action="append",
        default=[],
        metavar="HOST|CIDR",
        help="with --allow-image-urls: a host or network that may be fetched although not "
        "public (an internal image store); repeatable. Default: public addresses only",
    )
    g.add_argument("--max-image-mb", type=positive_int, default=20, help="per image_url")
    g.add_argument(
        "--max-audio-mb", type=positive_int, default=32,
        help="per sound (input_audio, a sound in multimodal_data), beside --max-image-mb's per "
        "image (default %(default)s); a sound's length is prep's --max-audio-seconds",
    )  # fmt: skip
    if max_images:
        g.add_argument(
            "--max-images", type=positive_int, default=DEFAULT_MAX_IMAGES,
            help="images and sounds per request (default %(default)s, prep's): more are "
            "refused (400) before any is fetched or decoded",
        )  # fmt: skip
        g.add_argument(
            "--max-messages", type=positive_int, default=DEFAULT_MAX_MESSAGES,
            help="chat messages per request (default %(default)s, prep's): more are refused "
            "(400) before any is read",
        )  # fmt: skip
    g.add_argument(
        "--max-completions", type=positive_int, default=32,
        help="generations one llama-server /completion starts, its prompts x n_cmpl (default "
        "%(default)s): more are refused (400) before any starts",
    )  # fmt: skip
    g.add_argument(
        "--max-body-mb", type=positive_int, default=64,
        help="request body size (default %(default)s): larger is refused (413) as it comes in",
    )  # fmt: skip


def _llama_server_arguments(g: argparse._ArgumentGroup) -> None:
    """The page, and llama-server's own flags: slots, aliases and tags, a /completion's
    defaults, verbose replies."""
    g.add_argument(
        "--no-ui", action="store_true", help="no web page at / (the API behind it stays)"
    )
    g.add_argument(
        "--no-slots", action="store_true",
        help="GET /slots answers 501, as llama-server's --no-slots (no slot monitoring)",
    )  # fmt: skip
    g.add_argument(
        "--model-aliases", nargs="+", default=[], metavar="NAME",
        help="more names of the model (llama-server's --alias): listed in /v1/models' "
        "aliases, and taken by --strict-model-name",
    )  # fmt: skip
    g.add_argument(
        "--model-tags", nargs="+", default=[], metavar="TAG",
        help="the model's tags in /v1/models (llama-server's --tags)",
    )  # fmt: skip
    g.add_argument(
        "--default-temperature", type=float, metavar="T",
        help="a native /completion's temperature when it names none (llama-server's --temp; "
        "default 0.8)",
    )  # fmt: skip
    g.add_argument(
        "--default-seed", type=int, metavar="N",
        help="a native /completion's seed when it names none (llama-server's --seed; "
        "default: a random one each)",
    )  # fmt: skip
    g.add_argument(
        "--verbose-replies", action="store_true",
        help="every chat completion carries llama-server's __verbose (the prompt as the "
        "template wrote it), as its --verbose gives; a request's `verbose` decides for itself",
    )  # fmt: skip


def _reasoning_arguments(r: argparse._ArgumentGroup) -> None:
    """Where a reasoning model's thoughts go, their budget, the chat template's variables."""
    r.add_argument(
        "--reasoning-format", choices=["none", "deepseek", "deepseek-legacy", "auto"],
        default="deepseek",
        help="where a reasoning model's thoughts go: deepseek (default, as llama-server's; auto "
        "and deepseek-legacy alike) puts them in reasoning_content, thinking blocks and "
        "reasoning items; none leaves them in the content",
    )  # fmt: skip
    r.add_argument(
        "--reasoning-budget", type=int, default=-1, metavar="N",
        help="a thought of N tokens is ended by writing the template's end of thoughts "
        "(0: at once; default -1: no budget)",
    )  # fmt: skip
    r.add_argument(
        "--reasoning-budget-message", default="", metavar="MESSAGE",
        help="written before the end of a thought the budget ends (default none)",
    )  # fmt: skip
    r.add_argument(
        "--chat-template-kwargs", metavar="JSON",
        help='variables for the chat template, e.g. \'{"enable_thinking": false}\' (a '
        "request's chat_template_kwargs go over them)",
    )  # fmt: skip
    r.add_argument(
        "--reasoning", choices=["on", "off", "auto"], default="auto",
        help="enable_thinking for the chat template: on, off, or auto (default: the "
        "template's own)",
    )  # fmt: skip


def _max_messages(args: argparse.Namespace) -> int:
    """The gateway's --max-messages, or prep's where the parser has that one (serve)."""
    own = getattr(args, "max_messages", None)
    return int(own if own is not None else getattr(args, "prep_max_messages", DEFAULT_MAX_MESSAGES))


def gateway_config(
    args: argparse.Namespace,
    prep: str,
    infer: str,
    token: str | None,
    keys: Any = None,
    max_images: int | None = None,
    max_messages: int | None = None,
):
    """keys: the callers' keys (slotwise_core.keys.Keys), which the services hold too;
    max_images, max_messages: where the parser has no such flag of the gateway's own (prep's)."""
    from clients.gateway import GatewayConfig
    from clients.gateway.media import MediaPolicy, check_allow_patterns

    def allow_patterns(patterns: list[str]) -> tuple[str, ...]:
        try:
            return check_allow_patterns(patterns)
        except ValueError as e:
            raise UsageError(str(e)) from None

    return GatewayConfig(
        prep_address=prep,
        infer_address=infer,
        model_name=args.model_name,
        api_keys=keys,
        media=MediaPolicy(
            allow_http=args.allow_image_urls,
            max_bytes=args.max_image_mb << 20,
            max_audio_bytes=args.max_audio_mb << 20,
            allow=allow_patterns(args.image_url_allow),
            max_images=args.max_images if max_images is None else max_images,
        ),
        token=token,
        strict_model_name=args.strict_model_name,
        cors_origins=tuple(args.cors_origins),
        ui=not args.no_ui,
        max_body_bytes=args.max_body_mb << 20,
        max_messages=_max_messages(args) if max_messages is None else max_messages,
        max_completions=args.max_completions,
        thinking=_thinking(args),
        slots_endpoint=not args.no_slots,
        model_aliases=tuple(args.model_aliases),
        model_tags=tuple(args.model_tags),
        verbose_replies=args.verbose_replies,
        default_temperature=args.default_temperature,
        default_seed=None if args.default_seed in (None, -1) else args.default_seed,
        model_path=str(getattr(args, "infer_model", None) or ""),  # (slotwise serve's)
    )


def _thinking(args: argparse.Namespace) -> Any:
    """The reasoning flags as the gateway's Thinking (what a request leaves unset)."""
    import json

    from clients.gateway.turns import Thinking

    if args.reasoning_budget < -1:
        raise UsageError("--reasoning-budget: -1 (none), 0 or more tokens")
    kwargs: dict[str, Any] = {}
    if args.reasoning != "auto":
        kwargs["enable_thinking"] = args.reasoning == "on"
    if args.chat_template_kwargs:
        try:
            given = json.loads(args.chat_template_kwargs)
        except ValueError:
            given = None
        if not isinstance(given, dict):
            raise UsageError("--chat-template-kwargs: give a JSON object")
        kwargs |= given
    fmt = "deepseek" if args.reasoning_format == "auto" else args.reasoning_format
    budget = None if args.reasoning_budget == -1 else args.reasoning_budget
    return Thinking(fmt, budget, args.reasoning_budget_message, kwargs)


# ---------------------------------------------------------------------------------------------
# shared helpers


def make_client(args: argparse.Namespace) -> SlotwiseClient:
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        if bool(args.tls_cert) != bool(args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        try:
            tls = Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        except OSError as e:
            raise UsageError(f"cannot read a TLS file: {e}") from None
    token = read_token(args.token_file) if args.token_file else args.token
    prep, infer = getattr(args, "prep", None), getattr(args, "infer", None)
    if getattr(args, "router", None) or getattr(args, "model", None):
        if not (args.router and args.model):
            raise UsageError("--router and --model go together")
        import httpx

        from clients.router import RouterError, model_addresses

        try:
            prep, infer = model_addresses(args.router, args.model, token=token)
        except (RouterError, httpx.HTTPError, ValueError) as e:  # (ValueError: not JSON)
            raise ServerError(f"{args.router}: {e}") from None
    return SlotwiseClient(
        prep if hasattr(args, "prep") else None,
        infer if hasattr(args, "infer") else None,
        tls=tls,
        token=token,
        timeout=args.timeout,
    )


def read_keys(path: Path) -> Any:
    """A keys file (slotwise_core.keys: `TENANT KEY` lines, or one key)."""
    from slotwise_core.keys import Keys, KeysError

    try:
        return Keys(path)
    except KeysError as e:
        raise UsageError(str(e)) from None


def one_keys_file(token_file: Path | None, api_key_file: Path | None) -> Any:
    """serve's keys file, for prep, infer and the HTTP API alike (either flag names it): the
    HTTP API passes each caller's key on, so the services must hold the same keys."""
    if token_file and api_key_file and token_file.resolve() != api_key_file.resolve():
        raise UsageError(
            "--token-file and --api-key-file name two files: slotwise serve reads one keys "
            "file for prep, infer and the HTTP API (--token-file)"
        )
    path = token_file or api_key_file
    return read_keys(path) if path else None


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise UsageError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if not token:
        raise UsageError(f"the token file {path} is empty")
    return token


def read_images(paths: Sequence[Any]) -> list[Any]:
    """Paths -> file bytes (an image's) or Audio of the bytes (a sound's); sizes and lengths
    pass through. A missing file is a usage error."""
    out: list[Any] = []
    for p in paths:
        if isinstance(p, Path):
            try:
                out.append(p.read_bytes())
            except OSError as e:
                raise UsageError(f"cannot read image {p}: {e.strerror or e}") from None
        elif isinstance(p, Audio) and isinstance(p.data, Path):
            try:
                out.append(Audio(p.data.read_bytes()))
            except OSError as e:
                raise UsageError(f"cannot read sound {p.data}: {e.strerror or e}") from None
        else:
            out.append(p)
    return out


def prompt_input(args: argparse.Namespace) -> tuple[str | list[Message], list[Any]]:
    """(prompt, images) for prepare/count: a raw prompt, or a system + user conversation."""
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    images = read_images(args.images)
    if args.raw:
        if args.system:
            raise UsageError("--system does not go with --raw")
        return text, images
    if not text and not images:
        raise UsageError("nothing to send: give --prompt (or text on stdin), --image or --audio")
    messages = [Message.system(args.system)] if args.system else []
    messages.append(Message.user(*images, *([text] if text else [])))
    return messages, []


def generation_options(args: argparse.Namespace, *, keep: int) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "policy": args.policy,
        "keep": keep,
        "unit": args.unit,
        "discard_fraction": args.discard_fraction,
        "timeout": args.timeout_generate,
    }


def describe_shift(s: Shift) -> str:
    media = f", {len(s.media_ids_evicted)} media" if s.media_ids_evicted else ""
    return (
        f"context shift ({s.policy.value}): evicted {s.num_cells_evicted} cells / "
        f"{s.num_positions_evicted} positions{media}; {s.num_cells_used_after} cells used, "
        f"next position {s.next_position_after}"
    )


def describe_truncation(s: Started) -> str:
    media = f", {len(s.truncated_media_ids)} media" if s.truncated_media_ids else ""
    return (
        f"prompt truncated: the oldest {s.num_truncated_cells} cells ({s.num_truncated_chunks} "
        f"chunks{media}) did not fit the {s.num_capacity_cells}-cell context"
    )


def summary_line(done: Completion) -> str:
    u = done.usage
    started = done.started
    policies = "/".join(dict.fromkeys(s.policy.value for s in done.shifts)) or "-"
    return (
        f"[slotwise] prompt_cells={u.num_prompt_cells} prompt_positions={u.num_prompt_positions} "
        f"generated_tokens={u.num_generated_tokens} shifts={u.num_shifts} "
        f"evicted_cells={u.num_evicted_cells} evicted_media={done.num_evicted_media} "
        f"policy={policies} truncated_cells={started.num_truncated_cells if started else 0} "
        f"finish={done.reason.value} prefill_s={u.prefill_seconds:.3f} "
        f"decode_s={u.decode_seconds:.3f}"
    )


class Progress:
    """A prefill progress line on stderr once prefill has taken more than `after` seconds."""

    def __init__(self, err: TextIO, after: float = 0.5):
        self.err = err
        self.after = after
        self.t0 = time.monotonic()
        self.last = 0.0
        self.shown = False
        self.tty = err.isatty()

    def update(self, p: Prefill) -> None:
        now = time.monotonic()
        if now - self.t0 < self.after or now - self.last < (0.1 if self.tty else 1.0):
            return
        self.last = now
        pct = 100 * p.num_cells_done / max(1, p.num_cells_total)
        line = f"prefill {p.num_cells_done}/{p.num_cells_total} cells ({pct:.0f}%)"
        if self.tty:
            self.err.write(f"\r\x1b[K{line}")
        else:
            self.err.write(line + "\n")
        self.err.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown and self.tty:
            self.err.write("\r\x1b[K")
            self.err.flush()
        self.shown = False


def stream_reply(
    events: Iterator[Event],
    out: TextIO,
    err: TextIO,
    *,
    shift_notes: bool,
) -> Completion:
    """Write deltas to `out` as they come; progress and (optionally) shift notes to `err`."""
    done = Completion()
    progress = Progress(err)
    for event in events:
        done.add(event)
        if isinstance(event, Prefill):
            progress.update(event)
        elif isinstance(event, Delta):
            progress.clear()
            if event.text:
                out.write(event.text)
                out.flush()
        elif isinstance(event, Shift) and shift_notes:
            progress.clear()
            err.write(f"\n[{describe_shift(event)}]\n")
            err.flush()
        elif isinstance(event, Started) and shift_notes and event.num_truncated_cells:
            err.write(f"[{describe_truncation(event)}]\n")
            err.flush()
    progress.clear()
    return done


def finish_status(done: Completion, err: TextIO) -> int:
    f = done.finished
    if f is None:
        print("slotwise: error: the stream ended without a finished event", file=err)
        return EXIT_SERVER
    if f.reason in (FinishReason.STOP, FinishReason.LENGTH):
        return EXIT_OK
    print(f"slotwise: error: generation {f.reason.value}: {f.error or 'no reason given'}", file=err)
    return EXIT_SERVER


# ---------------------------------------------------------------------------------------------
# commands


def cmd_generate(args: argparse.Namespace) -> int:
    prompt, images = prompt_input(args)
    with make_client(args) as client:
        prepared = client.prepare(prompt, images)
        keep = args.keep
        if keep == "system":
            keep = prepared.num_cells_of(0) if args.system else 0
        options = generation_options(args, keep=keep)
        options["truncate_prompt"] = args.truncate
        events = client.generate(prepared, **options)
        try:
            done = stream_reply(events, sys.stdout, sys.stderr, shift_notes=args.verbose)
        finally:
            events.close()  # cancels the call if we stopped early (Ctrl-C)
    if done.text and not done.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary_line(done), file=sys.stderr)
    return finish_status(done, sys.stderr)


CHAT_HELP = """commands:
  /image PATH   attach an image to your next message (repeatable)
  /audio PATH   attach a sound (WAV, MP3 or FLAC) to your next message (repeatable)
  /reset        forget the conversation (the system message stays)
  /history      show the conversation's messages
  /help         this text
  /quit         leave (so does end of input)"""


def cmd_chat(args: argparse.Namespace) -> int:
    inp, out, err = sys.stdin, sys.stdout, sys.stderr
    interactive = inp.isatty()
    with make_client(args) as client:
        marker = client.model_info().media_marker
        system = [Message.system(args.system)] if args.system else []
        history: list[Message] = list(system)
        pending: list[bytes | Audio] = []
        failed = False
        if interactive:
            print("slotwise chat: type a message, /help for commands, /quit to leave", file=err)
        while True:
            if interactive:
                err.write("you> ")
                err.flush()
            line = inp.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.startswith("/"):
                command, _, rest = line.partition(" ")
                if command == "/quit":
                    break
                if command == "/help":
                    print(CHAT_HELP, file=err)
                elif command in ("/image", "/audio"):
                    path = Path(rest.strip()).expanduser()
                    what = "image" if command == "/image" else "sound"
                    try:
                        data = path.read_bytes()
                        pending.append(data if what == "image" else Audio(data))
                        print(f"[{what} {path} attached to your next message]", file=err)
                    except OSError as e:
                        print(f"[cannot read {path}: {e.strerror or e}]", file=err)
                elif command == "/reset":
                    history = list(system)
                    pending.clear()
                    print("[conversation forgotten]", file=err)
                elif command == "/history":
                    for k, m in enumerate(history):
                        print(f"{k:3d} {m.role}:{_media_note(m)} {m.text[:70]!r}", file=err)
                else:
                    print(f"[unknown command {command}; /help lists them]", file=err)
                continue
            history.append(Message.user(*pending, line))
            pending = []
            ok = chat_turn(client, history, args, marker, out, err)
            if not ok:
                history.pop()  # forget the failed turn; the user may try again
                failed = True
    return EXIT_SERVER if failed else EXIT_OK


def _media_note(m: Message) -> str:
    sounds = sum(isinstance(p, Audio) for p in m.parts)
    images = m.num_images - sounds  # (num_images counts every part that is not text)
    return (f" [{images} image(s)]" if images else "") + (f" [{sounds} sound(s)]" if sounds else "")


def chat_turn(
    client: SlotwiseClient,
    history: list[Message],
    args: argparse.Namespace,
    marker: str,
    out: TextIO,
    err: TextIO,
) -> bool:
    try:
        prepared = client.prepare(history)
        keep = args.keep
        if keep == "system":
            keep = prepared.num_cells_of(0) if history[0].role == "system" else 0
        options = generation_options(args, keep=keep)
        options["truncate_prompt"] = not args.no_truncate
        events = client.generate(prepared, **options)
        try:
            done = stream_reply(events, out, err, shift_notes=False)
        finally:
            events.close()
    except SlotwiseError as e:
        print(f"\n[error: {e}]", file=err)
        return False
    out.write("\n")
    out.flush()
    notes = []
    if done.started and done.started.num_truncated_cells:
        notes.append(describe_truncation(done.started))
    notes += [describe_shift(s) for s in done.shifts]
    for note in notes:
        print(f"[note: {note}]", file=err)
    if finish_status(done, err) != EXIT_OK:
        return False
    history.append(Message.assistant(done.text.replace(marker, "") or "."))
    return True


def print_count(c: Count, verbose: bool) -> None:
    print(f"cells={c.num_cells} positions={c.num_positions} chunks={len(c.chunks)}")
    if not verbose:
        return
    print(
        f"{'chunk':>5}  {'message':>7}  {'group':>5}  {'kind':<5}  {'cells':>6}  {'positions':>9}"
    )
    for k, ch in enumerate(c.chunks):
        kind = ("audio" if ch.is_audio else "media") if ch.is_media else "text"
        print(
            f"{k:>5}  {ch.message_index:>7}  {ch.media_group:>5}  {kind:<5}  "
            f"{ch.num_cells:>6}  {ch.num_positions:>9}"
        )


def cmd_count(args: argparse.Namespace) -> int:
    prompt, images = prompt_input(args)
    with make_client(args) as client:
        print_count(client.count(prompt, images), args.verbose)
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    status = EXIT_OK
    fingerprints = []
    with make_client(args) as client:
        for which, call in (("prep", client.model_info), ("infer", client.server_info)):
            address = args.prep if which == "prep" else args.infer
            print(f"{which} ({address}):")
            try:
                info = call()
            except SlotwiseError as e:
                print(f"  error: {e}")
                status = EXIT_SERVER
                continue
            fingerprints.append((info.model_fingerprint, info.mmproj_fingerprint))
            for key, value in vars(info).items():
                if key == "stats":
                    for k, v in vars(value).items():
                        print(f"  stats.{k}: {v}")
                else:
                    print(f"  {key}: {value}")
    if len(fingerprints) == 2:
        same = fingerprints[0] == fingerprints[1]
        print(f"fingerprints match: {'yes' if same else 'NO (prompts from prep will be refused)'}")
    return status


def cmd_gateway(args: argparse.Namespace) -> int:
    from clients.gateway.serve import run_gateway

    if args.api_key_file and args.token_file:
        # (each caller's key goes on to the services: a token of the gateway's own would
        # never be sent, and the services would refuse keys they do not hold)
        raise UsageError(
            "--api-key-file passes each caller's key on to the services, which read the same "
            "keys file: --token-file is for a gateway without --api-key-file"
        )
    keys = read_keys(args.api_key_file) if args.api_key_file else None
    config = gateway_config(args, args.prep, args.infer, read_token(args.token_file), keys)
    run_gateway(config, args.host, args.port)
    return EXIT_OK
