"""The oracle: the ledger against real llama.cpp, decode for decode, no gRPC in between.

A driver owns one ``Runtime`` (one context, ``parallel`` 1, a tight ``ctx_size``) and one
``Ledger`` per run. A run is a random script of chat turns -- text of random length (byte
tokens 0..255), Pillow-made RGB images of random size, runs of greedily generated tokens, and
new requests in the used sequence (stateless re-sends and session turns: ``common_prefix`` +
``truncate`` + ``seq_rm(cut, -1)``, as the engine starts a request) -- under a random policy
(AUTO, SHIFT, GAP, REPREFILL, STOP), keep, discard fraction, eviction unit and ``n_ctx_train``
bound. The driver carries out every plan the ledger gives with the real calls (``seq_rm``,
``seq_add``, ``seq_clear``, ``llama_decode``, ``mtmd_encode_chunk`` +
``mtmd_helper_decode_image_chunk``) the way the engine does, and after every plan and every
decode asks llama.cpp what it holds:

- every ``llama_decode`` returns 0 and every media decode advances the position by the ledger's
  ``num_positions`` from the ledger's ``next_pos``;
- the sequence's cells, read out of ``llama_state_seq_get_data`` (count, position of every cell,
  and on M-RoPE the token id stored in each cell, -1 for image cells), equal the ledger's
  segments cell for cell; ``llama_memory_seq_pos_min/max`` agree; the ledger never holds more
  than ``llama_n_ctx_seq`` cells;
- whenever the ledger answers CannotFit, the same decode done unguarded fails in llama.cpp and
  leaves the cache untouched (the ledger calls "full" exactly when llama.cpp is full: the
  decode before succeeded, the one after fails);
- an admitted prompt never meets CannotFit during its prefill and leaves room for one token.

``stop_exactness`` and ``media_boundary`` check the boundary itself, with images in context.

Usage (tests/test_oracle.py runs seeds 0..199 of every pair; sweep further with other seeds)::

    python tests/oracle.py --runs 200                    # every pair, seeds 0..199 (as CI)
    python tests/oracle.py --runs 1000 --seed 200        # 1000 more per pair
    python tests/oracle.py --runs 1000 --pair mrope      # one pair
    python tests/oracle.py --runs 1 --pair rope --seed 17 -v   # replay one failing seed

The tiny model pairs are written to a temporary directory first (``--models DIR`` keeps them).
Runtimes use one thread: on a busy 2-core machine a second spinning thread makes each decode
up to 100x slower.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

os.environ.setdefault("GGML_NO_BACKTRACE", "1")

import llama_cpp
import numpy as np
from llama_cpp import mtmd_cpp
from PIL import Image, ImageDraw

from infer_service.ledger import (
    Admission,
    CannotFit,
    EvictionUnit,
    Fits,
    Gap,
    Item,
    Ledger,
    Plan,
    Policy,
    Reprefill,
    Segment,
    Shift,
)
from infer_service.runtime import (
    EmbeddingCache,
    Runtime,
    RuntimeConfig,
    SamplingConfig,
)
from slotwise_core import native
from slotwise_core.tiny_models import ALL, TinyPair, write_tiny_models

__all__ = [
    "ALL",
    "SHAPES",
    "Boundary",
    "ContextShape",
    "KvProbe",
    "Oracle",
    "OracleError",
    "Picture",
    "RunReport",
    "RunSpec",
    "make_spec",
    "open_runtime",
]

SEQ = 0
UNTIL_FULL = 1 << 20  # a generation step that runs until the ledger says CannotFit


class OracleError(AssertionError):
    """The ledger and llama.cpp disagree (or llama.cpp refused what the ledger allowed)."""


# -- contexts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextShape:
    ctx_size: int
    batch_size: int
    ubatch_size: int


# Tight contexts (n_ctx is padded to multiples of 256 per sequence: these are exact). Small
# batches split prompts and images over several llama_decode calls / ubatches; the non-causal
# pair needs the whole 64-cell image in one ubatch (and one batch).
SHAPES: dict[str, tuple[ContextShape, ...]] = {
    "mrope": (ContextShape(256, 256, 256), ContextShape(512, 512, 96), ContextShape(256, 64, 32)),
    "rope": (ContextShape(256, 256, 256), ContextShape(512, 128, 128), ContextShape(256, 48, 32)),
    "noncausal": (
        ContextShape(256, 256, 64),
        ContextShape(512, 512, 512),
        ContextShape(256, 96, 80),
    ),
}


def open_runtime(pair: TinyPair, shape: ContextShape, *, threads: int = 1) -> Runtime:
    return Runtime(
        RuntimeConfig(
            pair.model,
            pair.mmproj,
            ctx_size=shape.ctx_size,
            parallel=1,
            batch_size=shape.batch_size,
            ubatch_size=shape.ubatch_size,
            threads=threads,
        )
    )


# -- what llama.cpp holds ------------------------------------------------------------------------


class KvProbe:
    """One sequence's cells as llama.cpp serialises them (llama_state_seq_get_data).

    Layout in this llama.cpp (measured, then checked on every read): 8 header bytes, u32
    n_stream (1), u32 cell_count, then per cell: i32 pos, u32 n_seq_id (1), on M-RoPE models
    llama_kv_cell_ext {i32 x, i32 y, i32 tok} (tok -1 for media cells), i32 seq_id; then the
    K/V rows. The meta stride is calibrated once on a two-token sequence.
    """

    def __init__(self, rt: Runtime, seq: int = SEQ):
        self.rt = rt
        self.seq = seq
        self._buf = (ctypes.c_uint8 * 0)()
        rt.seq_clear(seq)
        rt.batch.clear()
        rt.batch.add([200, 201], 7, seq, logits_last=False)
        if rt.decode() != 0:
            raise OracleError("calibration decode failed")
        words = self._words()
        rt.seq_clear(seq)
        if words[2] != 1 or words[3] != 2 or words[4] != 7 or words[5] != 1:
            raise OracleError(f"unexpected sequence state layout: {words[:12].tolist()}")
        for stride in (3, 4, 5, 6, 7, 8):
            if words[4 + stride] == 8 and words[5 + stride] == 1 and words[3 + stride] == seq:
                self.stride = stride
                break
        else:
            raise OracleError(f"cannot find the cell stride: {words[:24].tolist()}")
        self.has_tok = self.stride == 6  # pos, n_seq_id, x, y, tok, seq_id
        if self.has_tok and words[8] != 200:
            raise OracleError(f"M-RoPE cell ext does not hold the token: {words[:12].tolist()}")
        self.header = bytes(words[:2].tobytes())

    def _words(self) -> np.ndarray:
        ctx = self.rt.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, self.seq))
        if len(self._buf) < size:
            self._buf = (ctypes.c_uint8 * max(size, 2 * len(self._buf)))()
        n = int(llama_cpp.llama_state_seq_get_data(ctx, self._buf, size, self.seq))
        if n != size:
            raise OracleError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
        return np.frombuffer(self._buf, dtype=np.int32, count=size // 4)

    def cells(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(positions, token ids or None) of every cell of the sequence, in cache order."""
        words = self._words()
        if bytes(words[:2].tobytes()) != self.header or words[2] != 1:
            raise OracleError(f"unexpected sequence state header: {words[:4].tolist()}")
        n = int(words[3])
        meta = words[4 : 4 + n * self.stride].reshape(n, self.stride)
        if n and not ((meta[:, 1] == 1).all() and (meta[:, -1] == self.seq).all()):
            raise OracleError("a cell of the sequence belongs to other sequences too")
        return meta[:, 0].copy(), (meta[:, 4].copy() if self.has_tok else None)


