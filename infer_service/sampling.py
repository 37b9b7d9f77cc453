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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import llama_cpp
import numpy as np
import re2

from infer_service.events import TokenChoice, TokenLogprobs
from infer_service.grammar_lane import GrammarLane, GrammarTooCostly
from infer_service.runtime import Runtime, SamplingConfig
from infer_service.text_stream import utf8_tail
from slotwise_core.grammar_limits import LimitError, check_grammar
from slotwise_core.json_grammar import json_schema_to_gbnf
from slotwise_core.native import NativeError

T = TypeVar("T")

MAX_TOP_LOGPROBS = 20
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
        if not -100.0 <= bias <= 100.0:  # NaN fails too
            raise ConstraintError(f"logit_bias: {bias} is outside [-100, 100]", "logit_bias")
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
    grammar = rt.grammar_sampler(c.grammar)
    if not grammar:
        raise ConstraintError(
            "grammar: llama.cpp could not parse it (see its GBNF format), or it has no "
            "`root` rule, or a rule is left-recursive",
            "constraint.grammar",
        )
    rt.free_sampler(grammar)


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

    The grammar's calls run on `lane` (infer_service/grammar_lane.py), each under the
    budget; the engine thread hands them copies of the logits, never the context's own.
    """

    def __init__(self, rt: Runtime, spec: SamplerSpec, lane: GrammarLane | None = None):
        self.rt = rt
        c = spec.constraint
        # (the patterns first: a refusal then leaves nothing native behind)
        self._triggers = tuple(_compile(p) for p in c.trigger_patterns) if c else ()
        self.chain: Any = rt.sampler(spec.sampling, spec.logit_bias)  # a llama_sampler pointer
        self.grammar: Any = None  # a llama_sampler pointer
        self.top_logprobs = spec.top_logprobs
        self._lane = lane or GrammarLane()
        self._budget = rt.config.grammar_ms / 1000
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # a lazy grammar's text before its trigger
        if c is not None:
            self.grammar = rt.grammar_sampler(c.grammar)
            if not self.grammar:  # (checked before queueing: only if llama.cpp changed its mind)
                self.close()
                raise ConstraintError("grammar: llama.cpp refused it", "constraint.grammar")
            self._cur = np.zeros(rt.num_vocab, dtype=_TOKEN_DATA)
            self._ids = np.arange(rt.num_vocab, dtype=np.int32)  # cur's index is the token id
            self._one = np.zeros(1, dtype=_TOKEN_DATA)
            self._utf8 = b""  # the unfinished character at the end of the text

    def close(self) -> None:
        for s in (self.chain, self.grammar):
            if s:
                self.rt.free_sampler(s)
        self.chain = self.grammar = None

    @property
    def awaiting_trigger(self) -> bool:
        return bool(self._triggers)

    def sample(self, index: int) -> tuple[int, TokenLogprobs | None]:
        """The next token from the logits at batch index `index`, with its log-probabilities
        when asked; raises GrammarDeadEnd when the grammar allows nothing, GrammarTooCostly
        when following it took longer than the budget."""
        if not self.grammar or self.awaiting_trigger:
            token = self.rt.sample(self.chain, index)
            if self._triggers:
                self._watch_for_trigger(token)
        else:
            cur = self._cur
            cur["id"], cur["logit"], cur["p"] = self._ids, self.rt.logits(index), 0.0
            token = self._on_lane(lambda: self._constrained(cur))
        return token, self._logprobs(index, token) if self.top_logprobs is not None else None

    # -- grammar ------------------------------------------------------------------------------

    def _on_lane(self, fn: Callable[[], T]) -> T:
        """fn on the grammar lane, the runtime borrowed (a call left running past the budget
        keeps the model from being freed under it); past the budget this sampler is the
        lane's to free."""
        natives, rt = (self.chain, self.grammar), self.rt

        def borrowing() -> T:
            with rt.borrowed():
                return fn()

        def abandon() -> None:
            with contextlib.suppress(NativeError), rt.borrowed():  # (closed: nothing to free)
                for s in natives:
                    rt.free_sampler(s)

        try:
            return self._lane.run(borrowing, self._budget, abandon)
        except GrammarTooCostly:
            self.chain = self.grammar = None  # (close must not free them under the call)
            raise

    def _constrained(self, cur: np.ndarray) -> int:
        """(on the lane) The chain's choice if the grammar allows it, else the chain's choice
        among what the grammar allows."""
        work = cur.copy()  # the chain sorts and cuts (top-k) what it is given
        arr = _array(work)
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(arr))
        token = int(arr.data[arr.selected].id)
        if not (self._allows(token) and self._utf8_ok(token)):  # choose again, allowed only
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(_array(cur)))
            while True:
                if not np.isfinite(cur["logit"]).any():
                    raise GrammarDeadEnd
                work = cur.copy()
                arr = _array(work)
                llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(arr))
                token = int(arr.data[arr.selected].id)
                # (what the grammar refused is -inf: a chain that picked one anyway must not
                # reach the grammar's accept, which would throw)
                if np.isfinite(cur["logit"][token]) and self._utf8_ok(token):
                    break
                cur["logit"][token] = -np.inf
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        if not self.rt.is_eog(token):
            self._utf8 = utf8_tail(self._utf8, self.rt.piece(token)) or b""
        return token

    def _utf8_ok(self, token: int) -> bool:
        """Whether the token keeps the text well-formed UTF-8. The grammar sees code points:
        bytes that make none (an overlong form, a lone surrogate) would pass it, yet read as
        something else to every client."""
        return self.rt.is_eog(token) or utf8_tail(self._utf8, self.rt.piece(token)) is not None

    def _allows(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        arr = _array(one)
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(arr))
        return bool(np.isfinite(one["logit"][0]))

    def _watch_for_trigger(self, token: int) -> None:
        """A lazy grammar: once a trigger is found in the text, the grammar takes over from
        the match, fed with that text's tokens (each one checked before it is accepted).

        Only the text's tail is searched again, and kept, each token (a match ends in what
        is new): the cost per token stays bounded however long the free text grows.
        """
        if self.rt.is_eog(token):
            return
        new = self._decoder.decode(self.rt.piece(token))
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
        self._on_lane(lambda: self._take(self.rt.tokenize(matched)))
        self._utf8 = utf8_tail(b"", matched.encode()) or b""

    def _take(self, tokens: list[int]) -> None:
        """(on the lane) The trigger's text into the grammar, each token checked first."""
        for t in tokens:
            if not self._allows(t):
                raise GrammarDeadEnd
            llama_cpp.llama_sampler_accept(self.grammar, t)

    # -- log-probabilities --------------------------------------------------------------------

    def _logprobs(self, index: int, token: int) -> TokenLogprobs:
        logits = self.rt.logits(index).astype(np.float64)
        m = float(logits.max())
        log_z = m + float(np.log(np.exp(logits - m).sum()))

        def choice(t: int) -> TokenChoice:
            return TokenChoice(t, self.rt.piece(t), float(logits[t] - log_z))

        top: tuple[TokenChoice, ...] = ()
        k = self.top_logprobs or 0
        if k:
            best = np.argpartition(-logits, k - 1)[:k]
            top = tuple(choice(int(t)) for t in best[np.argsort(-logits[best], kind="stable")])
        return TokenLogprobs(choice(token), top)


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
