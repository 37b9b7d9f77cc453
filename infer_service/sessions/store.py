"""Sessions on disk: per session a checkpoint (header and KV state, replaced atomically) and
a journal of what each completed turn changed since (appended and fsynced per turn).

Layout of ROOT (which several replicas may share: a volume on NFSv4, EFS, CephFS, ...):
  <session_id>.session    magic, header length, generation, lineage, JSON header, KV state
  <session_id>.turns      entries after that checkpoint: magic, length, crc32, generation, a
                          JSON delta of the header (infer_service/sessions/header_delta.py)
  media/<media_id>.rgb    raw RGB pixels (or a sound's bytes), content-addressed, written once
  .locks/<n>.lock         POSIX locks: per session (striped), and one for the pixels
  .tmp-*                  a write in progress (removed at startup once older than an hour)

Each write of a session (a checkpoint or a journal entry) raises its generation by one, under
the session's exclusive lock, and only if the generation on disk is the one the writer holds
(`expect`): a replica whose copy is stale (another replica wrote the session since) is
refused (StaleSessionError) and never writes over a newer file. A generation names its
lineage too, random for every session file created: a session deleted and created again
elsewhere never matches an old copy's number.
Session writes hold the pixels' lock shared, pixel collection exclusive: pixels are written
before the file that refers to them, and never deleted between. A lock is taken on a
descriptor of the lock file of its own, as an open file description lock (Linux): threads of
one process exclude each other as other processes do, and a session's slow write holds up no
other session's (only one sharing its lock file's stripe). Without OFD locks, POSIX record
locks, which belong to the process: its threads take each lock file's turns in memory first
(`_FileLock`).

The header holds the format version, the model fingerprint, the context configuration the KV
state was saved from (a state only loads into a context with the same stream layout), the
ledger's segments, a digest of them (the KV bytes belong to that ledger and no other) and the
session's options. The KV state is an optimisation: a session whose state does not load, or
belongs to another ledger, is rebuilt by re-prefilling its ledger from token ids and pixels.

Every checkpoint goes to a fresh temporary file (mkstemp), is fsynced, renamed over the target
and the directory fsynced, so a crash or a full disk leaves the previous complete file, never
half; the journal is removed after it. A journal entry is appended and fsynced: a torn last
entry (a crash mid-append) fails its crc and is cut off by the next append. The session is the
checkpoint's header with every entry after it applied, entries of an older checkpoint (left by
a crash between the rename and the removal) skipped. A turn writes bytes in proportion to what
it added; the KV bytes are written when the session manager decides a checkpoint is due. A
journal of MAX_JOURNAL_ENTRIES is folded into its checkpoint by the store itself.
Pixels are hashed again when they are read: a damaged file is never encoded.

A session's files' last write (mtime) is its last use as other replicas see it: a turn touches
them as it begins (`touch`), and a checkpoint of the same state, which keeps the generation,
writes them. A replica that finds a session unused by its own account deletes it only if its
files still say so (`Unused`): its generation, and no write or touch since but its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from infer_service.events import CorruptSessionError
from infer_service.sessions import header_delta
from slotwise_core.descriptors import content_id

FORMAT_VERSION = 1
_MAGIC_V1 = b"SLOTWISE-SESSION"  # magic, u64 header length (generation 0)
_MAGIC = b"SLOTWISE-SESS-G2"  # magic, u64 header length, u64 generation, 16 bytes lineage
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# a session's key: its id, after `TENANT@` for every tenant but the default one
_KEY = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_-]{0,63}@)?[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PREFIX = len(_MAGIC) + 32
_ENTRY = struct.Struct("<4sIIQ")  # magic, body length, crc32 of the body, generation number
MAX_JOURNAL_ENTRIES = 256  # a journal this long is folded into its checkpoint
_READ_KEYS = ("version", "generation", "lineage", "journal")  # what a read adds to a header
_ENTRY_MAGIC = b"SWT1"
_MAX_HEADER_BYTES = 256 << 20
_LOCK_STRIPES = 256  # lock files for sessions: bounded, never deleted (a deleted lock file
# would let two writers lock two different files of one name)
_STALE_TMP_SECONDS = 3600.0  # another replica's write in progress is younger than this


class SessionIdError(ValueError):
    """An id that could escape the directory or is too long."""


class Generation(NamedTuple):
    """Which save of which session file: its lineage (created with the file) and number."""

    lineage: str  # hex; "" for files written before generations (number 0)
    number: int

    def next(self) -> Generation:
        return Generation(self.lineage, self.number + 1)


class Unused(NamedTuple):
    """What lets a deletion of a session nobody seems to use (expiry, eviction, a sweep) go
    ahead: the files must still say so when it runs, under the session's lock. A replica that
    takes a session into a turn touches its files (`touch`), and its writes that keep the
    generation (a checkpoint of the same state) write them, so neither alone says "unused"."""

    before: float  # files written or touched before this (time.time()) by anyone are unused
    # the generation the deleting replica holds: another one on disk was written since
    generation: Generation | None = None


class StaleSessionError(Exception):
    """The session on disk is not the generation the writer holds: another replica wrote it
    (or deleted it) since."""

    def __init__(self, session_id: str, expected: Generation | None, found: Generation | None):
        self.expected, self.found = expected, found
        on_disk = "no file" if found is None else f"generation {found.number}"
        held = "none" if expected is None else f"generation {expected.number}"
        if found and expected and found.lineage != expected.lineage:
            on_disk += " of a session created again"
        super().__init__(f"session {session_id!r}: {on_disk} on disk, this replica holds {held}")


def check_session_id(session_id: str) -> str:
    if not _ID.fullmatch(session_id) or ".." in session_id:
        raise SessionIdError(
            f"invalid session id {session_id[:80]!r}: use 1-64 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return session_id


def check_session_key(key: str) -> str:
    """A session's key (its id, in its tenant's namespace): what names its file."""
    if not _KEY.fullmatch(key) or ".." in key:
        raise SessionIdError(f"invalid session key {key[:140]!r}")
    return key


def ledger_digest(ledger_json: Sequence[dict[str, Any]]) -> str:
    """What a KV state is checked against before it is loaded for a ledger."""
    body = json.dumps(ledger_json, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


@dataclass
class SavedSession:
    header: dict[str, Any]  # the session now: the checkpoint's with the journal applied
    kv_state: bytes
    kv_ledger: list[dict[str, Any]]  # the ledger the KV state holds: the checkpoint's


@dataclass
class _Journal:
    entries: list[tuple[int, dict[str, Any]]]  # (generation number, delta), in order
    valid_bytes: int  # how much of the file they take (a torn tail comes after)
    size: int


class SessionStore:
    def __init__(self, root: Path):
        self.root = root
        (root / "media").mkdir(parents=True, exist_ok=True)
        (root / ".locks").mkdir(exist_ok=True)
        # per session file (inode, mtime, size): the media ids it refers to (pixel collection)
        self._referred: dict[str, tuple[tuple[int, ...], frozenset[str]]] = {}
        # per session, its files as this store last wrote or touched them (`_stamp`): still
        # so, nobody else has used the session since (each changed under the session's lock)
        self._seen: dict[str, tuple[int, ...]] = {}
        old = time.time() - _STALE_TMP_SECONDS
        for tmp in [*root.glob(".tmp-*"), *(root / "media").glob(".tmp-*")]:
            with contextlib.suppress(FileNotFoundError):
                if tmp.stat().st_mtime < old:
                    tmp.unlink()  # a write that a crash interrupted

    def path(self, session_id: str) -> Path:
        return self.root / f"{check_session_key(session_id)}.session"

    def ids(self) -> list[str]:
        return sorted(p.name.removesuffix(".session") for p in self.root.glob("*.session"))

    def save(
        self,
        session_id: str,
        header: dict[str, Any],
        kv_state: bytes | bytearray | memoryview,
        *,
        expect: Generation | None = None,
        pixels: Sequence[tuple[str, bytes]] = (),
        same_state: bool = False,
    ) -> Generation:
        """Write the session (its pixels first) as the generation after `expect`, the one the
        caller holds (None: no file may be there); returns the new generation. same_state: the
        header is the one on disk at `expect` (a checkpoint that only adds the KV state), so
        the generation stays: another replica that holds it may go on writing after it."""
        with self._session_lock(session_id), self._pixels_lock(shared=True):
            try:
                found = self.generation(session_id)
            except CorruptSessionError:  # damaged, never newer (writes are atomic): replaced
                found = expect
            if found != expect:
                raise StaleSessionError(session_id, expect, found)
            for media_id, rgb in pixels:
                self.save_media(media_id, rgb)
            if found is None:
                generation = Generation(os.urandom(16).hex(), 1)
            else:
                generation = found if same_state else found.next()
            self._put_checkpoint(session_id, header, kv_state, generation)
            self._saw(session_id)
        return generation

    def _put_checkpoint(
        self,
        session_id: str,
        header: dict[str, Any],
        kv_state: bytes | bytearray | memoryview,
        generation: Generation,
    ) -> None:
        body = json.dumps({"version": FORMAT_VERSION, **header}).encode()
        prefix = _MAGIC + struct.pack("<QQ", len(body), generation.number)
        head = prefix + bytes.fromhex(generation.lineage) + body
        _write_atomically(self.path(session_id), head, kv_state)
        self._journal_path(session_id).unlink(missing_ok=True)  # folded into the checkpoint

    def _fold(self, session_id: str, generation: Generation) -> None:
        """The journal into a checkpoint of the same state (the generation stays), keeping
        the KV bytes while the ledger is still theirs (else none: the next load re-prefills).
        Bounds a journal whose session never makes a checkpoint of its own (one that is not in
        a slot, renamed again and again, say)."""
        saved = self.load(session_id)
        header = {k: v for k, v in saved.header.items() if k not in _READ_KEYS}
        kv_state = saved.kv_state
        if header.get("ledger") != saved.kv_ledger:
            kv_state, header["kv_digest"] = b"", ""
        self._put_checkpoint(session_id, header, kv_state, generation)

    def append(
        self,
        session_id: str,
        delta: dict[str, Any],
        *,
        expect: Generation,
        pixels: Sequence[tuple[str, bytes]] = (),
    ) -> tuple[Generation, int]:
        """Append what a turn changed (its pixels first) as the generation after `expect`, the
        one the caller holds; returns the new generation and the bytes appended. A damaged
        checkpoint raises CorruptSessionError: it is replaced by a checkpoint, never appended
        to."""
        with self._session_lock(session_id), self._pixels_lock(shared=True):
            found, journal = self._generation(session_id) or (None, None)
            if found != expect or journal is None:
                raise StaleSessionError(session_id, expect, found)
            for media_id, rgb in pixels:
                self.save_media(media_id, rgb)
            generation = found.next()
            body = json.dumps({"lineage": generation.lineage, "delta": delta}).encode()
            entry = _ENTRY.pack(_ENTRY_MAGIC, len(body), zlib.crc32(body), generation.number)
            fd = os.open(self._journal_path(session_id), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                if journal.size > journal.valid_bytes:  # a torn entry: cut it off first
                    os.ftruncate(fd, journal.valid_bytes)
                os.lseek(fd, journal.valid_bytes, os.SEEK_SET)
                data = memoryview(entry + body)
                while data:  # a short write goes on until the disk says why it cannot
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if journal.valid_bytes == 0:
                _fsync_dir(self.root)  # a journal just (re)started survives a power cut
            if len(journal.entries) + 1 >= MAX_JOURNAL_ENTRIES:
                self._fold(session_id, generation)
            self._saw(session_id)
        return generation, len(entry) + len(body)

    def touch(self, session_id: str) -> bool:
        """Say that the session is in use now (a turn takes it): its files' last write (mtime)
        moves on, so a replica that finds the session unused by its own account keeps it
        (`Unused`). False: there is no file (deleted meanwhile)."""
        with self._session_lock(session_id):
            found = self._stamp(session_id)
            if found is None:
                return False
            # later than any write before it, even one within the clock's last tick: a replica
            # that saw the files just before must see them changed
            now = max(time.time_ns(), found[1] + 1000, found[4] + 1000)
            try:
                try:
                    os.utime(self.path(session_id), ns=(now, now))
                except PermissionError:  # another user's file: only "now" is ours to set
                    os.utime(self.path(session_id))
            except FileNotFoundError:
                return False
            self._saw(session_id)
        return True

    def _saw(self, session_id: str) -> None:
        """(Under the session's lock, after this store wrote or touched its files.)"""
        found = self._stamp(session_id)
        if found is None:
            self._seen.pop(session_id, None)
        else:
            self._seen[session_id] = found

    def forget(self, session_id: str) -> None:
        """This replica holds no copy of the session any more (what it saw of it goes)."""
        self._seen.pop(session_id, None)

    def _stamp(self, session_id: str) -> tuple[int, ...] | None:
        """The session's files as they are: (inode, mtime, size) of the checkpoint and of the
        journal (zeros: none); any write or touch changes it. None: no checkpoint."""
        try:
            st = self.path(session_id).stat()
        except FileNotFoundError:
            return None
        try:
            jt = self._journal_path(session_id).stat()
            journal = (jt.st_ino, jt.st_mtime_ns, jt.st_size)
        except FileNotFoundError:
            journal = (0, 0, 0)
        return (st.st_ino, st.st_mtime_ns, st.st_size, *journal)

    def generation(self, session_id: str) -> Generation | None:
        """The generation on disk (None: no file): the checkpoint's, or its journal's last."""
        found = self._generation(session_id)
        return found[0] if found else None

    def _generation(self, session_id: str) -> tuple[Generation, _Journal] | None:
        try:
            with open(self.path(session_id), "rb") as f:
                checkpoint = _read_prefix(session_id, f)[1]
        except FileNotFoundError:
            return None
        journal = self._journal(session_id, checkpoint)
        if journal.entries:
            return Generation(checkpoint.lineage, journal.entries[-1][0]), journal
        return checkpoint, journal

    def _journal_path(self, session_id: str) -> Path:
        return self.root / f"{check_session_key(session_id)}.turns"

    def _journal(self, session_id: str, checkpoint: Generation) -> _Journal:
        """The entries that follow checkpoint: of its lineage, numbered on from it."""
        try:
            data = self._journal_path(session_id).read_bytes()
        except FileNotFoundError:
            return _Journal([], 0, 0)
        entries: list[tuple[int, dict[str, Any]]] = []
        offset, number = 0, checkpoint.number
        # what ends the walk stays out of valid_bytes: the next append cuts it off
        while offset + _ENTRY.size <= len(data):
            magic, length, crc, n = _ENTRY.unpack_from(data, offset)
            end = offset + _ENTRY.size + length
            body = data[offset + _ENTRY.size : end]
            if magic != _ENTRY_MAGIC or len(body) < length or zlib.crc32(body) != crc:
                break  # a torn entry: what follows it was never acknowledged
            if n > checkpoint.number:  # (not one of an older checkpoint's, left by a crash)
                try:
                    entry = json.loads(body)
                    delta = entry["delta"]
                except (ValueError, KeyError, TypeError):
                    break
                if n != number + 1 or entry.get("lineage") != checkpoint.lineage:
                    break  # not this checkpoint's: a session created again over a crashed one
                entries.append((n, delta))
                number = n
            offset = end
        return _Journal(entries, offset, len(data))

    def load_header(self, session_id: str) -> dict[str, Any]:
        """The session's header (startup reads no KV bytes), with its "generation" and
        "lineage"."""
        return self._load(session_id, with_state=False).header

    def load(self, session_id: str) -> SavedSession:
        return self._load(session_id, with_state=True)

    def _load(self, session_id: str, *, with_state: bool) -> SavedSession:
        try:
            with open(self.path(session_id), "rb") as f:
                header, _ = _read_header(session_id, f)
                kv_state = f.read() if with_state else b""
        except FileNotFoundError:
            raise KeyError(session_id) from None
        kv_ledger = header.get("ledger", [])
        checkpoint = Generation(header["lineage"], header["generation"])
        for number, delta in self._journal(session_id, checkpoint).entries:
            try:
                header = header_delta.apply(header, delta)
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptSessionError(
                    f"session {session_id!r}: journal entry {number} does not apply ({e})"
                ) from None
            header["generation"] = number
            header["journal"] = header.get("journal", 0) + 1
        return SavedSession(header, kv_state, kv_ledger)

    def delete(self, session_id: str, *, unused: Unused | None = None) -> bool:
        """Remove the session's files; returns whether there were any. unused: only if they
        still say nobody uses the session (`_in_use`): a replica that found the session unused
        never deletes it under another one that has used it since."""
        with self._session_lock(session_id):
            if unused is not None and self._in_use(session_id, unused):
                return False
            try:
                self.path(session_id).unlink()
            except FileNotFoundError:
                found = False
            else:
                found = True
            # without its checkpoint a journal is nobody's (kept when the unlink failed)
            self._journal_path(session_id).unlink(missing_ok=True)
            self._seen.pop(session_id, None)
            if not found:
                return False
        _fsync_dir(self.root)
        return True

    def _in_use(self, session_id: str, unused: Unused) -> bool:
        """(Under the session's lock) Whether the files say that someone used the session
        since: another generation than the one the deleting replica holds (a turn saved), or
        a write or touch at or after unused.before (a turn under way, a checkpoint of the same
        state) that was not this store's own last one. Both are needed: the generation alone
        misses what keeps it, the time alone misses what this store cannot date (its files'
        mtime is a file server's clock, the caller's time its own)."""
        try:  # (the read opens the files: on NFS, their attributes are fetched anew)
            found = self.generation(session_id)
        except CorruptSessionError:
            found = None  # (damaged: never a newer write, which would be whole)
        if unused.generation is not None and found not in (None, unused.generation):
            return True
        stamp = self._stamp(session_id)
        if stamp is None or stamp == self._seen.get(session_id):
            return False  # as this store left them: nobody else wrote or touched them since
        return max(stamp[1], stamp[4]) >= unused.before * 1e9

    def footprint(self, session_id: str) -> tuple[int, float] | None:
        """The bytes of the session's checkpoint and journal, and when either was last
        written (time.time(); None: no file)."""
        try:
            st = self.path(session_id).stat()
        except FileNotFoundError:
            return None
        size, written = st.st_size, st.st_mtime
        try:
            jt = self._journal_path(session_id).stat()
        except FileNotFoundError:
            return size, written
        return size + jt.st_size, max(written, jt.st_mtime)

    def unused_since(self, before: float) -> list[str]:
        """The sessions whose files were last written before `before` (time.time())."""
        found = []
        for session_id in self.ids():
            with contextlib.suppress(SessionIdError, OSError):  # (not ours; gone meanwhile)
                footprint = self.footprint(session_id)
                if footprint is not None and footprint[1] < before:
                    found.append(session_id)
        return found

    @contextlib.contextmanager
    def collecting_pixels(self) -> Iterator[set[str] | None]:
        """Every media id a session file on disk refers to, with session writes held off (the
        pixels' lock, exclusive) while the caller deletes pixels that none needs. None when a
        file cannot be read (damaged, a newer format, a passing I/O error): its needs are
        unknown, so nothing may be deleted."""
        with self._pixels_lock():
            referred: set[str] = set()
            seen: dict[str, tuple[tuple[int, ...], frozenset[str]]] = {}
            unreadable = False
            for session_id in self.ids():
                try:
                    key = self._stamp(session_id)
                    if key is None:
                        continue  # deleted meanwhile: it needs nothing
                    hit = self._referred.get(session_id)
                    if hit is None or hit[0] != key:  # parsed again only when it changed
                        pixels = self.load_header(session_id).get("pixels", {})
                        hit = (key, frozenset(px["media_id"] for px in pixels.values()))
                    seen[session_id] = hit
                    referred |= hit[1]
                except FileNotFoundError:
                    continue  # deleted meanwhile: it needs nothing
                except KeyError as e:
                    unreadable |= e.args != (session_id,)  # (no file: deleted meanwhile)
                except (CorruptSessionError, OSError):
                    unreadable = True
            self._referred = seen
            yield None if unreadable else referred

    def _session_lock(self, session_id: str) -> contextlib.AbstractContextManager[None]:
        stripe = zlib.crc32(check_session_key(session_id).encode()) % _LOCK_STRIPES
        return _locked(self.root / ".locks" / f"{stripe}.lock")

    def _pixels_lock(self, *, shared: bool = False) -> contextlib.AbstractContextManager[None]:
        return _locked(self.root / ".locks" / "pixels.lock", shared=shared)

    def _media_path(self, media_id: str) -> Path:
        return self.root / "media" / f"{check_session_id(media_id)}.rgb"

    def has_media(self, media_id: str) -> bool:
        return self._media_path(media_id).exists()

    def media_bytes(self, media_id: str) -> int:
        """A medium's file size (0: not written yet)."""
        try:
            return self._media_path(media_id).stat().st_size
        except OSError:  # (missing, or unreadable: a measure, never a failure)
            return 0

    def save_media(self, media_id: str, rgb: bytes) -> None:
        target = self._media_path(media_id)
        if not target.exists():
            _write_atomically(target, b"", rgb)

    def delete_media(self, media_id: str) -> None:
        self._media_path(media_id).unlink(missing_ok=True)

    def load_media(self, media_id: str, width: int, height: int, kind: str = "image") -> bytes:
        """The pixels (or a sound's bytes) whose hash is media_id (CorruptSessionError if
        missing or damaged)."""
        try:
            rgb = self._media_path(media_id).read_bytes()
        except FileNotFoundError:
            raise CorruptSessionError(f"pixels of media {media_id[:12]} are missing") from None
        if content_id(kind, width, height, rgb) != media_id:
            raise CorruptSessionError(f"pixels of media {media_id[:12]} are damaged")
        return rgb


# Linux's open file description locks: a lock belongs to the descriptor that took it, not to
# the process, so each thread takes its own and the kernel makes them take turns. POSIX record
# locks (lockf) would make every thread of a process one owner, and a deadlock check per owner
# then takes two processes with threads waiting on each other's locks for a cycle (EDEADLK)
# where none exists. OFD locks and record locks exclude each other, across machines too (NFSv4,
# CephFS: an OFD lock is one more lock owner).
_OFD_LOCKS = hasattr(fcntl, "F_OFD_SETLKW")
_FLOCK = struct.Struct("hhqqi")  # struct flock: type, whence, start, length (0: all), pid (0)
_FLOCK_BYTES = _FLOCK.size + (-_FLOCK.size) % 8  # (with the struct's padding)
_DEADLOCK_PATIENCE = 60.0  # lockf's EDEADLK is retried this long before it is believed


def _flock(kind: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0).ljust(_FLOCK_BYTES, b"\0")


class _WritersFirst:
    """This process's threads waiting to hold a lock file exclusive: its new sharers wait
    for them, so pixel collection is not starved by a stream of writes (the kernel lets a
    sharer in whenever the lock is shared)."""

    def __init__(self) -> None:
        self._turns = threading.Condition()
        self._waiting: dict[str, int] = {}

    def share(self, path: Path) -> None:
        with self._turns:
            self._turns.wait_for(lambda: str(path) not in self._waiting)

    @contextlib.contextmanager
    def exclusive(self, path: Path) -> Iterator[None]:
        key = str(path)
        with self._turns:
            self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            yield
        finally:
            with self._turns:
                self._waiting[key] -= 1
                if not self._waiting[key]:
                    del self._waiting[key]
                    self._turns.notify_all()


_WRITERS_FIRST = _WritersFirst()


@contextlib.contextmanager
def _locked(path: Path, *, shared: bool = False) -> Iterator[None]:
    fd = _ofd_lock(path, shared) if _OFD_LOCKS else None
    if fd is None:
        with _process_locked(path, shared=shared):
            yield
        return
    try:
        yield
    finally:
        try:  # let go before the close: a child forked meanwhile shares the descriptor
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK))
        finally:
            os.close(fd)