# -- scripts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Picture:
    width: int
    height: int
    seed: int

    def rgb(self) -> bytes:
        """A Pillow-made RGB image: a random background with a few random shapes."""
        r = random.Random(self.seed)
        img = Image.new("RGB", (self.width, self.height), _color(r))
        draw = ImageDraw.Draw(img)
        for _ in range(r.randint(1, 4)):
            x0, y0 = r.randrange(self.width), r.randrange(self.height)
            x1, y1 = r.randint(x0, self.width), r.randint(y0, self.height)
            draw.rectangle((x0, y0, x1, y1), fill=_color(r))
        return img.tobytes()


def _color(r: random.Random) -> tuple[int, int, int]:
    return (r.randrange(256), r.randrange(256), r.randrange(256))


@dataclass(frozen=True)
class Prompt:
    parts: tuple[tuple[int, ...] | Picture, ...]
    truncate: bool


@dataclass(frozen=True)
class Resend:
    """A new request in the same sequence, the engine's way: ``common_prefix`` against what the
    ledger holds, ``truncate`` + ``seq_rm(cut, -1)``, then admit and decode the rest.

    Stateless (``session`` False): the client re-sends the first ``share`` of the conversation
    (the items it sent and the tokens it got) and a new message. Session: the new turn starts
    with the first ``share`` of the last reply's tokens, compared from ``generated_tail``.
    """

    parts: tuple[tuple[int, ...] | Picture, ...]
    truncate: bool
    session: bool
    share: float


@dataclass(frozen=True)
class Generate:
    num_tokens: int


Step = Prompt | Resend | Generate


@dataclass(frozen=True)
class RunSpec:
    seed: int
    pair: str
    shape: int  # index into SHAPES[pair]
    policy: Policy
    keep: int
    discard_fraction: float
    unit: EvictionUnit
    n_ctx_train: int | None  # None: the model's own
    steps: tuple[Step, ...]

    def describe(self) -> str:
        parts = []
        for s in self.steps:
            if isinstance(s, Generate):
                parts.append(
                    "gen-until-full" if s.num_tokens == UNTIL_FULL else f"gen{s.num_tokens}"
                )
                continue
            text = "+".join(
                f"img{p.width}x{p.height}" if isinstance(p, Picture) else f"t{len(p)}"
                for p in s.parts
            )
            if isinstance(s, Resend):
                kind = "session" if s.session else "resend"
                text = f"{kind}({s.share:.2f})+{text}"
            parts.append(text + ("(trunc)" if s.truncate else ""))
        return (
            f"seed={self.seed} pair={self.pair} shape={SHAPES[self.pair][self.shape]} "
            f"policy={self.policy.name} keep={self.keep} discard={self.discard_fraction:.2f} "
            f"unit={self.unit.name} n_ctx_train={self.n_ctx_train} steps=[{' '.join(parts)}]"
        )


