"""What a turn changed in a session's header, as a delta whose size is the turn's, not the
conversation's (pure: no llama.cpp, no I/O).

A header is JSON: the ledger's segments, pixels, turn records and a few scalars. Between two
turns the ledger keeps a prefix, may drop segments (a shift) and move the rest by a position
offset, and appends the turn's own segments; records drop the oldest and append the newest.
`diff(old, new)` says that in those terms; `apply(old, diff(old, new)) == new` for any two
headers (other changes are carried whole).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Header = Mapping[str, Any]

# a checkpoint's own keys (they name the KV bytes, which a delta never carries), and what the
# store adds when it reads a session
CHECKPOINT_KEYS = frozenset(
    {"kv_digest", "kv_lora", "layout", "version", "generation", "lineage", "journal"}
)


def diff(old: Header, new: Header) -> dict[str, Any]:
    """The delta from old to new: per changed key, how to make its new value."""
    out: dict[str, Any] = {}
    for key, value in new.items():
        if key in CHECKPOINT_KEYS or (key in old and old[key] == value):
            continue
        before = old.get(key)
        if key == "ledger" and isinstance(before, list):
            out[key] = {"segments": segments_diff(before, value)}
        elif key == "records" and isinstance(before, list):
            out[key] = {"records": records_diff(before, value)}
        elif key == "pixels" and isinstance(before, dict):
            gone = [k for k in before if k not in value]
            changed = {k: v for k, v in value.items() if before.get(k) != v}
            out[key] = {"pixels": {"set": changed, "del": gone}}
        else:
            out[key] = {"value": value}
    gone_keys = [k for k in old if k not in new and k not in CHECKPOINT_KEYS]
    if gone_keys:
        out["-"] = gone_keys
    return out


def apply(old: Header, delta: Mapping[str, Any]) -> dict[str, Any]:
    """old with delta applied (a new dict: old is not changed). ValueError on a delta that
    does not fit old (it was made from another header)."""
    new = dict(old)
    for key in delta.get("-", ()):
        new.pop(key, None)
    for key, op in delta.items():
        if key == "-":
            continue
        if "value" in op:
            new[key] = op["value"]
        elif "segments" in op:
            new[key] = segments_apply(old[key], op["segments"])
        elif "records" in op:
            new[key] = records_apply(old[key], op["records"])
        elif "pixels" in op:
            pixels = {k: v for k, v in old[key].items() if k not in set(op["pixels"]["del"])}
            new[key] = {**pixels, **op["pixels"]["set"]}
        else:
            raise ValueError(f"unknown delta for {key!r}")
    return new


def _same_but_pos(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(k == "pos" or b[k] == v for k, v in a.items())


def segments_diff(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list:
    """Ops that make new from old: [i, j, dpos] takes old[i:j] with "pos" moved by dpos, a
    dict {"add": [...]} puts new segments. Old segments are only dropped, never reordered, so
    one forward walk finds them."""
    ops: list[Any] = []
    i = 0
    for seg in new:
        j = next((j for j in range(i, len(old)) if _same_but_pos(old[j], seg)), None)
        if j is None:
            if ops and isinstance(ops[-1], dict):
                ops[-1]["add"].append(seg)
            else:
                ops.append({"add": [seg]})
            continue
        dpos = seg["pos"] - old[j]["pos"]
        last = ops[-1] if ops else None
        if isinstance(last, list) and last[1] == j and last[2] == dpos:
            last[1] = j + 1
        else:
            ops.append([j, j + 1, dpos])
        i = j + 1
    return ops


def segments_apply(old: Sequence[Mapping[str, Any]], ops: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for op in ops:
        if isinstance(op, dict):
            out.extend(dict(s) for s in op["add"])
            continue
        i, j, dpos = (int(x) for x in op)
        if not 0 <= i < j <= len(old):
            raise ValueError(f"a delta takes segments {i}:{j} of {len(old)}")
        out.extend({**s, "pos": s["pos"] + dpos} for s in old[i:j])
    return out


def records_diff(old: Sequence[Any], new: Sequence[Any]) -> dict[str, Any]:
    """{"drop": n, "add": [...]}: new is old without its first n, then the added ones."""
    for drop in range(len(old) + 1):
        kept = len(old) - drop
        if list(old[drop:]) == list(new[:kept]):
            return {"drop": drop, "add": list(new[kept:])}
    raise AssertionError("unreachable: dropping all of old always fits")  # pragma: no cover


def records_apply(old: Sequence[Any], op: Mapping[str, Any]) -> list[Any]:
    drop = int(op["drop"])
    if not 0 <= drop <= len(old):
        raise ValueError(f"a delta drops {drop} of {len(old)} records")
    return [*old[drop:], *op["add"]]