def _ofd_lock(path: Path, shared: bool) -> int | None:
    """A new descriptor of the lock file holding its OFD lock; None where there are none."""
    global _OFD_LOCKS
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if shared:
            _WRITERS_FIRST.share(path)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_RDLCK))
        else:
            with _WRITERS_FIRST.exclusive(path):
                fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK))
    except OSError as e:
        os.close(fd)
        if e.errno != errno.EINVAL:
            raise
        # a kernel before 3.15, or a filesystem without them: record locks from now on (an
        # OFD lock still held elsewhere excludes them all the same)
        _OFD_LOCKS = False
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lockf(fd: int, cmd: int) -> None:
    """lockf, where a deadlock it reports is retried: its check takes this process's threads
    for one owner (see _OFD_LOCKS), and the locks here are always taken in one order (a
    session's stripe, then the pixels), so a reported cycle is one that other threads will
    undo by letting go."""
    deadline, delay = time.monotonic() + _DEADLOCK_PATIENCE, 0.001
    while True:
        try:
            fcntl.lockf(fd, cmd)
            return
        except OSError as e:
            if e.errno != errno.EDEADLK or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


class _FileLock:
    """A lock file as this process holds it with POSIX record locks (where there are no OFD
    locks). They are the process's: its threads do not exclude each other, and closing any
    descriptor of the file drops all of them. So a lock file in use has one descriptor here,
    closed only once no thread holds or waits for it, and its threads take turns at its lock
    in memory first: exclusive by one thread at a time, shared by any number together (taken
    by the first, let go by the last). A thread waiting to hold it exclusive goes before new
    sharers: pixel collection is not starved by a stream of writes."""

    def __init__(self, key: tuple[int, int], fd: int):
        self.key, self.fd = key, fd
        self.users = 0  # threads holding or waiting for it (under _FILE_LOCKS_LOCK)
        self._turns = threading.Condition()
        self._exclusive = False
        self._sharers = 0
        self._waiting = 0  # threads waiting to hold it exclusive

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._turns:
            self._waiting += 1
            self._turns.wait_for(lambda: not self._exclusive and not self._sharers)
            self._waiting -= 1
            self._exclusive = True
        try:
            _lockf(self.fd, fcntl.LOCK_EX)  # (other processes: waits for theirs)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)
        finally:
            with self._turns:
                self._exclusive = False
                self._turns.notify_all()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._turns:
            self._turns.wait_for(lambda: not self._exclusive and not self._waiting)
            if not self._sharers:  # (under _turns: no sharer goes on before it is held)
                _lockf(self.fd, fcntl.LOCK_SH)
            self._sharers += 1
        try:
            yield
        finally:
            with self._turns:
                self._sharers -= 1
                if not self._sharers:
                    fcntl.lockf(self.fd, fcntl.LOCK_UN)
                    self._turns.notify_all()


