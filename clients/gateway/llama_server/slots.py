"""llama-server's slots (id_slot, /slots/{id}?action=save|restore|erase) as slotwise sessions.

A native slot holds a session: a /completion with id_slot K is a turn of slot K's session.
When its prompt begins with the whole prompt of the session's last turn (the tokens and images
the session holds before that turn's reply), only the rest is sent, and infer keeps as much of
the reply as the rest repeats: llama-server's cache_prompt, on a sequence that shifts like any
session's. Any other prompt starts the slot on a new session. What a turn's prompt was is its
note (a count and a digest of its tokens and images), so that a slot restored by another
gateway, or after a restart, is continued all the same.

A saved file is a name for a session: `save` points the file at the slot's session (an empty
session whose title is the target's id, `lsf-` and a digest of the file name); `restore` gives
that session to a slot. Sessions are written after every turn, so a file follows its
conversation: restoring it gives the conversation as it last stood, not a copy as it stood at
the save (a copy of a session would need infer to copy one). A session no file names is
deleted when its slot moves on to another; one a file names stays until the session life rules
(TTL, quota) end it.

Which infer slot holds a native slot's session is the engine's choice; slots are per tenant
(each caller's key has its own), and the map from slot to session lives in this gateway, as a
llama-server's slots live in its process: a restart empties them, files stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from clients.client import AsyncSlotwiseClient, Prepared, SessionInfo, SlotwiseError
from clients.gateway.errors import ApiError, call, from_slotwise, translated
from slotwise.v1 import prompt_pb2

TITLE = "llama-server slot"  # a slot's session, which no file names
SAVED = "llama-server slot (saved)"  # ... a file names it: it stays when the slot moves on
_MISSING = "Unable to restore slot: No available space in KV cache or invalid slot save file"


def _error(status: int, message: str) -> ApiError:
    kinds = {400: "invalid_request_error", 501: "not_supported_error"}
    return ApiError(status, message, type=kinds.get(status, "server_error"))


def units(prompt: prompt_pb2.PreparedPrompt) -> list[bytes]:
    """A prompt as what a sequence holds: each token, each image (by its pixels' id)."""
    out: list[bytes] = []
    for c in prompt.chunks:
        if c.WhichOneof("kind") == "media":
            out.append(b"m" + c.media.media_id.encode())
        else:
            out += [b"t" + t.to_bytes(4, "little", signed=True) for t in c.text.token_ids]
    return out


def digest(items: list[bytes]) -> str:
    return hashlib.blake2b(b"".join(items), digest_size=16).hexdigest()


def tail(prompt: prompt_pb2.PreparedPrompt, n: int) -> prompt_pb2.PreparedPrompt | None:
    """The prompt after its first n units; None where that cuts an image's group (an image and
    its wrapper tokens are held, and evicted, whole)."""
    out = prompt_pb2.PreparedPrompt(fingerprint=prompt.fingerprint)
    skip, last_group = n, 0
    for c in prompt.chunks:
        media = c.WhichOneof("kind") == "media"
        size = 1 if media else len(c.text.token_ids)
        if skip >= size:
            skip -= size
            last_group = c.media_group
            continue
        if skip == 0 and (c.media_group and c.media_group == last_group):
            return None
        if skip > 0:
            if c.media_group:
                return None
            c = prompt_pb2.Chunk(
                message_index=c.message_index,
                text=prompt_pb2.TextChunk(token_ids=c.text.token_ids[skip:]),
            )
            skip = 0
        out.chunks.append(c)
        cells = c.media.num_cells if media else len(c.text.token_ids)
        out.num_cells += cells
        out.num_positions += c.media.num_positions if media else cells
        last_group = -1
    return out if out.chunks else None


def file_session(filename: str) -> str:
    return "lsf-" + hashlib.blake2b(filename.encode(), digest_size=16).hexdigest()


def valid_filename(name: Any) -> bool:
    """llama-server's fs_validate_filename, in short: one plain file name."""
    if not isinstance(name, str) or not name or len(name.encode()) > 255:
        return False
    if name in (".", "..") or name != name.strip() or name.endswith("."):
        return False
    return not any(c in name for c in '/\\:*?"<>|') and all(ord(c) >= 32 for c in name)


@dataclass
class Lease:
    """A native slot held for one completion (one request at a time per slot, as llama-server
    defers a task for a busy slot): the slot's session, the part of the prompt it lacks, and
    the note that turn keeps. Released once, when the completion's answer is done."""

    slot: int
    session_id: str
    rest: Prepared  # the prompt less what the session holds: what the turn sends
    held: int  # the prompt's cells the session holds (not sent again)
    expect_turns: int  # the turns the session has: the turn is refused if another came first
    note: bytes  # what the turn's prompt was (a count and a digest of its units)
    _lock: asyncio.Lock = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._lock.release()


class Slots:
    def __init__(self) -> None:
        self._held: dict[tuple[int, int], str] = {}  # (caller's client, slot) -> session id
        self._locks: dict[tuple[int, int], asyncio.Lock] = {}

    def _key(self, client: AsyncSlotwiseClient, slot: int) -> tuple[int, int]:
        return id(client), slot

    def _lock(self, key: tuple[int, int]) -> asyncio.Lock:
        # one request at a time per slot: llama-server defers a task for a busy slot
        return self._locks.setdefault(key, asyncio.Lock())

    # -- completions on a slot -----------------------------------------------------------------

    async def acquire(self, client: AsyncSlotwiseClient, slot: int, prompt: Prepared) -> Lease:
        """The slot, held for a completion of this prompt (waiting while another has it): its
        session continued where the prompt begins with what the session holds, else a new
        one. The caller releases the lease when its answer is done."""
        key = self._key(client, slot)
        lock = self._lock(key)
        await lock.acquire()
        try:
            held = units(prompt.prompt)
            session, rest, turns = await self._continue(client, key, prompt.prompt, held)
        except BaseException:
            lock.release()
            raise
        note = json.dumps({"n": len(held), "d": digest(held)}).encode()
        sent = replace(prompt, prompt=rest)
        return Lease(slot, session, sent, prompt.num_cells - rest.num_cells, turns, note, lock)

    async def _continue(
        self,
        client: AsyncSlotwiseClient,
        key: tuple[int, int],
        prompt: prompt_pb2.PreparedPrompt,
        held: list[bytes],
    ) -> tuple[str, prompt_pb2.PreparedPrompt, int]:
        """The slot's session and what of the prompt it lacks, or a new session for it."""
        session = self._held.get(key)
        if session is not None:
            info = await self._info(client, session, num_records=1)
            last = _note(info.records[-1].note) if info and info.records else {}
            n = last.get("n")
            if isinstance(n, int) and n < len(held) and digest(held[:n]) == last.get("d"):
                rest = tail(prompt, n)
                if rest is not None and info is not None:
                    return session, rest, info.num_turns
            await self._let_go(client, session, info)
        session = f"lss-{uuid.uuid4().hex}"
        await call(client.create_session(session, title=TITLE))
        self._held[key] = session
        return session, prompt, 0

    async def _info(
        self, client: AsyncSlotwiseClient, session: str, num_records: int = 0
    ) -> SessionInfo | None:
        try:
            return await client.get_session(session, num_records=num_records)
        except SlotwiseError as e:
            if e.reason == "SESSION_NOT_FOUND":
                return None
            raise from_slotwise(e) from None

    async def _let_go(
        self, client: AsyncSlotwiseClient, session: str, info: SessionInfo | None
    ) -> None:
        """A slot moves on from its session: deleted unless a file names it."""
        if info is None or info.title != TITLE:
            return
        with contextlib.suppress(SlotwiseError):  # (busy or gone: the session life rules end it)
            await client.delete_session(session)

    # -- the actions ----------------------------------------------------------------------------

    async def save(self, client: AsyncSlotwiseClient, slot: int, filename: Any) -> dict[str, Any]:
        if not valid_filename(filename):
            raise _error(400, "Invalid filename")
        t0 = time.perf_counter()
        key = self._key(client, slot)
        async with self._lock(key):
            session = self._held.get(key)
            pointer = file_session(filename)
            cells = 0
            with translated():
                await self._point(client, pointer, session or "")
                await self._persisted(client, pointer)
                if session is not None:
                    cells = (await client.save_session(session)).num_cells
                    await client.rename_session(session, SAVED)
        return {
            "id_slot": slot,
            "filename": filename,
            "n_saved": cells,
            "n_written": 0,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1000},
        }

    async def _persisted(self, client: AsyncSlotwiseClient, pointer: str) -> None:
        """A file lasts only where infer writes sessions to disk (llama-server's slot actions
        need --slot-save-path): read the pointer back from there, or refuse as it does."""
        await client.save_session(pointer)
        try:
            await client.restore_session(pointer)
        except SlotwiseError as e:
            if e.reason != "NOT_PERSISTED":
                raise
            with contextlib.suppress(SlotwiseError):
                await client.delete_session(pointer)
            raise _error(
                501,
                "This server does not support slots action. Start it with `--sessions-dir` "
                "(infer keeps sessions in memory only)",
            ) from None

    async def _point(self, client: AsyncSlotwiseClient, pointer: str, target: str) -> None:
        try:
            await client.create_session(pointer, title=target)
        except SlotwiseError as e:
            if e.reason != "SESSION_EXISTS":
                raise
            await client.rename_session(pointer, target)

    async def restore(
        self, client: AsyncSlotwiseClient, slot: int, filename: Any
    ) -> dict[str, Any]:
        if not valid_filename(filename):
            raise _error(400, "Invalid filename")
        t0 = time.perf_counter()
        pointer = await self._info(client, file_session(filename))
        if pointer is None:
            raise _error(400, _MISSING)
        target = await self._info(client, pointer.title) if pointer.title else None
        if pointer.title and target is None:
            raise _error(400, _MISSING)
        key = self._key(client, slot)
        async with self._lock(key):
            before = self._held.pop(key, None)
            if before is not None and before != pointer.title:
                await self._let_go(client, before, await self._info(client, before))
            if target is not None:
                self._held[key] = target.session_id
        return {
            "id_slot": slot,
            "filename": filename,
            "n_restored": target.num_cells if target else 0,
            "n_read": 0,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1000},
        }

    async def erase(self, client: AsyncSlotwiseClient, slot: int) -> dict[str, Any]:
        key = self._key(client, slot)
        async with self._lock(key):
            session = self._held.pop(key, None)
            info = await self._info(client, session) if session else None
            if session is not None:
                await self._let_go(client, session, info)
        return {"id_slot": slot, "n_erased": info.num_cells if info else 0}


def _note(data: bytes) -> dict[str, Any]:
    try:
        note = json.loads(data or b"{}")
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}
