"""Reading llama-server's request bodies: its fields, their JSON types and defaults, and what
a /completion asks for (Settings), with its error words.

Bodies are read by hand, not by a schema, so that a field of the wrong JSON type is named as
llama-server names it ("Field 'n_predict': type must be number, but is string"). The fields
llama-server has and slotwise cannot honour (samplers it lacks, ...) are refused by name
unless they hold their no-op value, never ignored.
"""

from __future__ import annotations

import copy
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from clients.client import Speculative
from clients.gateway.bodies import parse
from clients.gateway.errors import ApiError, invalid
from clients.gateway.generation import speculative_of
from clients.gateway.schema import MAX_N, SlotwiseOptions
from slotwise_core.limits import MAX_TOKENS, MAX_TOP_LOGPROBS

# llama-server's error types by HTTP status (format_error_response)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}

# llama-server's sampler chain, and the part of it slotwise's chain has (in the same order)
DEFAULT_SAMPLERS = (
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
)  # fmt: skip
_CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")
# names and one-letter codes common_sampler_types_from_names / _from_chars take
_SAMPLER_NAMES = {
    "penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top_k": "top_k",
    "typ_p": "typ_p", "typical_p": "typ_p", "typical": "typ_p", "top_p": "top_p",
    "nucleus": "top_p", "min_p": "min_p", "xtc": "xtc", "temperature": "temperature",
    "temp": "temperature", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p",
    "typ-p": "typ_p", "top-n-sigma": "top_n_sigma",
}  # fmt: skip
_SAMPLER_CHARS = {
    "e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
    "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature",
}  # fmt: skip
# what a sampler left out of `samplers` amounts to in slotwise's chain
_NEUTRAL: dict[str, dict[str, Any]] = {
    "top_k": {"top_k": 0},
    "top_p": {"top_p": 1.0},
    "min_p": {"min_p": 0.0},
    "temperature": {"temperature": 1.0},
    "penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
}
# llama-server's samplers slotwise's chain does not have, each with the values that leave it out
_ABSENT_SAMPLERS = {
    "dynatemp_range": 0.0,
    "typical_p": 1.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
    "n_indent": 0,
    "t_max_predict_ms": 0,
    "adaptive_target": -1.0,
}
RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED


def f32(x: float) -> float:
    """x as llama-server prints it: a float, widened to a double."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def native_error(status: int, message: str) -> ApiError:
    return ApiError(status, message, type=ERROR_TYPES.get(status, "server_error"))


def bad(message: str) -> ApiError:
    return native_error(400, message)


# -- reading bodies ---------------------------------------------------------------------------


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def get(body: dict[str, Any], name: str, kind: str, default: Any, *, bits: int = 32) -> Any:
    """body[name] when present and not null (llama-server's json_value), else default. An
    integer is one of `bits` bits, signed, as llama-server's C++ reads it (a number past that
    is refused, by name: it would reach protobuf, or an exponent, as it is)."""
    value = body.get(name)
    if value is None:
        return default
    found = _json_type(value)
    if found != ("number" if kind in ("integer", "number") else kind):
        want = "number" if kind == "integer" else kind
        raise bad(f"Field '{name}': type must be {want}, but is {found}")
    if kind == "integer":
        if not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
            raise bad(f"Field '{name}': {value} is out of range (a {bits}-bit integer)")
        return int(value)
    if kind == "number":
        return number(value, name)
    return value


def number(value: float, name: str) -> float:
    """A JSON number as a double; an integer too large for one is refused by name."""
    try:
        return float(value)
    except OverflowError:
        raise bad(f"Field '{name}': {value} is out of range (a double)") from None


async def read_body(request: Request) -> dict[str, Any]:
    """The body's object, read with bodies.parse's bounds (nesting, numbers JSON has not)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = parse(raw)
    except json.JSONDecodeError as e:
        raise bad(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


# -- what a completion asks for ---------------------------------------------------------------


@dataclass
class Settings:
    """One /completion's options: what the turn gets, and what generation_settings echoes."""

    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = RANDOM_SEED
    stop: list[str] = field(default_factory=list)
    n_keep: int = 0
    ignore_eos: bool = False
    stream: bool = False
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    n_probs: int = 0
    grammar: str = ""
    json_schema: Any = None
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    timings_per_token: bool = False
    return_progress: bool = False
    return_tokens: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    n_cmpl: int = 1
    response_fields: list[str] = field(default_factory=list)
    speculative: Speculative | None = None
    lora: list[tuple[int, float]] = field(default_factory=list)  # (id, scale); []: the server's
    slotwise: SlotwiseOptions = field(default_factory=SlotwiseOptions)

    def sampling(self) -> dict[str, Any]:
        """The sampling options of slotwise's chain, the samplers left out made neutral."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "penalty_last_n": self.repeat_last_n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": None if self.seed == RANDOM_SEED else self.seed,
        }
        for sampler, values in _NEUTRAL.items():
            if sampler not in self.samplers:
                out.update(values)
        if self.temperature <= 0:
            out["temperature"] = 0.0  # (greedy, whatever the chain: as llama.cpp's temp does)
        return out

    def params(self, *, full: bool = True) -> dict[str, Any]:
        """llama-server's task_params.to_json: `full` for a completion's generation_settings,
        else the shorter form /props shows."""
        p: dict[str, Any] = {
            "seed": self.seed,
            "temperature": f32(self.temperature),
            "dynatemp_range": 0.0,
            "dynatemp_exponent": 1.0,
            "top_k": self.top_k,
            "top_p": f32(self.top_p),
            "min_p": f32(self.min_p),
            "top_n_sigma": -1.0,
            "xtc_probability": 0.0,
            "xtc_threshold": f32(0.1),
            "typical_p": 1.0,
            "repeat_last_n": self.repeat_last_n,
            "repeat_penalty": f32(self.repeat_penalty),
            "presence_penalty": f32(self.presence_penalty),
            "frequency_penalty": f32(self.frequency_penalty),
            "dry_multiplier": 0.0,
            "dry_base": 1.75,
            "dry_allowed_length": 2,
            "dry_penalty_last_n": 64,
        }
        if full:
            p["dry_sequence_breakers"] = ["\n", ":", '"', "*"]
        p |= {
            "mirostat": 0,
            "mirostat_tau": 5.0,
            "mirostat_eta": f32(0.1),
            "adaptive_target": -1.0,
            "adaptive_decay": f32(0.9),
        }
        if full:
            p["stop"] = list(self.stop)
        p |= {
            "max_tokens": self.n_predict,
            "n_predict": self.n_predict,
            "n_keep": self.n_keep,
            "n_discard": 0,
            "ignore_eos": self.ignore_eos,
            "stream": self.stream,
        }
        if full:
            # (a ban is -infinity, which llama-server's JSON writes as null)
            p["logit_bias"] = [
                {"bias": b if math.isfinite(b) else None, "token": t} for t, b in self.logit_bias
            ]
        p |= {"n_probs": self.n_probs, "min_keep": 0}
        if full:
            p |= {
                "grammar": self.grammar,
                "grammar_lazy": False,
                "grammar_triggers": [],
                "preserved_tokens": [],
            }
        p |= {
            "chat_format": "Content-only",
            "reasoning_format": "deepseek" if full else "none",
            "reasoning_in_content": False,
            "generation_prompt": "",
            "samplers": list(self.samplers),
            "speculative.types": self.speculative.type if self.speculative else "none",
            "timings_per_token": self.timings_per_token,
            "post_sampling_probs": False,
            "backend_sampling": False,
            "lora": [{"id": i, "scale": f32(s)} for i, s in self.lora],
        }
        return p


def _samplers(value: Any) -> tuple[str, ...]:
    """`samplers` as names (or a string of their letters), in an order slotwise's chain has."""
    if isinstance(value, str):
        names = [_SAMPLER_CHARS.get(c) for c in value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        names = [_SAMPLER_NAMES.get(v) for v in value]
    else:
        raise bad("Field 'samplers': give an array of sampler names (or a string of letters)")
    chosen = tuple(n for n in names if n is not None)  # (llama-server skips unknown names)
    ours = [n for n in chosen if n in _CHAIN]
    if ours != [n for n in _CHAIN if n in ours]:
        raise bad(
            f"samplers: slotwise's sampler chain runs {', '.join(_CHAIN)} in this order; "
            f"{', '.join(ours)} is another order"
        )
    return chosen


def _logit_bias(value: Any, tokenized: dict[str, list[int]]) -> list[tuple[int, float]]:
    """[[token or text, bias or false], ...] or {"token or text": bias}; a text biases each of
    its tokens, as llama-server does in either form (tokenized: those texts, tokenized
    beforehand: bias_texts)."""
    if not isinstance(value, list | dict):
        raise bad("Field 'logit_bias': give [[token, bias], ...] or {\"token\": bias}")
    pairs: list[Any] = list(value.items()) if isinstance(value, dict) else value
    out: list[tuple[int, float]] = []
    for pair in pairs:
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise bad("logit_bias: each entry is a pair [token, bias]")
        who, bias = pair
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad("logit_bias: a bias is a number, or false")
        if isinstance(who, int) and not isinstance(who, bool):
            ids = [who]
        elif isinstance(who, str) and _is_id(who) and isinstance(value, dict):
            ids = [int(who) if len(who) < 20 else 1 << 63]  # (past int64: none either way)
        elif isinstance(who, str):
            ids = tokenized[who]
        else:
            raise bad("logit_bias: a token is an id or a text")
        if any(not 0 <= t < 1 << 31 for t in ids):
            raise bad(f"logit_bias: {who} is not a token id")
        out += [(t, number(bias, "logit_bias")) for t in ids]
    return out


def _is_id(key: str) -> bool:
    """An object form's key that is a token id (the rest are texts, tokenized)."""
    return re.fullmatch(r"-?[0-9]+", key) is not None


def bias_texts(value: Any) -> list[str]:
    """The texts a logit_bias names, in either form, to be tokenized before settings_of."""
    if isinstance(value, dict):
        return [k for k in value if not _is_id(k)]
    pairs = value if isinstance(value, list) else []
    return [p[0] for p in pairs if isinstance(p, list) and p and isinstance(p[0], str)]


def lora_of(value: Any) -> list[tuple[int, float]]:
    """`lora`: [{"id": 0, "scale": 0.7}, ...] (the adapters not listed at 0; none: the server's
    scales), as llama-server reads it, each entry's fields of their types."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("Field 'lora': Error: 'lora' must be an array of objects with 'id' and "
                  "'scale' fields")  # fmt: skip
    out = []
    for entry in value:
        if not isinstance(entry, dict):
            raise bad("lora: each entry is an object with 'id' and 'scale' fields")
        i = get(entry, "id", "integer", -1)
        if i < 0:
            raise bad("lora: each entry names an adapter by its 'id' (GET /lora-adapters)")
        out.append((i, get(entry, "scale", "number", 0.0)))
    return sorted(dict(out).items())  # (by id, the last of an id's entries: llama-server's map)


def n_cmpl_of(body: dict[str, Any]) -> int:
    """The completions each prompt asks for (read before any prompt is: they are bounded
    together)."""
    n = get(body, "n_cmpl", "integer", get(body, "n", "integer", 1))
    if not 1 <= n <= MAX_N:
        raise bad(f"n_cmpl: 1 to {MAX_N} completions")
    return int(n)


def settings_of(
    body: dict[str, Any], tokenized: dict[str, list[int]], defaults: Settings | None = None
) -> Settings:
    """A /completion body's options, with llama-server's defaults (or the server's: its
    --temp and --seed); refused by name when slotwise cannot honour them."""
    for name, neutral in _ABSENT_SAMPLERS.items():
        value = get(body, name, "number", neutral)
        if value != neutral and not (name == "top_n_sigma" and value <= 0):
            raise bad(
                f"{name} is not supported here: slotwise's sampler chain is penalties, top_k, "
                f"top_p, min_p and temperature (leave {name} at {neutral})"
            )
    if (
        get(body, "xtc_probability", "number", 0.0)
        and get(body, "xtc_threshold", "number", 0.1) <= 0.5
    ):
        raise bad("xtc_probability is not supported here: slotwise has no XTC sampler")
    if get(body, "post_sampling_probs", "boolean", False):
        raise bad(
            "post_sampling_probs is not supported here: slotwise gives the model's own "
            "probabilities (n_probs), before the sampler chain"
        )
    if get(body, "min_keep", "integer", 0) > 1:
        raise bad("min_keep above 1 is not supported here")
    s = copy.deepcopy(defaults) if defaults is not None else Settings()
    n_predict = get(body, "n_predict", "integer", get(body, "max_tokens", "integer", -1))
    s.n_predict = n_predict if n_predict >= 0 else -1
    if s.n_predict > MAX_TOKENS:
        raise bad(f"n_predict: at most {MAX_TOKENS}")
    s.temperature = get(body, "temperature", "number", s.temperature)
    s.top_k = get(body, "top_k", "integer", s.top_k)
    s.top_p = get(body, "top_p", "number", s.top_p)
    s.min_p = get(body, "min_p", "number", s.min_p)
    s.repeat_last_n = get(body, "repeat_last_n", "integer", s.repeat_last_n)
    s.repeat_penalty = get(body, "repeat_penalty", "number", s.repeat_penalty)
    s.presence_penalty = get(body, "presence_penalty", "number", s.presence_penalty)
    s.frequency_penalty = get(body, "frequency_penalty", "number", s.frequency_penalty)
    seed = get(body, "seed", "integer", -1, bits=64)
    if seed != -1 or defaults is None:
        s.seed = RANDOM_SEED if seed in (-1, RANDOM_SEED) else seed & 0xFFFFFFFF
    stop = get(body, "stop", "array", [])
    if not all(isinstance(x, str) for x in stop):
        raise bad("Field 'stop': type must be array of strings")
    s.stop = [x for x in stop if x]
    s.n_keep = get(body, "n_keep", "integer", 0)
    s.ignore_eos = get(body, "ignore_eos", "boolean", False)
    s.stream = get(body, "stream", "boolean", False)
    s.n_probs = get(body, "n_probs", "integer", 0)
    if not 0 <= s.n_probs <= MAX_TOP_LOGPROBS:
        raise bad(f"n_probs: slotwise gives at most the {MAX_TOP_LOGPROBS} most likely tokens")
    s.grammar = get(body, "grammar", "string", "")
    s.json_schema = body.get("json_schema")
    if s.json_schema is not None and not isinstance(s.json_schema, dict):
        raise bad("Field 'json_schema': type must be object")
    if "samplers" in body and body["samplers"] is not None:
        s.samplers = _samplers(body["samplers"])
    s.timings_per_token = get(body, "timings_per_token", "boolean", False)
    s.return_progress = get(body, "return_progress", "boolean", False)
    s.return_tokens = get(body, "return_tokens", "boolean", False)
    s.cache_prompt = get(body, "cache_prompt", "boolean", True)
    s.id_slot = get(body, "id_slot", "integer", -1)
    s.n_cmpl = n_cmpl_of(body)
    s.response_fields = get(body, "response_fields", "array", [])
    if "logit_bias" in body and body["logit_bias"] is not None:
        s.logit_bias = _logit_bias(body["logit_bias"], tokenized)
    s.speculative = speculative_of(body.get("speculative"), body)
    s.lora = lora_of(body.get("lora"))
    try:
        s.slotwise = SlotwiseOptions.model_validate(body.get("slotwise") or {})
    except ValidationError as e:
        raise invalid(e.errors(), "slotwise") from None
    return s
