"""A slot's sampler: llama.cpp's sampler chain, plus a grammar, logit biases and
log-probabilities when the request asks for them.

A grammar is its own llama.cpp sampler beside the chain (as llama-server's common_sampler
keeps it): the chain samples first, and only when its token breaks the grammar is the
grammar applied to the whole vocabulary and the chain run again, so a constrained request
costs one single-token check on most steps.

llama.cpp's grammar code throws C++ exceptions (and aborts on an end-of-generation token the
grammar does not allow) when it is fed a token it rejects; across ctypes that ends the
process. So a token reaches the grammar's `accept` only after `apply` allowed it, and lazy
grammars wait for their trigger here, in Python: until then the text is free; once a trigger
pattern is found in it, the text from the match is fed to the grammar token by token, each
checked first, and a mismatch ends the generation like a grammar with no way on.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import llama_cpp
import numpy as np
import re2

from infer_service.events import TokenChoice, TokenLogprobs
from infer_service.runner.grammar_worker import GrammarTooCostly, GrammarWorker
from infer_service.runner.runtime import Runtime, SamplingConfig
from infer_service.runner.text_stream import utf8_tail
from slotwise_core.grammar_limits import LimitError, check_grammar
from slotwise_core.json_grammar import json_schema_to_gbnf
from slotwise_core.limits import MAX_TOP_LOGPROBS
from slotwise_core.native import NativeError

T = TypeVar("T")

MAX_LOGIT_BIAS = 1024  # entries: OpenAI allows 300
MAX_TRIGGER_PATTERNS = 16
MAX_TRIGGER_LENGTH = 256  # characters of a pattern
_TRIGGER_MEMORY = 1 << 20  # bytes RE2 may spend on one pattern's program
_TRIGGER_REACH = 512  # characters before a token's text that a match may begin in

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class ConstraintError(ValueError):
    """A grammar, schema, pattern or bias that can never work (field: the one at fault)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class GrammarDeadEnd(Exception):
    """No token of the vocabulary continues the grammar, and it may not end here."""


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its text to: GBNF (a JSON schema already converted) and, for
    a lazy grammar, the patterns that switch it on."""

    grammar: str
    trigger_patterns: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplerSpec:
    """Everything a slot's sampler is built from (checked before the request is queued)."""

    sampling: SamplingConfig = SamplingConfig()
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None  # None: no log-probabilities


def json_schema_grammar(schema: str) -> str:
    """A JSON Schema (text) -> GBNF (slotwise_core/json_grammar.py)."""
    try:
        return json_schema_to_gbnf(schema)
    except LimitError as e:
        raise ConstraintError(str(e), "constraint.json_schema") from None
    except RecursionError:
        raise ConstraintError("json_schema: nested too deeply", "constraint.json_schema") from None
    except Exception as e:  # the converter's own assertions and lookups: a schema it refuses
        raise ConstraintError(
            f"json_schema: not a schema this server can follow: {e!r}", "constraint.json_schema"
        ) from None


def check_spec(rt: Runtime, spec: SamplerSpec) -> None:
    """Refuse what can never work: a grammar llama.cpp does not parse, a pattern that is not
    a regular expression, a biased token outside the vocabulary."""
    for token, bias in spec.logit_bias:
        if not 0 <= token < rt.num_vocab:
            raise ConstraintError(
                f"logit_bias: token id {token} is outside the vocabulary [0, {rt.num_vocab})",
                "logit_bias",
            )
        if not (-100.0 <= bias <= 100.0 or bias == -math.inf):  # NaN fails too
            raise ConstraintError(
                f"logit_bias: {bias} is outside [-100, 100] (or -infinity: banned)", "logit_bias"
            )
    if len(spec.logit_bias) > MAX_LOGIT_BIAS:
        raise ConstraintError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    if spec.top_logprobs is not None and not 0 <= spec.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ConstraintError(f"top_logprobs: at most {MAX_TOP_LOGPROBS}", "top_logprobs")
    c = spec.constraint
    if c is None:
        return
    if len(c.trigger_patterns) > MAX_TRIGGER_PATTERNS:
        raise ConstraintError(
            f"at most {MAX_TRIGGER_PATTERNS} trigger patterns", "constraint.trigger_patterns"
        )
    for p in c.trigger_patterns:
        if len(p) > MAX_TRIGGER_LENGTH:
            raise ConstraintError(
                f"a trigger pattern of at most {MAX_TRIGGER_LENGTH} characters",
                "constraint.trigger_patterns",
            )
        _compile(p)
    try:
        check_grammar(c.grammar)
    except LimitError as e:
        raise ConstraintError(str(e), "constraint.grammar") from None
    if not _PARSES.parses(rt, c.grammar, rt.config.grammar_ms / 1000):
        raise ConstraintError(
            "grammar: llama.cpp could not parse it (see its GBNF format), or it has no "
            "`root` rule, or a rule is left-recursive",
            "constraint.grammar",
        )