# the lock files in use in this process, by file: two stores of one directory share them
_FILE_LOCKS: dict[tuple[int, int], _FileLock] = {}
_FILE_LOCKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _process_locked(path: Path, *, shared: bool = False) -> Iterator[None]:
    with _FILE_LOCKS_LOCK:
        try:
            st = path.stat()  # (a stat, unlike an open and close, drops no lock)
            lock = _FILE_LOCKS.get((st.st_dev, st.st_ino))
        except FileNotFoundError:
            lock = None
        if lock is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            st = os.fstat(fd)
            lock = _FILE_LOCKS[st.st_dev, st.st_ino] = _FileLock((st.st_dev, st.st_ino), fd)
        lock.users += 1
    try:
        with lock.shared() if shared else lock.exclusive():
            yield
    finally:
        with _FILE_LOCKS_LOCK:
            lock.users -= 1
            if not lock.users:  # nobody here holds it: closing drops no one's lock
                del _FILE_LOCKS[lock.key]
                os.close(lock.fd)


def _read_prefix(session_id: str, f: Any) -> tuple[int, Generation]:
    """(header length, generation) from a file's first bytes; f is left at the header."""
    magic = f.read(len(_MAGIC))
    if magic == _MAGIC_V1:
        length = f.read(8)
        if len(length) < 8:
            raise CorruptSessionError(f"session {session_id!r}: file is truncated")
        (n,) = struct.unpack("<Q", length)
        return n, Generation("", 0)
    rest = f.read(32)
    if magic != _MAGIC or len(rest) < 32:
        raise CorruptSessionError(f"session {session_id!r}: not a slotwise session file")
    n, number = struct.unpack_from("<QQ", rest)
    return n, Generation(rest[16:].hex(), number)


def _read_header(session_id: str, f: Any) -> tuple[dict[str, Any], int]:
    n, generation = _read_prefix(session_id, f)
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
    header["generation"], header["lineage"] = generation.number, generation.lineage
    return header, f.tell()


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
