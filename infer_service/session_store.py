"""Sessions on disk: one file per session, replaced atomically after every completed turn.

Layout of ROOT:
  <session_id>.session    magic, header length, JSON header, then the KV state bytes
  media/<media_id>.rgb    raw RGB pixels, content-addressed, written once

The header holds the format version, the model fingerprint, the context configuration the KV
state was saved from (a state only loads into a context with the same stream layout), the
ledger's segments and the session's options. The KV state is an optimisation: a session whose
state does not load is rebuilt by re-prefilling its ledger from token ids and saved pixels.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
_MAGIC = b"SLOTWISE-SESSION"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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


@dataclass
class SavedSession:
    header: dict[str, Any]
    kv_state: bytes


class SessionStore:
    def __init__(self, root: Path):
        self.root = root
        (root / "media").mkdir(parents=True, exist_ok=True)

    def path(self, session_id: str) -> Path:
        return self.root / f"{check_session_id(session_id)}.session"

    def ids(self) -> list[str]:
        return sorted(p.name.removesuffix(".session") for p in self.root.glob("*.session"))

    def save(self, session_id: str, header: dict[str, Any], kv_state: bytes) -> None:
        body = json.dumps({"version": FORMAT_VERSION, **header}).encode()
        target = self.path(session_id)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(body)) + body + kv_state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)  # a crash leaves the previous complete turn, never half of one

    def load(self, session_id: str) -> SavedSession:
        try:
            data = self.path(session_id).read_bytes()
        except FileNotFoundError:
            raise KeyError(session_id) from None
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 8:
            raise CorruptSessionError(f"session {session_id!r}: not a slotwise session file")
        (n,) = struct.unpack_from("<Q", data, len(_MAGIC))
        start = len(_MAGIC) + 8
        if start + n > len(data):
            raise CorruptSessionError(f"session {session_id!r}: file is truncated")
        try:
            header = json.loads(data[start : start + n])
        except ValueError as e:
            raise CorruptSessionError(f"session {session_id!r}: unreadable header ({e})") from None
        version = header.get("version") if isinstance(header, dict) else None
        if version != FORMAT_VERSION:
            raise CorruptSessionError(
                f"session {session_id!r}: format version {version} is not {FORMAT_VERSION}"
            )
        return SavedSession(header, data[start + n :])

    def delete(self, session_id: str) -> bool:
        try:
            self.path(session_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def save_media(self, media_id: str, rgb: bytes) -> None:
        target = self.root / "media" / f"{check_session_id(media_id)}.rgb"
        if target.exists():
            return
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(rgb)
        os.replace(tmp, target)

    def delete_media(self, media_id: str) -> None:
        (self.root / "media" / f"{check_session_id(media_id)}.rgb").unlink(missing_ok=True)

    def load_media(self, media_id: str) -> bytes:
        try:
            return (self.root / "media" / f"{check_session_id(media_id)}.rgb").read_bytes()
        except FileNotFoundError:
            raise CorruptSessionError(f"pixels of media {media_id[:12]} are missing") from None