class _Parses:
    """Grammars parsed before their request is queued, each on a thread of its own under the
    budget: llama.cpp expands a grammar's first parse stacks as it builds it, and an
    ambiguous one of a few hundred bytes takes seconds to hours (18 s for 414 bytes). A parse
    past the budget is GrammarTooCostly, and its thread frees what it made once done; while
    `max_late` such threads run, new grammars are refused at once."""

    def __init__(self, max_late: int = 4):
        self.max_late = max_late
        self._lock = threading.Lock()
        self._late = 0

    def parses(self, rt: Runtime, gbnf: str, budget: float) -> bool:
        with self._lock:
            if self._late >= self.max_late:
                raise GrammarTooCostly(budget)
        made = _Made()
        done = threading.Event()
        late = False

        def parse() -> None:
            nonlocal late
            with contextlib.suppress(NativeError), rt.borrowed():
                made.keep(rt.grammar_sampler(gbnf))
            with self._lock:
                done.set()
                if late:
                    self._late -= 1
            if made.made:
                made.free_with(rt)()

        threading.Thread(target=parse, name="grammar-check", daemon=True).start()
        if not done.wait(budget):
            with self._lock:
                if not done.is_set():
                    late = True
                    self._late += 1
                    raise GrammarTooCostly(budget)
        return bool(made.made)


_PARSES = _Parses()


def _compile(pattern: str) -> Any:
    """A trigger pattern in RE2, which matches in time linear in the text (Python's `re`, and
    llama.cpp's std::regex, backtrack: `(.*.*)*X` froze the engine thread for minutes)."""
    options = re2.Options()
    options.dot_nl = True
    options.max_mem = _TRIGGER_MEMORY
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else e
        raise ConstraintError(
            f"trigger pattern {pattern!r}: {why} (patterns are RE2: no backreferences or "
            "lookaround)",
            "constraint.trigger_patterns",
        ) from None


