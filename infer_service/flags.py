"""infer_service's command-line flags: its parser and `slotwise serve` are built from these
(and read into start arguments by `start_arguments` in infer_service/__main__.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from infer_service.api.request import GenerateLimits
from infer_service.runner.cache_types import FLASH_ATTN, GGML_TYPES
from infer_service.runner.lora import LoraFile, lora_files
from infer_service.runner.runtime import RuntimeConfig
from infer_service.sessions.session import SessionLimits
from infer_service.spec.config import SpecConfig, SpecType, spec_types
from slotwise_core.flags import option, positive_int
from slotwise_core.serving import DEFAULT_MAX_MESSAGE_BYTES

_d = RuntimeConfig(model=Path())


def spec_types_flag(text: str) -> str:
    try:
        spec_types(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_spec = SpecConfig()
_life = SessionLimits()


def nice_value(text: str) -> int:
    n = int(text)
    if not 0 <= n <= 19:
        raise argparse.ArgumentTypeError(f"must be within 0-19, got {n}")
    return n


class LoraFlag(argparse.Action):
    """`--lora` and `--lora-scaled` (comma-separated values too): each flag's files with
    their place among both flags' (an adapter's id), as llama-server numbers them."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            files = lora_files(str(values), scaled=bool(self.const))
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        seen = getattr(namespace, "lora_flags_seen", 0)
        namespace.lora_flags_seen = seen + len(files)
        given = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, given + [(seen + k, f) for k, f in enumerate(files)])


def lora_in_order(*flags: list[tuple[int, LoraFile]] | None) -> tuple[LoraFile, ...]:
    """The adapters of both flags, in id order."""
    return tuple(f for _, f in sorted(p for given in flags for p in given or ()))


