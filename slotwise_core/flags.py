"""A service's command-line options, defined once: its own parser and `slotwise serve` are
built from the same definitions, and read back into the same settings (stdlib only)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    flag: str  # "--ctx-size"
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # add_argument's

    @property
    def name(self) -> str:  # "ctx_size": its key in the settings
        return self.flag.removeprefix("--").replace("-", "_")


def positive_int(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


def option(flag: str, **kwargs: Any) -> Option:
    return Option(flag, kwargs)


def add_options(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    options: Iterable[Option],
    *,
    prefix: str = "",
    rename: Mapping[str, str] | None = None,
) -> None:
    """Add options to a parser; prefix keeps two services' settings apart in one namespace,
    rename gives an option another flag there (`--threads` -> `--prep-threads`)."""
    for o in options:
        kwargs = dict(o.kwargs)
        if prefix and not {"metavar", "action", "choices"} & set(kwargs):
            kwargs["metavar"] = o.name.upper()  # (not the prefixed name)
        p.add_argument((rename or {}).get(o.flag, o.flag), dest=prefix + o.name, **kwargs)


def settings(args: argparse.Namespace, options: Iterable[Option], *, prefix: str = "") -> dict:
    """The options' values as parsed, by name."""
    return {o.name: getattr(args, prefix + o.name) for o in options}


def defaults(options: Iterable[Option], **given: Any) -> dict[str, Any]:
    """The settings a parser gives when no flag is passed (`given` instead, by name)."""
    out = {o.name: o.kwargs.get("default", False if o.kwargs.get("action") else None)
           for o in options}  # fmt: skip
    unknown = set(given) - set(out)
    if unknown:
        raise TypeError(f"no such options: {sorted(unknown)}")
    return {**out, **given}
