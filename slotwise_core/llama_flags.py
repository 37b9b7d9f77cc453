"""llama-server's command line in slotwise's terms: each llama-server flag that `slotwise
serve` has under another name, the flags that change nothing slotwise does (accepted, with a
note), and those it cannot honour (refused, with the reason). llama.cpp's own server tests run
`slotwise serve` through it (tests/llama_server_suite/llama-server), and a router's preset
(model_router/catalog.py) reads its keys with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["REFUSED", "ROUTER", "SWITCHES", "VALUED", "FlagError", "translate"]


class FlagError(ValueError):
    """A flag slotwise cannot honour, or does not know: the message names it and says why."""


# flags that take a value, and what they become (None: ignored, with a note)
VALUED = {
    "--port": "--http-port",
    "--model": "--model",
    "-m": "--model",
    "--mmproj": "--mmproj",
    "--ctx-size": "--ctx-size",
    "-c": "--ctx-size",
    "--parallel": "--parallel",
    "-np": "--parallel",
    "--batch-size": "--batch-size",
    "-b": "--batch-size",
    "--ubatch-size": "--ubatch-size",
    "-ub": "--ubatch-size",
    "--threads": "--threads",
    "-t": "--threads",
    "--n-gpu-layers": "--gpu-layers",
    "-ngl": "--gpu-layers",
    "-ctk": "--cache-type-k",
    "--cache-type-k": "--cache-type-k",
    "-ctv": "--cache-type-v",
    "--cache-type-v": "--cache-type-v",
    "-fa": "--flash-attn",
    "--flash-attn": "--flash-attn",
    "--n-predict": "--default-max-tokens",
    "-n": "--default-max-tokens",
    "--slot-save-path": "--sessions-dir",
    "--chat-template": "--chat-template",
    "--chat-template-file": "--chat-template",
    "--model-draft": "--model-draft",
    "--spec-draft-model": "--model-draft",
    "-md": "--model-draft",
    "--spec-type": "--spec-type",
    "--spec-draft-n-max": "--spec-draft-n-max",
    "--spec-draft-n-min": "--spec-draft-n-min",
    "--spec-draft-p-min": "--spec-draft-p-min",
    "--draft-p-min": "--spec-draft-p-min",
    "--spec-ngram-mod-n-match": "--spec-ngram-mod-n-match",
    "--spec-ngram-mod-n-min": "--spec-ngram-mod-n-min",
    "--spec-ngram-mod-n-max": "--spec-ngram-mod-n-max",
    "--temp": "--default-temperature",
    "--seed": "--default-seed",
    "--media-path": None,
    "--cache-ram": None,
    "--reasoning-format": "--reasoning-format",
    "--reasoning": "--reasoning",
    "--lora": "--lora",
    # llama-server's benchmarking aid: drafts accepted at random, whatever the target samples
    "--spec-synth-rates": "--spec-synth-rates",
    "--spec-synth-len": "--spec-synth-len",
}
SWITCHES = {
    "--embedding": "--embeddings",
    "--embeddings": "--embeddings",
    "--kv-unified": "--kv-unified",
    "--no-ui": "--no-ui",
    "--no-webui": "--no-ui",
    "--offline": None,
    "--cont-batching": None,
    "--metrics": None,
    "--swa-full": None,
    "--verbose": "--verbose-replies",
    "--no-slots": "--no-slots",
    "--jinja": None,
    "--no-jinja": None,
    "--slots": None,
    "--no-cache-idle-slots": None,
    "--context-shift": None,
    "--spec-default": "--spec-default",
}
REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")  # slotwise's
REFUSED = {
    "--hf-repo": "no model hub here: a local --model",
    "--hf-file": "no model hub here: a local --model",
    "--model-url": "no model hub here: a local --model",
    "--mmproj-url": "no model hub here: a local --mmproj",
    "--reranking": "slotwise serves no reranking model",
    "--grp-attn-n": "no group attention (self-extend) in slotwise",
    "--grp-attn-w": "no group attention (self-extend) in slotwise",
    "--pooling": "slotwise pools embeddings by mean only",
    "--ui-mcp-proxy": "slotwise has no CORS proxy for the web page's MCP servers",
    "--mcp-servers-config": "slotwise runs no MCP servers",
    "--mcp-servers-json": "slotwise runs no MCP servers",
    "--tools-runtime": "slotwise runs no built-in tools",
}


# the router's own (model_router): the same names in slotwise serve
ROUTER_VALUED = ("--models-dir", "--models-preset", "--models-max", "--sleep-idle-seconds")
ROUTER_SWITCHES = ("--models-autoload", "--no-models-autoload")
ROUTER = ROUTER_VALUED + ROUTER_SWITCHES


def translate(args: Sequence[str], note: Callable[[str], None]) -> tuple[list[str], dict[str, str]]:
    """llama-server's arguments as slotwise serve's, and the settings that are not flags of
    slotwise serve's own: `host`, `api_key`, `cors` (what the caller does with each is its
    own). FlagError for a flag slotwise cannot honour."""
    out: list[str] = []
    extra: dict[str, str] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in REFUSED:
            raise FlagError(f"{flag}: {REFUSED[flag]}")
        if flag in SWITCHES or flag in ROUTER_SWITCHES:
            target = SWITCHES.get(flag, flag)
            if target is not None:
                out.append(target)
            i += 1
            continue
        if i + 1 >= len(args):
            raise FlagError(f"{flag}: a value is missing, or slotwise does not know the flag")
        value = args[i + 1]
        i += 2
        if flag in ("--host", "--api-key", "--cors-origins"):
            extra[flag.removeprefix("--")] = value
        elif flag == "--tools":
            # llama-server's built-in tools (files, shell) are not slotwise's; the same guard
            # on who may call: only pages on this machine, unless --cors-origins says otherwise
            note(f"--tools {value}: ignored (no built-in tools); CORS limited to localhost")
            extra.setdefault("cors-origins", "localhost")
        elif flag == "--alias":
            # several names: the id is the first in order (llama-server keeps them in a set)
            names = sorted(set(value.split(",")))
            out += ["--model-name", names[0], "--model-aliases", *names]
        elif flag == "--tags":
            out += ["--model-tags", *value.split(",")]
        elif flag == "--reasoning-format" and value not in REASONING_FORMATS:
            note(f"--reasoning-format {value}: ignored (slotwise has no such format)")
        elif flag in ("--n-predict", "-n") and value.lstrip("-").isdigit() and int(value) < 0:
            note(f"{flag} {value}: no limit, slotwise's default (up to the context)")
        elif flag in ROUTER_VALUED:
            out += [flag, value]
        elif flag in VALUED:
            target = VALUED[flag]
            if target is None:
                note(f"{flag} {value}: ignored")
            else:
                out += [target, value]
        else:
            raise FlagError(f"{flag}: slotwise has no such option")
    return out, extra
