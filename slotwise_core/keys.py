"""The keys file: who a caller is.

One key per line, `TENANT KEY`; a line with only `KEY` is tenant `default` (a token file of
one line stays what it was). `TENANT KEY models=a,b` lets that key use only those models of a
router (`slotwise serve --models-dir`; every model when not said; the services ignore it).
A key may be written as `sha256:HEX`, its SHA-256 in hex, so the
file need not hold it in clear. A line starting with `#` is a comment. Every service and the
HTTP edge read the same file; SIGHUP re-reads it (a key added or revoked without a restart;
calls in flight finish).

A presented key is hashed once and compared with every stored digest in constant time, with
no early exit: how long the check takes says nothing of which key, or how much of one, matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("slotwise.keys")

DEFAULT_TENANT = "default"
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_HEX = re.compile(r"sha256:([0-9a-fA-F]{64})")


class KeysError(ValueError):
    """A keys file that cannot be used (the line and why)."""


@dataclass(frozen=True)
class Key:
    tenant: str
    digest: bytes  # SHA-256 of the key
    models: frozenset[str] | None = None  # a router's models it may use (None: all)


def parse(text: str, source: str = "keys file") -> tuple[Key, ...]:
    keys: list[Key] = []
    seen: set[bytes] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):  # (a whole line: a key may hold a '#')
            continue
        fields = line.split()
        models = None
        if len(fields) == 3 and fields[2].startswith("models="):
            models = frozenset(m for m in fields.pop()[len("models=") :].split(",") if m)
        if len(fields) > 2:
            raise KeysError(f"{source} line {n}: `TENANT KEY [models=A,B]` or `KEY`, got "
                            f"{len(fields)} fields")  # fmt: skip
        tenant, secret = fields if len(fields) == 2 else (DEFAULT_TENANT, fields[0])
        if not TENANT.fullmatch(tenant):
            raise KeysError(f"{source} line {n}: tenant {tenant!r}: 1-64 of [A-Za-z0-9_-]")
        hashed = _HEX.fullmatch(secret)
        digest = bytes.fromhex(hashed.group(1)) if hashed else _digest(secret)
        if digest in seen:
            raise KeysError(f"{source} line {n}: a key given twice")
        seen.add(digest)
        keys.append(Key(tenant, digest, models))
    if not keys:
        raise KeysError(f"{source} holds no key")
    return tuple(keys)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class Keys:
    """A keys file, read at start and again on `reload` (SIGHUP)."""

    def __init__(self, path: Path | None = None, *, text: str | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._keys = parse(text if text is not None else self._read(), str(path or "keys"))

    def _read(self) -> str:
        if self.path is None:
            raise KeysError("no keys file")
        try:
            return self.path.read_text()
        except OSError as e:
            raise KeysError(f"cannot read {self.path}: {e.strerror or e}") from None

    @property
    def tenants(self) -> set[str]:
        return {k.tenant for k in self._keys}

    def tenant_of(self, secret: str | None) -> str | None:
        """The tenant whose key this is, or None."""
        key = self.key_of(secret)
        return key.tenant if key is not None else None

    def key_of(self, secret: str | None) -> Key | None:
        """The key this secret is (its tenant, its models), or None."""
        if not secret:
            return None
        digest = _digest(secret)
        found = None
        for key in self._keys:  # every one, whatever matched: constant time
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def reload(self) -> bool:
        """Re-read the file; a file that cannot be used keeps the keys as they were."""
        try:
            keys = parse(self._read(), str(self.path))
        except KeysError as e:
            log.error("keys not reloaded (the old ones stay): %s", e)
            return False
        with self._lock:
            self._keys = keys
        log.info("keys reloaded from %s: %d keys, tenants %s", self.path, len(keys),
                 sorted({k.tenant for k in keys}))  # fmt: skip
        return True


def callers(keys: Keys | None, token: str | None) -> Keys | None:
    """Who may call: the keys file, else one token (tenant default), else anyone (None)."""
    if keys is not None:
        return keys
    return Keys(text=token) if token else None


def bearer(authorization: str) -> str | None:
    """The key an `authorization: Bearer KEY` header presents (None for another scheme)."""
    if not authorization.startswith("Bearer "):
        return None
    return authorization.removeprefix("Bearer ").strip()


_WATCHED: list[Keys] = []


def reload_on_sighup(keys: Keys) -> None:
    """SIGHUP re-reads these keys (and every other Keys of this process that asked): one
    handler for the process, whichever part (a service, the HTTP edge) installed it last.
    Keys given as text (no file) have nothing to re-read."""
    if keys.path is None:
        return
    if all(k is not keys for k in _WATCHED):
        _WATCHED.append(keys)

    def reload_all() -> None:
        for k in _WATCHED:
            k.reload()

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_all)
    except RuntimeError:  # a loop off the main thread (embedded, tests): reload() by hand
        log.debug("SIGHUP cannot be handled on this thread's loop")
