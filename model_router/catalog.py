"""The models a router serves, as llama-server's router finds them: a folder (`--models-dir`:
a GGUF file is a model named by its stem; a folder holds a model and its projector, whose name
starts with `mmproj`) and a preset (`--models-preset`: llama-server's INI, `[*]` for every
model, a section per model, keys as long or short flags or LLAMA_ARG_* names).

Pure: reading files and text, no process, no network. A key is read as slotwise serve's own
flag when it has one by that name, else as llama-server's (slotwise_core/llama_flags.py); a key
neither knows is refused when the preset is read, naming the section and the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from slotwise_core.llama_flags import SWITCHES, FlagError, translate

__all__ = ["Catalog", "CatalogError", "ModelEntry", "from_dir", "parse_preset", "read_catalog"]

DEFAULT_STOP_TIMEOUT = 10.0  # llama-server's: seconds an unload waits before it kills
# keys that say which files and names a model has, or how the router treats it (not flags)
_FILES = {"model": "model", "m": "model", "mmproj": "mmproj", "mm": "mmproj"}
_ALIAS = ("alias", "a")
# the router sets these for each model's process, over whatever a preset says (as llama-server)
_ROUTER_SET = ("host", "port", "http-port", "prep-port", "infer-port", "api-key",
               "api-key-file", "token-file", "model-name", "sessions-dir")  # fmt: skip
_HUB = ("hf-repo", "hf", "hf-file", "hff", "model-url", "mu", "spec-draft-hf", "hf-repo-draft")
_TRUE = ("1", "true", "on", "yes", "enabled")  # (llama.cpp's words, and the usual ones)
_FALSE = ("0", "false", "off", "no", "disabled")
_INLINE_COMMENT = re.compile(r"\s+[;#].*$")
# LLAMA_ARG_* names that are not their flag's long name in capitals
# (read off the vendored common/arg.cpp; issue 52 generates the whole table)
_ENV_FLAG = {
    "N_PARALLEL": "parallel", "N_PREDICT": "n-predict", "N_GPU_LAYERS": "n-gpu-layers",
    "BATCH": "batch-size", "UBATCH": "ubatch-size", "ENDPOINT_METRICS": "metrics",
    "ENDPOINT_SLOTS": "slots", "THINK": "reasoning-format", "TEMPERATURE": "temp",
    "CONT_BATCHING": "cont-batching",
}  # fmt: skip


class CatalogError(ValueError):
    """A folder or preset the router cannot serve: the message names the file and the key."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    model: Path | None = None  # None: no local file (a hub repository): listed, never loaded
    mmproj: Path | None = None
    args: tuple[str, ...] = ()  # slotwise serve's flags of this model, `[*]` then its section
    aliases: tuple[str, ...] = ()
    load_on_startup: bool = False
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    source: str = "models_dir"  # or "preset"
    preset: str = ""  # its section as read (GET /models shows it)

    @property
    def problem(self) -> str | None:
        """Why it can never load, or None."""
        if self.model is None:
            return f"{self.name}: no local model file (slotwise downloads nothing: set `model`)"
        return None

    def command(self) -> list[str]:
        files = ["--model", str(self.model)] if self.model else []
        return [*files, *(["--mmproj", str(self.mmproj)] if self.mmproj else []), *self.args]


@dataclass(frozen=True)
class Catalog:
    entries: tuple[ModelEntry, ...] = ()
    names: Mapping[str, ModelEntry] = field(default_factory=dict)  # names and aliases

    @classmethod
    def of(cls, entries: Iterable[ModelEntry]) -> Catalog:
        names: dict[str, ModelEntry] = {}
        listed = tuple(entries)
        for e in listed:
            for n in (e.name, *e.aliases):
                if n in names and names[n] is not e:
                    raise CatalogError(
                        f"the name {n!r} is both {names[n].name!r}'s and {e.name!r}'s"
                    )
                names[n] = e
        return cls(listed, names)

    def find(self, name: str) -> ModelEntry | None:
        return self.names.get(name)


def from_dir(folder: Path) -> list[ModelEntry]:
    """A models folder as llama-server reads it: `NAME.gguf`, or `NAME/` with one model file
    (or a split's first part) and maybe an `mmproj*.gguf`."""
    if not folder.is_dir():
        raise CatalogError(f"--models-dir {folder}: not a folder")
    entries = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix == ".gguf" and "mmproj" not in path.name:
            entries.append(ModelEntry(path.stem, path))
        elif path.is_dir():
            ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
            projectors = [p for p in ggufs if "mmproj" in p.name]
            models = [p for p in ggufs if "mmproj" not in p.name and not _is_draft(p.name)]
            first = [p for p in models if "-00001-of-" in p.name] or models
            if first:
                entries.append(
                    ModelEntry(path.name, first[0], projectors[0] if projectors else None)
                )
    return entries


def _is_draft(name: str) -> bool:
    return name.startswith(("mtp-", "dspark-", "dflash-"))