class SlotSampler:
    """One request's sampling state. Engine thread only; `close` frees the native samplers.

    The grammar's calls run on `worker` (infer_service/runner/grammar_worker.py), each under
    the budget; the engine thread hands them copies of the logits, never the context's own.
    """

    def __init__(
        self, rt: Runtime, spec: SamplerSpec, worker: GrammarWorker | None = None, owner: str = ""
    ):
        self.runtime = rt
        c = spec.constraint
        # (the patterns first: a refusal then leaves nothing native behind)
        self._triggers = tuple(_compile(p) for p in c.trigger_patterns) if c else ()
        self.chain: Any = rt.sampler(spec.sampling, spec.logit_bias)  # a llama_sampler pointer
        self.grammar: Any = None  # a llama_sampler pointer
        self.top_logprobs = spec.top_logprobs
        self._own_worker = worker is None
        self._worker = worker or GrammarWorker()
        self._owner = owner  # whose calls these are (the worker counts stuck ones per owner)
        self._budget = rt.config.grammar_ms / 1000
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # a lazy grammar's text before its trigger
        if c is not None:
            # llama.cpp expands a grammar's first parse stacks as it builds it: on the worker too
            made = _Made()
            try:
                self.grammar = self._worker.run(
                    _borrowing(rt, lambda: made.keep(rt.grammar_sampler(c.grammar))),
                    self._budget, made.free_with(rt), owner=owner,
                )  # fmt: skip
            except GrammarTooCostly:
                self.close()
                raise
            if not self.grammar:  # (checked before queueing: only if llama.cpp changed its mind)
                self.close()
                raise ConstraintError("grammar: llama.cpp refused it", "constraint.grammar")
            self._cur = np.zeros(rt.num_vocab, dtype=_TOKEN_DATA)
            self._ids = np.arange(rt.num_vocab, dtype=np.int32)  # cur's index is the token id
            self._utf8 = b""  # the unfinished character at the end of the text

    def close(self) -> None:
        for s in (self.chain, self.grammar):
            if s:
                self.runtime.free_sampler(s)
        self.chain = self.grammar = None
        if self._own_worker:
            self._worker.close()

    @property
    def awaiting_trigger(self) -> bool:
        return bool(self._triggers)

    def sample(self, index: int, *, free: bool = False) -> tuple[int, TokenLogprobs | None]:
        """The next token from the logits at batch index `index`, with its log-probabilities
        when asked; raises GrammarDeadEnd when the grammar allows nothing, GrammarTooCostly
        when following it took longer than the budget. `free`: a reasoning model's thought,
        which no grammar constrains nor a trigger starts (as llama-server has it): the
        grammar holds from the first token after it."""
        if not self.grammar or self.awaiting_trigger or free:
            token = self.runtime.sample(self.chain, index)
            if self._triggers and not free:
                self._watch_for_trigger(token)
        else:
            cur = self._cur
            cur["id"], cur["logit"], cur["p"] = self._ids, self.runtime.logits(index), 0.0
            follow = _Following(self.runtime, self.chain, self.grammar, self._utf8)
            token = self._on_worker(lambda: follow.constrained(cur), follow)
            self._utf8 = follow.utf8
        return token, self._logprobs(index, token) if self.top_logprobs is not None else None

    def force(self, index: int, token: int) -> tuple[int, TokenLogprobs | None]:
        """`token` next, in place of a sample (a thought's end past its budget): the chain
        is applied with every other logit at -inf, as llama.cpp's budget sampler has it (its
        random state advances as there), and accepts it. A thought is free text: no grammar
        holds it (the executor opens none where one does), and none is fed."""
        cur = np.zeros(self.runtime.num_vocab, dtype=_TOKEN_DATA)
        cur["id"], cur["logit"] = np.arange(self.runtime.num_vocab, dtype=np.int32), -np.inf
        cur["logit"][token] = self.runtime.logits(index)[token]
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(_array(cur)))
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token, self._logprobs(index, token) if self.top_logprobs is not None else None

    # -- grammar ------------------------------------------------------------------------------

    def _on_worker(self, fn: Callable[[], T], follow: _Following) -> T:
        """fn on the grammar worker, the runtime borrowed (a call left running past the budget
        keeps the model from being freed under it). fn reads only `follow`, never this
        sampler: past the budget the engine lets go of it while fn goes on, and the worker
        frees the native samplers once fn is done."""
        rt = self.runtime

        def abandon() -> None:
            with contextlib.suppress(NativeError), rt.borrowed():  # (closed: nothing to free)
                for s in (follow.chain, follow.grammar):
                    rt.free_sampler(s)

        try:
            return self._worker.run(_borrowing(rt, fn), self._budget, abandon, owner=self._owner)
        except GrammarTooCostly:
            self.chain = self.grammar = None  # (the worker's to free now)
            raise

    def _watch_for_trigger(self, token: int) -> None:
        """A lazy grammar: once a trigger is found in the text, the grammar takes over from
        the match, fed with that text's tokens (each one checked before it is accepted).

        Only the text's tail is searched again, and kept, each token (a match ends in what
        is new): the cost per token stays bounded however long the free text grows.
        """
        if self.runtime.is_eog(token):
            return
        new = self._decoder.decode(self.runtime.piece(token))
        if not new:
            return
        text = self._text + new
        if len(text) > 4 * _TRIGGER_REACH:  # keep what a match may still begin in (a ^ can
            text = text[-2 * _TRIGGER_REACH :]  # match only where the search starts past 0)
        self._text = text
        tail = max(0, len(text) - len(new) - _TRIGGER_REACH)
        starts = [_start(m) for p in self._triggers if (m := p.search(text, tail))]
        if not starts:
            return
        self._triggers, self._text = (), ""
        matched = text[min(starts) :]
        follow = _Following(self.runtime, self.chain, self.grammar, b"")
        self._on_worker(lambda: follow.take(self.runtime.tokenize(matched)), follow)
        self._utf8 = utf8_tail(b"", matched.encode()) or b""

    # -- log-probabilities --------------------------------------------------------------------

    def _logprobs(self, index: int, token: int) -> TokenLogprobs:
        logits = self.runtime.logits(index).astype(np.float64)
        m = float(logits.max())
        log_z = m + float(np.log(np.exp(logits - m).sum()))

        def choice(t: int) -> TokenChoice:
            return TokenChoice(t, self.runtime.piece(t), float(logits[t] - log_z))

        top: tuple[TokenChoice, ...] = ()
        k = self.top_logprobs or 0
        if k:
            best = np.argpartition(-logits, k - 1)[:k]
            top = tuple(choice(int(t)) for t in best[np.argsort(-logits[best], kind="stable")])
        return TokenLogprobs(choice(token), top)


