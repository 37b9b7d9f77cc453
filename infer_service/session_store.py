"""Sessions on disk: one file per session, replaced atomically after every completed turn.

Layout of ROOT:
  <session_id>.session    magic, header length, JSON header, then the KV state bytes
  media/<media_id>.rgb    raw RGB pixels, content-addressed, written once
  .tmp-*                  a write in progress (removed at startup: none can be in progress)

The header holds the format version, the model fingerprint, the context configuration the KV
state was saved from (a state only loads into a context with the same stream layout), the
ledger's segments, a digest of them (the KV bytes belong to that ledger and no other) and the
session's options. The KV state is an optimisation: a session whose state does not load, or
belongs to another ledger, is rebuilt by re-prefilling its ledger from token ids and pixels.

Every write goes to a fresh temporary file (mkstemp), is fsynced, renamed over the target and
the directory fsynced, so a crash or a full disk leaves the previous complete file, never half.
Pixels are hashed again when they are read: a damaged file is never encoded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotwise_core.images import media_id as pixels_id

FORMAT_VERSION = 1
_MAGIC = b"SLOTWISE-SESSION"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PREFIX = len(_MAGIC) + 8
_MAX_HEADER_BYTES = 256 << 20


class SessionIdError(ValueError):
    """An id that could escape the directory or is too long."""


class CorruptSessionError(ValueError):
    """A session file that cannot be read."""


def check_session_id(session_id: str) -> str:
    if not _ID.fullmatch(session_id) or ".." in session_id:
        raise SessionIdError(
            f"invalid session id {session_id[:80]!r}: use 1-64 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return session_id


def ledger_digest(ledger_json: Sequence[dict[str, Any]]) -> str:
    """What a KV state is checked against before it is loaded for a ledger."""
    body = json.dumps(ledger_json, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


@dataclass
class SavedSession:
    header: dict[str, Any]
    kv_state: bytes


class SessionStore:
    def __init__(self, root: Path):
        self.root = root
        (root / "media").mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(".tmp-*"), *(root / "media").glob(".tmp-*")]:
            stale.unlink(missing_ok=True)  # a write that a crash interrupted

    def path(self, session_id: str) -> Path:
        return self.root / f"{check_session_id(session_id)}.session"

    def ids(self) -> list[str]:
        return sorted(p.name.removesuffix(".session") for p in self.root.glob("*.session"))

    def save(
        self, session_id: str, header: dict[str, Any], kv_state: bytes | bytearray | memoryview
    ) -> None:
        body = json.dumps({"version": FORMAT_VERSION, **header}).encode()
        _write_atomically(
            self.path(session_id), _MAGIC + struct.pack("<Q", len(body)) + body, kv_state
        )

    def load_header(self, session_id: str) -> dict[str, Any]:
        """The header alone (startup reads no KV bytes)."""
        try:
            with open(self.path(session_id), "rb") as f:
                header, _ = _read_header(session_id, f)
        except FileNotFoundError:
            raise KeyError(session_id) from None
        return header

    def load(self, session_id: str) -> SavedSession:
        try:
            with open(self.path(session_id), "rb") as f:
                header, _ = _read_header(session_id, f)
                return SavedSession(header, f.read())
        except FileNotFoundError:
            raise KeyError(session_id) from None

    def delete(self, session_id: str) -> bool:
        try:
            self.path(session_id).unlink()
        except FileNotFoundError:
            return False
        _fsync_dir(self.root)
        return True

    def _media_path(self, media_id: str) -> Path:
        return self.root / "media" / f"{check_session_id(media_id)}.rgb"

    def has_media(self, media_id: str) -> bool:
        return self._media_path(media_id).exists()

    def save_media(self, media_id: str, rgb: bytes) -> None:
        target = self._media_path(media_id)
        if not target.exists():
            _write_atomically(target, b"", rgb)

    def delete_media(self, media_id: str) -> None:
        self._media_path(media_id).unlink(missing_ok=True)

    def load_media(self, media_id: str, width: int, height: int) -> bytes:
        """The pixels whose hash is media_id (CorruptSessionError if missing or damaged)."""
        try:
            rgb = self._media_path(media_id).read_bytes()
        except FileNotFoundError:
            raise CorruptSessionError(f"pixels of media {media_id[:12]} are missing") from None
        if pixels_id(width, height, rgb) != media_id:
            raise CorruptSessionError(f"pixels of media {media_id[:12]} are damaged")
        return rgb


def _read_header(session_id: str, f: Any) -> tuple[dict[str, Any], int]:
    prefix = f.read(_PREFIX)
    if len(prefix) < _PREFIX or not prefix.startswith(_MAGIC):
        raise CorruptSessionError(f"session {session_id!r}: not a slotwise session file")
    (n,) = struct.unpack_from("<Q", prefix, len(_MAGIC))
    body = f.read(min(n, _MAX_HEADER_BYTES))
    if len(body) < n:
        raise CorruptSessionError(f"session {session_id!r}: file is truncated")
    try:
        header = json.loads(body)
    except ValueError as e:
        raise CorruptSessionError(f"session {session_id!r}: unreadable header ({e})") from None
    version = header.get("version") if isinstance(header, dict) else None
    if version != FORMAT_VERSION:
        raise CorruptSessionError(
            f"session {session_id!r}: format version {version} is not {FORMAT_VERSION}"
        )
    return header, _PREFIX + n


def _write_atomically(target: Path, head: bytes, body: bytes | bytearray | memoryview) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk leaves no partial file behind
        raise
    _fsync_dir(target.parent)  # the rename itself survives a power cut


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