def parse_preset(
    text: str, source: str = "preset"
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The INI's `[*]` section and the others, in order: {key: value}. Keys before the first
    section (`version`) are the file's own and dropped."""
    star: dict[str, str] = {}
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith((";", "#")):
            continue
        line = _INLINE_COMMENT.sub("", line)  # (`c = 4096 ; why`, `[m] # note`)
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1].strip()
            if not name:
                raise CatalogError(f"{source}:{number}: a section with no name")
            current = star if name == "*" else sections.setdefault(name, {})
            continue
        key, eq, value = line.partition("=")
        if not eq:
            raise CatalogError(f"{source}:{number}: expected `key = value`, got {line!r}")
        if current is not None:
            current[key.strip()] = value.strip()
    return star, sections


def read_catalog(
    models_dir: Path | None,
    preset: Path | None,
    is_switch: Callable[[str], bool | None],
) -> Catalog:
    """The folder's models and the preset's, the preset's options over a model of the folder
    by the same name. is_switch(flag): whether slotwise serve's flag takes no value (None: it
    has no such flag)."""
    found = {e.name: e for e in (from_dir(models_dir) if models_dir else [])}
    if preset is not None:
        try:
            text = preset.read_text()
        except OSError as e:
            raise CatalogError(f"--models-preset {preset}: {e.strerror or e}") from e
        star, sections = parse_preset(text, str(preset))
        for name, options in sections.items():
            found[name] = _preset_entry(name, {**star, **options}, found.get(name), is_switch)
    return Catalog.of(found.values())


def _preset_entry(
    name: str,
    options: Mapping[str, str],
    known: ModelEntry | None,
    is_switch: Callable[[str], bool | None],
) -> ModelEntry:
    entry = known or ModelEntry(name, source="preset")
    where = f"[{name}]"
    args: list[str] = []
    for raw_key, value in options.items():
        key = _key(raw_key)
        if _FILES.get(key) == "model":
            entry = replace(entry, model=_path(value))
        elif _FILES.get(key) == "mmproj":
            entry = replace(entry, mmproj=_path(value))
        elif key in _ALIAS:
            entry = replace(entry, aliases=tuple(a.strip() for a in value.split(",") if a.strip()))
        elif key == "load-on-startup":
            entry = replace(entry, load_on_startup=_bool(value, where, key))
        elif key == "stop-timeout":
            entry = replace(entry, stop_timeout=_seconds(value, where, key))
        elif key in _HUB or key == "dedup-cache-models" or key in _ROUTER_SET:
            continue  # (a hub's: listed without a file, ModelEntry.problem says so)
        else:
            args += _slotwise_args(_as_flag(key, value, where, is_switch), where, is_switch)
    preset_text = "\n".join(f"{k} = {v}" for k, v in options.items())
    return replace(entry, args=(*entry.args, *args), source="preset", preset=preset_text)


def _key(raw: str) -> str:
    """A key as a flag's name: `ctx-size`, `c`, or LLAMA_ARG_CTX_SIZE."""
    if raw.startswith("LLAMA_ARG_"):
        rest = raw.removeprefix("LLAMA_ARG_")
        return _ENV_FLAG.get(rest, rest.lower().replace("_", "-"))
    return raw.strip().lstrip("-")


def _as_flag(
    key: str, value: str, where: str, is_switch: Callable[[str], bool | None]
) -> list[str]:
    """`key = value` as a command line's words: long flags `--key`, one-letter and
    llama-server's short ones `-key`; a switch's value true or false."""
    flag = f"--{key}" if is_switch(f"--{key}") is not None or len(key) > 3 else f"-{key}"
    lowered = value.lower()
    if is_switch(flag) or flag in SWITCHES:
        if lowered not in _TRUE + _FALSE:
            raise CatalogError(f"{where} {key}: a switch, expected true or false, got {value!r}")
        if lowered in _TRUE:
            return [flag]
        negated = f"--no-{key}"
        return [negated] if is_switch(negated) is not None or negated in SWITCHES else []
    if not value:
        raise CatalogError(f"{where} {key}: no value")
    return [flag, value]


def _slotwise_args(
    group: Sequence[str], where: str, is_switch: Callable[[str], bool | None]
) -> list[str]:
    """One key's words: slotwise serve's own flag as it is; llama-server's translated."""
    if not group or is_switch(group[0]) is not None:
        return list(group)
    try:
        translated, extra = translate(group, lambda _note: None)
    except FlagError as e:
        raise CatalogError(f"{where} {e}") from e
    if extra:
        raise CatalogError(f"{where} {group[0]}: the router's own (set it on its command line)")
    return translated


def _path(value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (Path.cwd() / p)  # (llama-server: relative to its CWD)


def _bool(value: str, where: str, key: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise CatalogError(f"{where} {key}: expected true or false, got {value!r}")


def _seconds(value: str, where: str, key: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise CatalogError(f"{where} {key}: expected seconds between 0 and 3600, got {value!r}")
    return seconds