class _Following:
    """What one grammar call on the worker works with: the natives and the text's unfinished
    character as the call began (the sampler may be gone by the time it ends)."""

    def __init__(self, rt: Runtime, chain: Any, grammar: Any, utf8: bytes):
        self.runtime, self.chain, self.grammar, self.utf8 = rt, chain, grammar, utf8
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    def constrained(self, cur: np.ndarray) -> int:
        """The chain's choice if the grammar allows it, else the chain's choice among what
        the grammar allows."""
        token = self._chosen(cur.copy())  # (the chain sorts and cuts what it is given)
        if not (self.allows(token) and self._utf8_ok(token)):  # choose again, allowed only
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(_array(cur)))
            while True:
                if not np.isfinite(cur["logit"]).any():
                    raise GrammarDeadEnd
                token = self._chosen(cur.copy())
                # (what the grammar refused is -inf: a chain that picked one anyway must not
                # reach the grammar's accept, which would throw)
                if np.isfinite(cur["logit"][token]) and self._utf8_ok(token):
                    break
                cur["logit"][token] = -np.inf
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        if not self.runtime.is_eog(token):
            self.utf8 = utf8_tail(self.utf8, self.runtime.piece(token)) or b""
        return token

    def _chosen(self, work: np.ndarray) -> int:
        arr = _array(work)
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(arr))
        if not 0 <= arr.selected < len(work):
            raise RuntimeError(f"the sampler chain selected no token ({arr.selected})")
        return int(arr.data[arr.selected].id)

    def _utf8_ok(self, token: int) -> bool:
        """Whether the token keeps the text well-formed UTF-8. The grammar sees code points:
        bytes that make none (an overlong form, a lone surrogate) would pass it, yet read as
        something else to every client."""
        return (
            self.runtime.is_eog(token)
            or utf8_tail(self.utf8, self.runtime.piece(token)) is not None
        )

    def allows(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(_array(one)))
        return bool(np.isfinite(one["logit"][0]))

    def take(self, tokens: list[int]) -> None:
        """The trigger's text into the grammar, each token checked first."""
        for t in tokens:
            if not self.allows(t):
                raise GrammarDeadEnd
            llama_cpp.llama_sampler_accept(self.grammar, t)


class _Made:
    """A grammar sampler built on the worker: the engine's once built in time, the worker's to
    free when the build ran past the budget."""

    def __init__(self) -> None:
        self.made: Any = None

    def keep(self, made: Any) -> Any:
        self.made = made
        return made

    def free_with(self, rt: Runtime) -> Callable[[], None]:
        def free() -> None:
            with contextlib.suppress(NativeError), rt.borrowed():
                if self.made:
                    rt.free_sampler(self.made)

        return free


def _borrowing(rt: Runtime, fn: Callable[[], T]) -> Callable[[], T]:
    def borrowing() -> T:
        with rt.borrowed():
            return fn()

    return borrowing


def _start(m: Any) -> int:
    """Where a trigger's grammar text begins: its first capturing group, else the match."""
    for i in range(1, (m.re.groups or 0) + 1):
        if m.group(i):
            return m.start(i)
    return m.start()


def _array(data: np.ndarray) -> llama_cpp.llama_token_data_array:
    return llama_cpp.llama_token_data_array(
        data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
        size=len(data),
        selected=-1,
        sorted=False,
    )
