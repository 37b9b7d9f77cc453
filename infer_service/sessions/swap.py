"""Sessions into and out of slots.

A session that is not in a slot has what its turn needs read on its disk queue before the turn
starts (prefetch): its checkpoint's KV state when it was made in this context's layout and
for this ledger, and the media chunks of the segments that state lacks, made from their
pixels (libmtmd's tokenize is thread-safe on a shared context). The swap-in on the engine
thread then only loads the state; the segments after what the checkpoint shares with the
ledger are decoded again by the turn. A session in a slot owns its media chunks; they are
freed when it leaves.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from infer_service.events import CorruptSessionError
from infer_service.runner.executor import Executor
from infer_service.runner.media import MediaHandle, Pixels, media_handle
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.sessions.persistence import Persistence
from infer_service.sessions.session import Session
from infer_service.sessions.store import ledger_digest

log = logging.getLogger("slotwise.engine")


@dataclass
class _Prefetched:
    """What a swap-in needs, read on its disk queue: a checkpoint's KV state and how many of the
    ledger's segments it holds, and the media chunks of those it lacks."""

    kv_state: bytes
    media: dict[str, MediaHandle]  # media key -> its chunk
    start: int = 0
    exact: bool = False  # the state holds those segments and nothing else


class Swapper:
    def __init__(
        self,
        executor: Executor,
        persistence: Persistence,
        stats: EngineStats,
        notify: Callable[[], None],
    ):
        self.executor = executor
        self.runtime = executor.runtime
        self.persistence = persistence
        self.stats = stats
        self._notify = notify  # a read is done: the engine may start its turn
        self._prefetch: dict[str, Future[_Prefetched]] = {}  # session id -> its swap-in read

    # -- the reads before a swap-in (engine thread) -------------------------------------------

    def needs_read(self, session: Session) -> bool:
        return (
            self.persistence.store is not None
            and session.slot is None
            and bool(session.ledger.segments)
        )

    def ready(self, session: Session, num_free_slots: int, kv_lora: list[list[Any]]) -> bool:
        """A session that is not in a slot has its saved state read off the engine thread
        first; until then its turn waits (and the engine wakes when the read is done).
        kv_lora: the LoRA adapters the turn decodes under (a state of others is not read)."""
        if not self.needs_read(session):
            return True
        prefetch = self._prefetch.get(session.session_id)
        if prefetch is None:
            if self._reads_in_flight() >= num_free_slots:
                return False  # a state read per free slot at most: each holds a KV state
            prefetch = self.persistence.disk_queues.submit(
                session.session_id, self._read, session.session_id, session.ledger.to_json(),
                dict(session.pixels), dict(session.rgb), kv_lora,
            )  # fmt: skip
            self._prefetch[session.session_id] = prefetch
            prefetch.add_done_callback(lambda _: self._notify())
        return prefetch.done()

    def waits_for_read(self, session: Session | None, num_free_slots: int) -> bool:
        """Its state is being read, or must wait for a read to end before its own starts (the
        end of a read wakes the engine)."""
        if session is None:
            return False
        read = self._prefetch.get(session.session_id)
        if read is not None:
            return not read.done()
        return self.needs_read(session) and self._reads_in_flight() >= num_free_slots

    def _reads_in_flight(self) -> int:
        return sum(1 for f in self._prefetch.values() if not f.done())

    def forget_read(self, session_id: str) -> None:
        """Its turn is over (a read it did not use is dropped: memory stays bounded)."""
        self._prefetch.pop(session_id, None)

    # -- swaps (engine thread) ----------------------------------------------------------------

    def swap_in(self, session: Session, slot: Slot) -> int | None:
        """Put a session's KV state into slot; returns the segment from which its ledger must
        be decoded again (None: the state holds all of it; 0: no saved state, another context
        layout, or a state that does not load)."""
        if slot.ledger is not None and slot.owner is None:
            self.executor.stash(slot)
            slot.ledger = None
        self.executor.clear(slot)
        session.slot, slot.owner, slot.reuse_key = slot.seq, session.session_id, None
        self.stats.num_session_restores += 1
        if not session.ledger.segments:
            return None
        prefetch = self._prefetch.pop(session.session_id, None)
        if prefetch is None or prefetch.exception() is not None:
            return 0
        got = prefetch.result()
        start = got.start if got.kv_state and self.executor.load_state(slot, got.kv_state) else 0
        if start and not got.exact and self.executor.runtime.recurrent:
            # it holds more than the ledger's first `start` segments, and a recurrent state
            # cannot be cut back to them: decoded again from nothing
            self.executor.clear(slot)
            start = 0
        for key, handle in got.media.items():  # made on the disk queue, from the pixels
            if key in session.pixels and key not in session.media:
                session.media[key] = handle
            else:
                handle.close()
        if start == len(session.ledger.segments) and got.exact:
            return None
        return start  # (media the io side did not prepare come from disk when decoded)

    def vacate(self, session: Session, slot: Slot) -> None:
        """The session leaves its slot: the sequence is cleared, its media chunks freed."""
        session.slot = None
        session.release()
        # (its checkpoints stay in host memory with it: the pinned prefix's and the two newest,
        # its last reply's end and start, where its next turn cuts back to)
        session.ledger.keep_newest_marks(2)
        self.executor.clear(slot)
        slot.owner, slot.ledger = None, None

    # -- media chunks -------------------------------------------------------------------------

    def media(self, session: Session) -> Mapping[str, MediaHandle]:
        """A session turn's media chunks: its session's, made when first asked for."""
        return _SessionMedia(self, session)

    def media_of(self, session: Session, key: str) -> MediaHandle:
        """A session's native media chunk (made from the pixels when needed: a session swapped
        in from its KV state has none, and the io side makes those a re-prefill needs)."""
        handle = session.media.get(key)
        if handle is None:
            px = session.pixels[key]
            rgb = session.rgb.get(px.media_id)
            if rgb is None:
                store = self.persistence.store
                if store is None:
                    raise CorruptSessionError(f"pixels of media {px.media_id[:12]} are gone")
                rgb = store.load_media(px.media_id, px.width, px.height, px.kind)
            handle = session.media[key] = self._media_handle(key, px, rgb)
        return handle

    def _media_handle(self, key: str, px: Pixels, rgb: bytes) -> MediaHandle:
        assert self.runtime.mtmd is not None
        return media_handle(self.runtime.mtmd, key, px.bitmap(rgb))

    # -- on the disk queue --------------------------------------------------------------------

    def _read(
        self,
        session_id: str,
        ledger: list[dict[str, Any]],
        pixels: dict[str, Pixels],
        in_memory: dict[str, bytes],
        kv_lora: list[list[Any]],
    ) -> _Prefetched:
        """The checkpoint's KV state if it was made in this context's layout and under the
        turn's LoRA adapters, with how many of the ledger's segments it holds, and the media
        chunks of those it lacks made from their pixels."""
        store = self.persistence.store
        assert store is not None
        kv_state, start = b"", 0
        try:
            saved = store.load(session_id)
        except (KeyError, CorruptSessionError, OSError) as e:
            log.warning("session %r: saved state unusable (%s); re-prefilling", session_id, e)
        else:
            header = saved.header
            if (
                saved.kv_state
                and header.get("layout") == self.runtime.layout
                and header.get("kv_digest") == ledger_digest(saved.kv_ledger)
                and header.get("kv_lora", []) == kv_lora  # (files before adapters have none)
            ):
                kv_state, start = saved.kv_state, _shared_segments(saved.kv_ledger, ledger)
            elif saved.kv_state:
                log.info("session %r: KV state on disk is not usable: re-prefilling", session_id)
        media: dict[str, MediaHandle] = {}
        for seg in ledger[start:]:
            key = seg["media"]
            px = pixels.get(key) if key is not None else None
            if px is None or key in media:
                continue
            rgb = in_memory.get(px.media_id)
            # what fails here is tried again as the turn decodes it, and reported to that turn
            with contextlib.suppress(Exception):
                if rgb is None:
                    rgb = store.load_media(px.media_id, px.width, px.height, px.kind)
                media[key] = self._media_handle(key, px, rgb)
        exact = start == len(saved.kv_ledger) if kv_state else False
        return _Prefetched(kv_state if start else b"", media, start, exact)


class _SessionMedia(Mapping[str, MediaHandle]):
    def __init__(self, swapper: Swapper, session: Session):
        self._swapper, self._session = swapper, session

    def __getitem__(self, key: str) -> MediaHandle:
        return self._swapper.media_of(self._session, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._session.pixels)

    def __len__(self) -> int:
        return len(self._session.pixels)


def _shared_segments(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """How many first segments two ledgers (as JSON) have alike."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