OPTIONS = (
    option("--model", type=Path, required=True, help="text model GGUF"),
    option("--mmproj", type=Path, help="multimodal projector GGUF (omit for text-only)"),
    option("--ctx-size", type=positive_int, default=_d.ctx_size,
           help="KV cells for all slots together"),
    option("--parallel", type=positive_int, default=_d.parallel, help="slots (sequences)"),
    option("--kv-unified", action="store_true",
           help="one pool of --ctx-size cells for every slot (llama.cpp's unified cache): a "
           "slot's sequence may grow to the pool (or --kv-unified-per-slot), and a pinned "
           "prefix (the system message and its images) is stored once for every conversation "
           "of a tenant that opens with it"),
    option("--kv-unified-per-slot", type=int, default=_d.max_cells_per_slot,
           help="with --kv-unified: the most cells one slot's sequence holds; 0: the pool"),
    option("--shared-prefixes", type=positive_int, default=_d.shared_prefixes,
           help="with --kv-unified: pinned prefixes kept in the pool at once (least recently "
           "used out first, and only while no slot shares it)"),
    option("--ctx-checkpoints", type=int, default=_d.ctx_checkpoints,
           help="hybrid and recurrent models (Qwen3.5, LFM2): checkpoints of a slot's "
           "recurrent state kept at once (the end of the pinned prefix, of each prompt and "
           "reply): a prompt that parts from what a slot holds reuses it up to the last one "
           "before that point, and an eviction decodes the kept part again from the pinned "
           "prefix's; 0: none (every such prompt is decoded whole)"),
    option("--checkpoint-min-step", type=positive_int, default=_d.checkpoint_min_step,
           help="with --ctx-checkpoints: a long prompt is checkpointed every this many cells"),
    option("--cache-type-k", choices=list(GGML_TYPES), default="f16",
           help="the type of a cell's K (llama-server's -ctk): q8_0 takes about half of f16's "
           "bytes, so about twice the cells fit in the same memory; quantized types need the "
           "model's head size to be a multiple of 32"),
    option("--cache-type-v", choices=list(GGML_TYPES), default="f16",
           help="the type of a cell's V (-ctv); a quantized V needs --flash-attn on or auto"),
    option("--flash-attn", choices=list(FLASH_ATTN), default="auto",
           help="flash attention (-fa): auto lets llama.cpp decide"),
    option("--cache-type-k-draft", choices=list(GGML_TYPES), default="f16",
           help="with --model-draft: its cells' K type (-ctkd)"),
    option("--cache-type-v-draft", choices=list(GGML_TYPES), default="f16",
           help="with --model-draft: its cells' V type (-ctvd)"),
    option("--lora", action=LoraFlag, const=False, default=None, metavar="FNAME",
           help="a LoRA adapter to load with the model, at scale 1 (comma-separated values, or "
           "the flag again, for several); adapters are numbered from 0 in the order --lora and "
           "--lora-scaled give them"),
    option("--lora-scaled", action=LoraFlag, const=True, default=None, metavar="FNAME:SCALE",
           help="a LoRA adapter with its scale (FNAME:SCALE,...)"),
    option("--lora-init-without-apply", action="store_true",
           help="load the LoRA adapters at scale 0: requests name the ones they use (`lora`), "
           "or POST /lora-adapters (LoraSetScales) sets the scales"),
    option("--batch-size", type=positive_int, default=_d.batch_size),
    option("--ubatch-size", type=positive_int, default=_d.ubatch_size),
    option("--gpu-layers", type=int, default=_d.gpu_layers, help="layers offloaded (CUDA builds)"),
    option("--threads", type=positive_int, default=_d.threads,
           help="threads of a step that generates (one token per sequence); default: every "
           "physical core"),
    option("--threads-batch", type=positive_int, default=_d.threads_batch,
           help="threads of a step with prompt tokens; default: every physical core"),
    option("--encode-threads", type=positive_int, default=_d.encode_threads,
           help="image encoding threads (its own worker, beside decoding)"),
    option("--encode-nice", type=nice_value, default=_d.encode_nice,
           help="the encoding worker's priority below decoding's (nice; 0: the "
           "same): while slots generate, an image encodes on what they leave"),
    option("--extra-bufts", choices=["auto", "on", "off"], default="auto",
           help="llama.cpp's repacked weight buffers (AMX among them); auto: off where the CPU "
           "reports AMX and the kernel refuses it"),
    option("--spec-type", type=spec_types_flag, default=_spec.type.value,
           help="speculative decoding, one type or several (a,b: the first with a draft "
           f"drafts, in llama-server's order): {', '.join(t.value for t in SpecType)}; drafts "
           "are verified in the step's batch (the output does not change; copy-heavy replies "
           "come faster); a request's `speculative` overrides it"),
    option("--spec-default", action="store_true",
           help="llama-server's default speculative config: ngram-mod, n-match 24, n-min 48, "
           "n-max 64"),
    option("--spec-ngram-mod-n-match", type=positive_int, default=_spec.mod_n_match,
           help="ngram-mod: tokens of the n-gram hashed"),
    option("--spec-ngram-mod-n-min", type=int, default=_spec.mod_n_min,
           help="ngram-mod: a shorter draft is none"),
    option("--spec-ngram-mod-n-max", type=int, default=_spec.mod_n_max,
           help="ngram-mod: the longest draft"),
    option("--spec-synth-rates", metavar="P0,P1,...",
           help="benchmarking only (the output is not the model's): each draft position is "
           "accepted with this probability, whatever the model samples (llama-server's; as "
           "many values as --spec-draft-n-max, non-increasing)"),
    option("--spec-synth-len", type=float, metavar="L",
           help="benchmarking only: --spec-synth-rates from a mean acceptance length, the "
           "model's token included"),
    option("--spec-cache-mb", type=int, default=256,
           help="what drafts learn across requests (ngram-mod's pools, ngram-cache's stores, "
           "the suffix cache), per tenant and never shared between tenants: all of them "
           "together; the least recently used tenant's go first"),
    option("--model-draft", type=Path,
           help="a draft model of the same vocabulary (speculative type draft-simple): its "
           "greedy guesses are verified as n-gram drafts are"),
    option("--spec-draft-n-max", type=int, default=_spec.n_max,
           help="drafts per step at most (a slot drafts fewer while its drafts miss)"),
    option("--spec-draft-n-min", type=int, default=_spec.n_min,
           help="fewer drafts than this: none that step"),
    option("--spec-draft-p-min", type=float, default=_spec.p_min,
           help="a draft model's confidence floor (n-gram drafts have none)"),
    option("--spec-ngram-size-n", type=positive_int, default=_spec.size_n,
           help="tokens of the n-gram looked up in the sequence"),
    option("--spec-ngram-size-m", type=positive_int, default=_spec.size_m,
           help="tokens drafted from one match at most"),
    option("--spec-ngram-min-hits", type=positive_int, default=_spec.min_hits,
           help="ngram-map-k: occurrences of the n-gram before it drafts"),
    option("--spec-rollback", type=int, default=_d.spec_rollback,
           help="hybrid models (Qwen3.5, LFM2): the recurrent state keeps a snapshot per token "
           "for this many of the last tokens a step decodes, so that many rejected drafts roll "
           "back in place (llama.cpp's n_rs_seq: memory for as many states per slot, and time "
           "in every step); a longer draft is verified from a checkpoint of the state, taken "
           "before its step (0, the default: always so, as llama-server does for n-gram drafts)"),
    option("--max-grammar-ms", type=positive_int, default=_d.grammar_ms,
           help="the most one token's grammar work may take on the engine thread; a request "
           "whose grammar takes longer ends (RESOURCE_EXHAUSTED GRAMMAR_TOO_COSTLY)"),
    option("--max-queue", type=int, default=64, help="requests waiting for a slot"),
    option("--tenant-max-active", type=int, default=0,
           help="a tenant's generations in slots at once (more wait); 0: no limit of its own"),
    option("--tenant-max-queued", type=int, default=0,
           help="a tenant's requests waiting (more are refused, RESOURCE_EXHAUSTED); 0: no limit"),
    option("--queue", choices=["fair", "fifo"], default="fair",
           help="fair: round robin across tenants (default); fifo: one queue for all"),
    option("--media-cache-mb", type=int, default=1024,
           help="images checked (a quarter: one sent again is not decoded again) and the "
           "projector's outputs (the rest)"),
    option("--sessions-dir", type=Path, help="persist sessions here (survive restarts)"),
    option("--tenant-max-sessions", type=int, default=_life.max_sessions,
           help="sessions a tenant keeps: its least recently used one not in a turn makes way "
           "for a new one (none can: RESOURCE_EXHAUSTED); 0: no limit"),
    option("--tenant-max-session-mb", type=int, default=_life.max_bytes >> 20,
           help="a tenant's sessions on disk (files and their images' pixels): its least "
           "recently used ones make way; 0: no limit"),
    option("--session-ttl", type=int, default=int(_life.ttl),
           help="seconds a session may go without a turn before it is deleted, in memory and "
           "on disk (default: 30 days); 0: never"),
    option("--state-cache-mb", type=int, default=256,
           help="host memory for the KV states of stateless conversations that lost their slot"),
    option("--embeddings", action="store_true",
           help="serve Embed: mean-pooled embeddings on a context of their own"),
    option("--embeddings-ctx", type=positive_int, default=512,
           help="tokens per text for --embeddings"),
    option("--default-max-tokens", type=positive_int, default=GenerateLimits.default_max_tokens),
    option("--max-message-mb", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES >> 20),
)  # fmt: skip