def make_spec(pair: str, seed: int) -> RunSpec:
    """The run of ``seed`` on ``pair``: the same spec every time."""
    r = random.Random(f"oracle:{pair}:{seed}")
    shape = r.randrange(len(SHAPES[pair]))
    capacity = SHAPES[pair][shape].ctx_size
    policies = [Policy.AUTO, Policy.SHIFT, Policy.GAP, Policy.REPREFILL, Policy.STOP]
    weights = [3, 2, 3, 2, 2] if pair != "mrope" else [4, 1, 3, 2, 2]
    policy = r.choices(policies, weights)[0]
    keep = 0 if r.random() < 0.5 else r.randint(1, capacity // 3)
    discard = r.choice([0.0, 0.5, 0.5, 1.0, round(r.random(), 2)])
    if policy is Policy.REPREFILL and discard < 0.2 and r.random() < 0.8:
        discard = 0.5  # discarding only what is needed re-prefills on every token: slow
    unit = r.choice([EvictionUnit.TOKEN, EvictionUnit.MESSAGE])
    n_ctx_train = None if r.random() < 0.5 else r.randint(capacity, 3 * capacity)
    steps: list[Step] = []
    for i in range(r.randint(1, 6)):
        parts: list[tuple[int, ...] | Picture] = []
        for _ in range(r.choice([0, 1, 1, 1, 2, 2, 3])):
            if r.random() < 0.7:
                parts.append(_text(r))
            parts.append(_picture(r, pair))
        parts.append(_text(r))  # generation needs the logits of a text decode
        truncate = r.random() < 0.5
        if i and r.random() < 0.3:
            share = r.choice([0.0, 1.0, round(r.random(), 2)])
            steps.append(Resend(tuple(parts), truncate, session=r.random() < 0.5, share=share))
        else:
            steps.append(Prompt(tuple(parts), truncate))
        steps.append(Generate(r.choice([0, r.randint(1, 20), r.randint(1, 80)])))
    if policy is Policy.STOP and r.random() < 0.7:
        steps[-1] = Generate(UNTIL_FULL)  # reach the boundary: CannotFit, probed in llama.cpp
    return RunSpec(seed, pair, shape, policy, keep, discard, unit, n_ctx_train, tuple(steps))


def _text(r: random.Random) -> tuple[int, ...]:
    n = r.choice([r.randint(1, 8), r.randint(1, 40), r.randint(1, 120)])
    if r.random() < 0.05:
        n = r.randint(200, 400)  # a long message, more than a small batch or a whole context
    return tuple(r.randrange(256) for _ in range(n))


def _picture(r: random.Random, pair: str) -> Picture:
    if pair == "mrope":  # dynamic resolution: the size sets cells and positions
        hi = 448 if r.random() < 0.15 else 160
        return Picture(r.randint(28, hi), r.randint(28, hi), r.randrange(1 << 30))
    return Picture(r.randint(16, 200), r.randint(16, 200), r.randrange(1 << 30))


# -- the driver ----------------------------------------------------------------------------------


@dataclass
class RunReport:
    spec: RunSpec
    counts: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


@dataclass
class _Media:
    chunk: int  # an owned copy of libmtmd's chunk (freed when the run ends)
    key: str  # the picture and chunk index: the embedding cache's key
    embd: np.ndarray | None = None


class _Run:
    def __init__(self, spec: RunSpec, ledger: Ledger):
        self.spec = spec
        self.ledger = ledger
        self.rng = random.Random(f"exec:{spec.pair}:{spec.seed}")
        self.media: dict[str, _Media] = {}
        self.next_token: int | None = None
        self.history: list[Item] = []  # the conversation as the client knows it
        self.last_reply: list[int] = []  # the tokens of the last generation step
        self.message = -1
        self.group = 0
        self.counts: Counter[str] = Counter()
        self.trail: deque[str] = deque(maxlen=12)


class Oracle:
    """Drives one runtime's sequence 0 and checks it against the ledger after every step."""

    def __init__(self, rt: Runtime, *, reencode: float = 0.2):
        """``reencode``: how often a re-decoded image is encoded again instead of reusing its
        embeddings (kept per run, and across runs in a small cache)."""
        if rt.num_slots != 1:
            raise ValueError("the oracle drives contexts with one sequence")
        self.rt = rt
        self.reencode = reencode
        self.embeddings = EmbeddingCache(64 << 20)
        self.capacity = rt.num_cells_per_slot
        self.probe = KvProbe(rt)
        self.sampler = rt.sampler(SamplingConfig(temperature=0))
        self._cells_of: dict[int, tuple[Segment, np.ndarray, np.ndarray]] = {}

    def close(self) -> None:
        self.rt.free_sampler(self.sampler)

    # -- public -------------------------------------------------------------------------------

    def run(self, spec: RunSpec) -> RunReport:
        t0 = time.perf_counter()
        ledger = self.new_ledger(
            spec.policy,
            keep=spec.keep,
            discard_fraction=spec.discard_fraction,
            unit=spec.unit,
            n_ctx_train=spec.n_ctx_train,
        )
        run = _Run(spec, ledger)
        try:
            with self._fresh(run):
                for step in spec.steps:
                    if isinstance(step, Generate):
                        self._generate(run, step.num_tokens)
                    elif not self._prompt(run, step):
                        break
        except Exception as e:  # the ledger's own checks and NativeError count as well
            what = str(e) if isinstance(e, OracleError) else f"{type(e).__name__}: {e}"
            trail = "\n  ".join(run.trail)
            raise OracleError(f"{what}\n{spec.describe()}\nlast steps:\n  {trail}") from e
        return RunReport(spec, run.counts, time.perf_counter() - t0)

    def new_ledger(
        self,
        policy: Policy,
        *,
        keep: int = 0,
        discard_fraction: float = 0.5,
        unit: EvictionUnit = EvictionUnit.TOKEN,
        n_ctx_train: int | None = None,
    ) -> Ledger:
        return Ledger(
            self.capacity,
            can_shift=self.rt.can_shift,
            n_ctx_train=n_ctx_train or self.rt.n_ctx_train,
            policy=policy,
            keep=keep,
            discard_fraction=discard_fraction,
            unit=unit,
        )

    def image_items(self, run: _Run, picture: Picture, message: int) -> list[Item]:
        """Tokenize one image alone: its media group (wrapper text + media chunks)."""
        mtmd = self.rt.mtmd
        assert mtmd is not None
        run.group += 1
        media_id = f"img{run.group}-{picture.seed:x}"
        bitmap = native.Bitmap(picture.width, picture.height, picture.rgb(), media_id)
        items: list[Item] = []
        with mtmd.tokenize(mtmd.marker, [bitmap], add_special=False) as chunks:
            for i, raw in enumerate(chunks.describe()):
                if not raw.is_media:
                    items.append(Item.text(raw.token_ids, message, group=run.group))
                    continue
                key = f"{media_id}:{i}"
                copy = mtmd_cpp.mtmd_input_chunk_copy(chunks.native(i))
                run.media[key] = _Media(copy, f"{picture}:{i}")
                media = Item.media(key, raw.num_cells, raw.num_positions, message, group=run.group)
                items.append(media)
        return items

    # -- steps --------------------------------------------------------------------------------

    @contextmanager
    def _fresh(self, run: _Run) -> Iterator[None]:
        self.rt.seq_clear(SEQ)
        self.verify(run)
        try:
            yield
        finally:
            self.rt.seq_clear(SEQ)
            for m in run.media.values():
                mtmd_cpp.mtmd_input_chunk_free(m.chunk)
            run.media.clear()

    def _prompt(self, run: _Run, step: Prompt | Resend) -> bool:
        """Admit and prefill one message; False when the run cannot go on (STOP, full)."""
        ledger = run.ledger
        run.message += 1
        items: list[Item] = []
        for part in step.parts:
            if isinstance(part, Picture):
                items += self.image_items(run, part, run.message)
            else:
                items.append(Item.text(part, run.message))
        if isinstance(step, Resend):
            items = self._reuse(run, step, items)
        else:
            run.history += items
        run.last_reply = []
        verdict = ledger.admit(items, truncate=step.truncate)
        shapes = [(i.num_cells, i.num_positions) for i in items[:8]]
        run.trail.append(
            f"prompt of {len(items)} items (cells, positions) {shapes}"
            f"{'...' if len(items) > 8 else ''} -> {_brief(verdict)}"
        )
        if isinstance(verdict, CannotFit):
            if verdict.num_cells_needed <= self.capacity:
                raise OracleError(f"admit refused a prompt that fits: {verdict}")
            run.counts["prompts_rejected"] += 1
            return ledger.policy is not Policy.STOP
        run.counts["prompts"] += 1
        run.counts["prompts_truncated"] += bool(verdict.dropped)
        if not self.feed(run, verdict.kept, prefill=True):
            raise OracleError("an admitted prompt met CannotFit during its prefill")
        after = ledger.ensure(1)
        if isinstance(after, CannotFit) or (ledger.policy is Policy.STOP and after != Fits()):
            raise OracleError(f"an admitted prompt left no room for one token: {after}")
        return True

    def _reuse(self, run: _Run, step: Resend, new: list[Item]) -> list[Item]:
        """The engine's start of a request in a used sequence; returns the items to admit."""
        ledger, rng = run.ledger, run.rng
        if step.session:
            start = ledger.generated_tail()
            lead = run.last_reply[: round(step.share * len(run.last_reply))]
            items = ([_generated(lead, run.message)] if lead else []) + new
            if run.last_reply:
                del run.history[-len(run.last_reply) :]
            run.history += items
        else:
            start = 0
            k = round(step.share * len(run.history))
            items = run.history[:k]
            if k < len(run.history) and _plain_text(run.history[k]) and rng.random() < 0.5:
                cut = run.history[k]
                if cut.num_cells > 1:
                    items.append(_head(cut, rng.randint(1, cut.num_cells - 1)))
            items += new
            run.history = list(items)
        ledger.reconfigure(
            policy=ledger.policy,
            keep=ledger.keep,
            discard_fraction=ledger.discard_fraction,
            unit=ledger.unit,
        )
        num_before = ledger.num_cells
        si, so, rest = ledger.common_prefix(items, start)
        cut = ledger.truncate(si, so)
        self.rt.seq_rm(SEQ, cut, -1)
        run.counts["resends"] += 1
        run.counts["cells_reused"] += ledger.num_cells - sum(
            s.num_cells for s in ledger.segments[:start]
        )
        if ledger.num_cells != num_before:
            run.next_token = None  # sampled from a context that is gone
        run.trail.append(
            f"{'session' if step.session else 'resend'}: common_prefix from {start} -> "
            f"({si}, {so}), seq_rm({cut}, -1) -> {ledger.num_cells} cells"
        )
        self.verify(run)
        return rest

    def _generate(self, run: _Run, num_tokens: int) -> None:
        for _ in range(num_tokens):
            token = run.next_token
            if token is None:
                return
            if not self.feed(run, [_generated([token], max(run.message, 0))], prefill=False):
                run.counts["generation_full"] += 1
                return
            run.counts["generated"] += 1
            run.history.append(_generated([token], max(run.message, 0)))
            run.last_reply.append(token)

    # -- plans and decodes --------------------------------------------------------------------

    def feed(self, run: _Run, items: Sequence[Item], *, prefill: bool) -> bool:
        """Decode items the engine's way (ensure, carry out, decode, append); False: CannotFit."""
        ledger, rt = run.ledger, self.rt
        pending = deque(items)
        budget = 100_000
        while pending:
            budget -= 1
            if budget == 0:
                raise OracleError("the ledger keeps planning without progress")
            item = self._coalesce(run, pending)
            if item.is_media:
                n_cells, n_pos = item.num_cells, item.num_positions
            else:
                n_cells = n_pos = self._take_size(run, item)
            plan = ledger.ensure(n_cells, n_pos, group=item.group)
            run.counts[type(plan).__name__] += 1
            if isinstance(plan, CannotFit):
                run.trail.append(f"ensure({n_cells}) -> {plan.message}")
                self._probe_full(run, item, n_cells)
                return False
            if not isinstance(plan, Fits):
                self.carry_out(run, plan)
                if isinstance(plan, Reprefill):
                    pending.extendleft(reversed(plan.kept))
                    run.counts["reprefilled_items"] += len(plan.kept)
                continue
            if item.is_media:
                self._decode_media(run, item)
                pending.popleft()
            else:
                piece = item if n_cells == item.num_cells else _head(item, n_cells)
                self._decode_text(run, piece)
                if piece is item:
                    pending.popleft()
                else:
                    pending[0] = _tail(item, n_cells)
            if ledger.num_cells > rt.num_cells_per_slot:
                raise OracleError(f"the ledger holds {ledger.num_cells} > capacity cells")
        return True

    def _coalesce(self, run: _Run, pending: deque[Item]) -> Item:
        """Mostly merge the front run of plain text of one message (re-prefilled generated
        tokens are one item each) into one item, so a reprefill is a few decodes, not hundreds.
        """
        item = pending[0]
        while (
            len(pending) > 1
            and _plain_text(item)
            and _plain_text(pending[1])
            and pending[1].message_index == item.message_index
            and pending[1].generated == item.generated
            and item.num_cells + pending[1].num_cells <= self.rt.batch_size
            and run.rng.random() < 0.9
        ):
            pending.popleft()
            item = replace(
                item,
                num_cells=item.num_cells + pending[0].num_cells,
                num_positions=item.num_cells + pending[0].num_cells,
                token_ids=item.token_ids + pending[0].token_ids,
            )
            pending[0] = item
        return item

    def _take_size(self, run: _Run, item: Item) -> int:
        """How many tokens of a text item the next decode takes (wrapper text goes whole)."""
        n, batch = item.num_cells, self.rt.batch_size
        if item.group is not None:
            if n > batch:
                raise OracleError(f"wrapper text of {n} tokens exceeds the batch")
            return n
        if n <= batch and run.rng.random() < 0.5:
            return n
        return run.rng.randint(1, min(n, batch))

    def carry_out(self, run: _Run, plan: Plan) -> None:
        rt = self.rt
        if isinstance(plan, Shift):
            if not rt.can_shift:  # llama_memory_seq_add would abort the process
                raise OracleError(f"the ledger planned a shift on a non-shiftable memory: {plan}")
            rt.seq_rm(SEQ, plan.p0, plan.p1)
            rt.seq_add(SEQ, plan.p1, -plan.delta)
        elif isinstance(plan, Gap):
            rt.seq_rm(SEQ, plan.p0, plan.p1)
        elif isinstance(plan, Reprefill):
            rt.seq_clear(SEQ)
        else:
            raise OracleError(f"nothing to carry out for {plan}")
        run.ledger.apply(plan)
        run.counts["cells_evicted"] += plan.num_cells_evicted
        run.trail.append(
            f"{_brief(plan)} -> {run.ledger.num_cells} cells, next_pos {run.ledger.next_pos}"
        )
        self.verify(run)

    def _decode_text(self, run: _Run, item: Item) -> None:
        rt, ledger = self.rt, run.ledger
        pos = ledger.next_pos
        rt.batch.clear()
        index = rt.batch.add(item.token_ids, pos, SEQ, logits_last=True)
        rc = rt.decode()
        run.counts["decodes"] += 1
        if rc != 0:
            raise OracleError(
                f"llama_decode of {item.num_cells} tokens at {pos} returned {rc} with "
                f"{ledger.num_cells}/{self.capacity} cells in the ledger"
            )
        ledger.append(item)
        run.next_token = rt.sample(self.sampler, index)
        run.trail.append(f"text {item.num_cells} @ {pos} -> {ledger.num_cells} cells")
        self.verify(run)

    def _decode_media(self, run: _Run, item: Item) -> None:
        rt, ledger = self.rt, run.ledger
        assert item.media_id is not None
        media = run.media[item.media_id]
        fresh = media.embd is not None and run.rng.random() < self.reencode
        embd = self.embeddings_of(run, media, fresh=fresh)
        pos = ledger.next_pos
        # as the engine does it: in pieces of at most a batch (a non-causal chunk whole),
        # with the positions libmtmd gives each embedding
        positions = rt.media_positions(media.chunk, pos)
        step = item.num_cells if rt.mtmd and rt.mtmd.non_causal else rt.batch_size
        for offset in range(0, item.num_cells, step):
            n = min(step, item.num_cells - offset)
            rc = rt.decode_embeddings(embd, positions, offset, n, SEQ)
            if rc != 0:
                raise OracleError(
                    f"media of {item.num_cells} cells at {pos}, piece {offset}+{n}: rc={rc} "
                    f"with {ledger.num_cells}/{self.capacity} cells in the ledger"
                )
            run.counts["media_pieces"] += 1
        run.counts["media_decodes"] += 1
        end = pos + int(mtmd_cpp.mtmd_input_chunk_get_n_pos(media.chunk))
        if end - pos != item.num_positions:
            raise OracleError(
                f"media at {pos} advanced to {end}; the ledger expects +{item.num_positions}"
            )
        ledger.append(item)
        run.next_token = None  # decoding an image wipes the logits
        run.trail.append(
            f"media {item.num_cells}/{item.num_positions} @ {pos} -> {ledger.num_cells} cells"
        )
        self.verify(run)

    def embeddings_of(self, run: _Run, media: _Media, *, fresh: bool = False) -> np.ndarray:
        if media.embd is None and not fresh:
            media.embd = self.embeddings.get(media.key)
        if media.embd is None or fresh:
            media.embd = self.rt.encode_media(media.chunk)
            self.embeddings.put(media.key, media.embd)
            run.counts["media_encodes"] += 1
        return media.embd

    def _probe_full(self, run: _Run, item: Item, n_cells: int) -> None:
        """CannotFit: the same decode, unguarded, must fail and leave the cache as it was."""
        rt, ledger = self.rt, run.ledger
        if ledger.num_cells + n_cells <= self.capacity:
            raise OracleError(f"CannotFit with {ledger.num_free_cells} free for {n_cells} cells")
        pos = ledger.next_pos
        if item.is_media:
            if n_cells > rt.batch_size:
                return  # several llama_decode calls: the first ones would commit
            assert item.media_id is not None
            media = run.media[item.media_id]
            try:
                rt.decode_media(media.chunk, self.embeddings_of(run, media), pos, SEQ)
            except native.NativeError:
                pass
            else:
                raise OracleError(f"media of {n_cells} cells decoded past the ledger's CannotFit")
            run.next_token = None
        else:
            rt.batch.clear()
            rt.batch.add(item.token_ids[:n_cells], pos, SEQ, logits_last=True)
            rc = rt.decode()
            if rc == 0:
                raise OracleError(
                    f"{n_cells} tokens decoded at {pos} although the ledger holds "
                    f"{ledger.num_cells}/{self.capacity} cells and said CannotFit"
                )
            run.counts[f"full_probe_rc{rc}"] += 1
        run.counts["full_probes"] += 1
        if ledger.policy is Policy.STOP and n_cells == 1:
            if ledger.num_cells != self.capacity:
                raise OracleError(f"STOP ended at {ledger.num_cells}/{self.capacity} cells")
            run.counts["stop_boundaries"] += 1
        self.verify(run)

    # -- the check ----------------------------------------------------------------------------

    def expected_cells(self, ledger: Ledger) -> tuple[np.ndarray, np.ndarray | None]:
        """The position of every cell the ledger says the sequence holds (and, on M-RoPE, the
        token stored in it: -1 for media); M-RoPE media cells all store t = the image's start."""
        segs = ledger.segments
        cache = self._cells_of
        pos: list[np.ndarray] = []
        tok: list[np.ndarray] = []
        for seg in segs:
            hit = cache.get(id(seg))
            if hit is None or hit[0] is not seg:  # the entry holds seg: its id is not reused
                hit = (seg, *self._segment_cells(seg))
                cache[id(seg)] = hit
            pos.append(hit[1])
            tok.append(hit[2])
        if len(cache) > 4 * len(segs) + 256:
            self._cells_of = {id(seg): cache[id(seg)] for seg in segs}
        if not segs:
            return np.zeros(0, np.int32), (np.zeros(0, np.int32) if self.probe.has_tok else None)
        return np.concatenate(pos), (np.concatenate(tok) if self.probe.has_tok else None)

    def _segment_cells(self, seg: Segment) -> tuple[np.ndarray, np.ndarray]:
        n = seg.num_cells
        if seg.is_media and self.rt.uses_mrope:
            pos = np.full(n, seg.pos_start, dtype=np.int32)
        else:
            pos = np.arange(seg.pos_start, seg.pos_start + n, dtype=np.int32)
        if seg.is_media:
            return pos, np.full(n, -1, dtype=np.int32)
        return pos, np.asarray(seg.token_ids, dtype=np.int32)

    def verify(self, run: _Run) -> None:
        ledger, mem = run.ledger, self.rt.memory
        if not 0 <= ledger.num_cells <= self.capacity:
            raise OracleError(f"ledger holds {ledger.num_cells} cells, capacity {self.capacity}")
        want_pos, want_tok = self.expected_cells(ledger)
        got_pos, got_tok = self.probe.cells()
        if len(got_pos) != ledger.num_cells:
            raise OracleError(f"llama.cpp holds {len(got_pos)} cells, ledger {ledger.num_cells}")
        if got_tok is None or want_tok is None:
            same = np.array_equal(np.sort(got_pos), np.sort(want_pos))
        else:
            got = np.lexsort((got_tok, got_pos))
            want = np.lexsort((want_tok, want_pos))
            same = np.array_equal(got_pos[got], want_pos[want]) and np.array_equal(
                got_tok[got], want_tok[want]
            )
        if not same:
            raise OracleError(
                f"cells differ: llama.cpp {_ranges(got_pos)}, ledger {_ranges(want_pos)}"
            )
        pmin = int(llama_cpp.llama_memory_seq_pos_min(mem, SEQ))
        pmax = int(llama_cpp.llama_memory_seq_pos_max(mem, SEQ))
        want_min = int(want_pos.min()) if len(want_pos) else -1
        want_max = int(want_pos.max()) if len(want_pos) else -1
        if (pmin, pmax) != (want_min, want_max):
            raise OracleError(f"seq_pos_min/max {pmin}/{pmax}, ledger {want_min}/{want_max}")
        if not self.rt.uses_mrope and len(want_pos) and pmax != ledger.next_pos - 1:
            raise OracleError(f"seq_pos_max {pmax} but the ledger's next_pos is {ledger.next_pos}")
        run.counts["checks"] += 1


def _plain_text(item: Item) -> bool:
    return not item.is_media and item.group is None


def _generated(tokens: Sequence[int], message: int) -> Item:
    return Item(len(tokens), len(tokens), message, tuple(tokens), generated=True)


def _head(item: Item, n: int) -> Item:
    return replace(item, num_cells=n, num_positions=n, token_ids=item.token_ids[:n])


def _tail(item: Item, n: int) -> Item:
    rest = item.num_cells - n
    return replace(item, num_cells=rest, num_positions=rest, token_ids=item.token_ids[n:])


def _brief(x: object) -> str:
    if isinstance(x, Shift | Gap):
        return f"{type(x).__name__}({x.p0}..{x.p1}, {x.num_cells_evicted} cells)"
    if isinstance(x, Reprefill):
        return f"Reprefill(keep {len(x.kept)} items, evict {x.num_cells_evicted} cells)"
    if isinstance(x, Admission):
        return f"admitted {len(x.kept)} items, dropped {len(x.dropped)}"
    return repr(x)


def _ranges(pos: np.ndarray) -> str:
    """Compact sorted positions: '0-9,12,12,12,15-20'."""
    if not len(pos):
        return "[]"
    s = np.sort(pos)
    out: list[str] = []
    start = prev = int(s[0])
    for p in map(int, s[1:]):
        if p == prev + 1:
            prev = p
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = p
    out.append(f"{start}-{prev}" if prev != start else f"{start}")
    text = ",".join(out)
    return text if len(text) < 300 else text[:300] + "..."


# -- the boundary --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    capacity: int
    prompt_cells: int
    prompt_positions: int
    generated: int  # generated tokens decoded before the ledger said CannotFit
    rc_after: int  # llama_decode's answer to one more, unguarded token
    rc_last_replayed: int  # the last token before the boundary, decoded unguarded in a replay
    next_pos: int

    @property
    def believed_free_by_positions(self) -> int:
        """What position-based accounting (n_past vs n_ctx) thinks is free at the boundary."""
        return self.capacity - self.next_pos


def stop_exactness(oracle: Oracle, prompt: Sequence[tuple[int, ...] | Picture]) -> Boundary:
    """STOP: generate until the ledger says CannotFit; llama.cpp must agree to the token.

    Run 1 prefills ``prompt`` and generates under STOP until CannotFit, then decodes one more
    token unguarded (it must fail). Run 2 replays the same tokens into a fresh sequence, the
    last one before the boundary unguarded (it must succeed), then one more (it must fail).
    """
    rt = oracle.rt
    spec = RunSpec(-1, "boundary", 0, Policy.STOP, 0, 0.5, EvictionUnit.TOKEN, None, ())
    run = _Run(spec, oracle.new_ledger(Policy.STOP))
    with oracle._fresh(run):
        run.message = 0
        items: list[Item] = []
        for part in prompt:
            if isinstance(part, Picture):
                items += oracle.image_items(run, part, 0)
            else:
                items.append(Item.text(part, 0))
        verdict = run.ledger.admit(items, truncate=False)
        if not isinstance(verdict, Admission) or verdict.dropped:
            raise OracleError(f"the boundary prompt must fit: {verdict}")
        if not oracle.feed(run, items, prefill=True):
            raise OracleError("the boundary prompt met CannotFit")
        prompt_cells = run.ledger.num_cells
        prompt_positions = run.ledger.next_pos
        generated: list[int] = []
        while True:
            token = run.next_token
            assert token is not None
            plan = run.ledger.ensure(1)
            if isinstance(plan, CannotFit):
                break
            if not isinstance(plan, Fits):
                raise OracleError(f"STOP planned {plan}")
            oracle._decode_text(run, Item.text((token,), 0))
            generated.append(token)
        if run.ledger.num_cells != oracle.capacity:
            raise OracleError(f"STOP ended at {run.ledger.num_cells}/{oracle.capacity} cells")
        next_pos = run.ledger.next_pos
        rt.batch.clear()
        rt.batch.add([token], next_pos, SEQ, logits_last=True)
        rc_after = rt.decode()
        oracle.verify(run)  # a failed decode leaves the cells as they were

        # run 2: same sequence, fresh cache; the last token before the boundary goes unguarded
        ledger = run.ledger
        kept = [s.item for s in ledger.segments]
        run.ledger = oracle.new_ledger(Policy.STOP)
        rt.seq_clear(SEQ)
        oracle.verify(run)
        last = kept.pop()
        if not oracle.feed(run, kept, prefill=True):
            raise OracleError("the replay met CannotFit before the boundary")
        if run.ledger.num_free_cells != 1:
            raise OracleError(f"the replay has {run.ledger.num_free_cells} free cells, not 1")
        rt.batch.clear()
        rt.batch.add(last.token_ids, run.ledger.next_pos, SEQ, logits_last=True)
        rc_last = rt.decode()
        if rc_last == 0:
            run.ledger.append(last)
            oracle.verify(run)
            rt.batch.clear()
            rt.batch.add([token], run.ledger.next_pos, SEQ, logits_last=True)
            if rt.decode() == 0:
                raise OracleError("the replay decoded a token past capacity")
            oracle.verify(run)
    return Boundary(
        oracle.capacity,
        prompt_cells,
        prompt_positions,
        len(generated),
        rc_after,
        rc_last,
        next_pos,
    )


def media_boundary(oracle: Oracle, picture: Picture) -> tuple[int, int, int]:
    """An image whose cells exceed the free cells by one fails; one that fits exactly works.

    Returns (image cells, image positions, rc of the unguarded over-full decode: 0 or 1).
    """
    rt = oracle.rt
    spec = RunSpec(-1, "media", 0, Policy.STOP, 0, 0.5, EvictionUnit.TOKEN, None, ())
    outcome = []
    for spare in (-1, 0):
        run = _Run(spec, oracle.new_ledger(Policy.STOP))
        with oracle._fresh(run):
            group = oracle.image_items(run, picture, 0)
            (media,) = [i for i in group if i.is_media]
            if media.num_cells > rt.batch_size:
                raise OracleError("the boundary image must fit one batch")
            filler = oracle.capacity - media.num_cells - spare
            rng = random.Random(filler)
            tokens = tuple(rng.randrange(256) for _ in range(filler))
            for k in range(0, filler, rt.batch_size):
                oracle._decode_text(run, Item.text(tokens[k : k + rt.batch_size], 0))
            plan = run.ledger.ensure(media.num_cells, media.num_positions, group=media.group)
            pos = run.ledger.next_pos
            assert media.media_id is not None
            chunk = run.media[media.media_id].chunk
            embd = oracle.embeddings_of(run, run.media[media.media_id])
            if spare < 0:
                if not isinstance(plan, CannotFit):
                    raise OracleError(f"{run.ledger.num_free_cells} free cells: ensure said {plan}")
                try:
                    rt.decode_media(chunk, embd, pos, SEQ)
                    outcome.append(0)
                except native.NativeError:
                    outcome.append(1)
                oracle.verify(run)
            else:
                if not isinstance(plan, Fits):
                    raise OracleError(f"an image that fits exactly got {plan}")
                end = rt.decode_media(chunk, embd, pos, SEQ)
                if end - pos != media.num_positions:
                    raise OracleError(f"media advanced {end - pos}, not {media.num_positions}")
                run.ledger.append(media)
                oracle.verify(run)
                if run.ledger.num_cells != oracle.capacity:
                    raise OracleError("the exact fit did not fill the sequence")
    return media.num_cells, media.num_positions, outcome[0]


# -- many runs -----------------------------------------------------------------------------------


@dataclass
class Sweep:
    pair: str
    runs: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    policies: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        c = self.counts
        plans = ", ".join(
            f"{k} {c[k]}" for k in ("Fits", "Shift", "Gap", "Reprefill", "CannotFit") if c[k]
        )
        rate = self.seconds / self.runs * 1000 if self.runs else 0.0
        lines = [
            f"{self.pair}: {self.runs} runs in {self.seconds:.1f} s ({rate:.0f} ms/run), "
            f"{len(self.failures)} failed",
            f"  policies: {dict(sorted(self.policies.items()))}",
            f"  decodes {c['decodes']} text + {c['media_decodes']} media "
            f"({c['media_encodes']} encodes), {c['generated']} generated tokens, "
            f"{c['checks']} cell-for-cell checks",
            f"  plans: {plans}; cells evicted {c['cells_evicted']}, "
            f"items re-prefilled {c['reprefilled_items']}",
            f"  requests in a used sequence {c['resends']} ({c['cells_reused']} cells reused "
            f"via common_prefix + truncate + seq_rm)",
            f"  prompts {c['prompts']} ({c['prompts_truncated']} truncated, "
            f"{c['prompts_rejected']} rejected); CannotFit probes {c['full_probes']} "
            f"(all failed in llama.cpp as they must; {c['stop_boundaries']} STOP boundaries "
            f"at exactly capacity)",
        ]
        for seed, msg in self.failures[:5]:
            lines.append(f"  FAILED seed {seed}: {msg.splitlines()[0]}")
        return "\n".join(lines)


class Drivers:
    """One Oracle per (pair, shape), opened on first use."""

    def __init__(self, pairs: dict[str, TinyPair]):
        self.pairs = pairs
        self._open: dict[tuple[str, int], Oracle] = {}

    def get(self, pair: str, shape: int) -> Oracle:
        key = (pair, shape)
        if key not in self._open:
            self._open[key] = Oracle(open_runtime(self.pairs[pair], SHAPES[pair][shape]))
        return self._open[key]

    def close(self) -> None:
        for oracle in self._open.values():
            oracle.close()
            oracle.rt.close()
        self._open.clear()

    def sweep(
        self, pair: str, seeds: Sequence[int], *, keep_going: bool = True, verbose: bool = False
    ) -> Sweep:
        result = Sweep(pair)
        t0 = time.perf_counter()
        for seed in seeds:
            spec = make_spec(pair, seed)
            if verbose:
                print(spec.describe(), flush=True)
            try:
                report = self.get(pair, spec.shape).run(spec)
            except OracleError as e:
                result.failures.append((seed, str(e)))
                if verbose:
                    print(f"FAILED: {e}", flush=True)
                if not keep_going:
                    break
            else:
                result.counts.update(report.counts)
            result.runs += 1
            result.policies[spec.policy.name] += 1
        result.seconds = time.perf_counter() - t0
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per pair (default 200)")
    parser.add_argument("--pair", choices=ALL, action="append", help="default: every pair")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--models", type=Path, help="directory for the tiny models")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    args = parser.parse_args(argv)
    pairs = args.pair or list(ALL)
    with tempfile.TemporaryDirectory() as tmp:
        models = write_tiny_models(args.models or Path(tmp), pairs)
        drivers = Drivers(models)
        failed = 0
        try:
            for pair in pairs:
                seeds = range(args.seed, args.seed + args.runs)
                sweep = drivers.sweep(pair, seeds, verbose=args.verbose)
                print(sweep.summary(), flush=True)
                failed += len(sweep.failures)
                for seed, msg in sweep.failures[:1]:
                    print(f"\nfirst failure, seed {seed}:\n{msg}\n", flush=True)
        finally:
            drivers.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
