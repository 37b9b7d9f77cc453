"""The shift section of slotwise bench: long generations (--shift-tokens) in a slot too small
for them (--shift-ctx cells), so the context shifts; streamed tokens/s with each shift policy
(SHIFT, GAP, REPREFILL; keep --shift-keep, discard_fraction 0.5) against the same generation in
a slot with room for all of it (no shift).
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.calls import PROMPTS, SHIFT_POLICIES, generate, prepare_text, prompt_tokens
from benchmarks.harness import Bench
from benchmarks.results import Stream, compared, streamed_rate
from slotwise.v1 import infer_pb2

ROW_SHIFT = {
    "SHIFT": "shifts tok/s: SHIFT / no shift",
    "GAP": "shifts tok/s: GAP / no shift",
    "REPREFILL": "shifts tok/s: REPREFILL / no shift",
}
SHIFT_TARGETS = {"SHIFT": 0.90, "GAP": 0.90, "REPREFILL": 0.60}


def run(b: Bench) -> None:
    """Each policy in the small slot and no shift in the large one, interleaved."""
    o = b.o
    prompt = prepare_text(b.prep, PROMPTS[1])
    n_prompt = len(prompt_tokens(prompt))
    big = -(-(n_prompt + o.shift_tokens + 64) // 256) * 256  # room for all: no shift
    with (
        b.infer(ctx=o.shift_ctx, parallel=1) as small,
        b.infer(ctx=big, parallel=1) as large,
    ):
        last: dict[str, Stream] = {}

        def measure(name: str) -> Callable[[], float]:
            def fn() -> float:
                if name == "none":
                    s = generate(large, prompt, o.shift_tokens, policy=infer_pb2.SHIFT_POLICY_STOP)
                else:
                    s = generate(
                        small, prompt, o.shift_tokens, policy=SHIFT_POLICIES[name],
                        keep=o.shift_keep, discard_fraction=0.5,
                    )  # fmt: skip
                last[name] = s
                return streamed_rate([s])

            return fn

        runs = {name: measure(name) for name in ("none", *SHIFT_POLICIES)}
        res = b.interleaved(runs, o.repeats)
        for name in SHIFT_POLICIES:
            s = last[name]
            used = sorted(set(s.shifts))
            note = (
                f"ctx {o.shift_ctx} vs {big}, {s.num_tokens} tokens (no shift: "
                f"{last['none'].num_tokens}), {len(s.shifts)} shifts"
                + (f" by {'/'.join(used)}" if used else "")
                + f", keep {o.shift_keep}, discard_fraction 0.5"
            )
            if not s.shifts:
                note += "; NO SHIFT HAPPENED (generation ended early?)"
            elif used != [name]:
                note += f"; the server used {used}, not {name}"
            target = f">= {SHIFT_TARGETS[name]:.2f}"
            b.rows.append(compared(ROW_SHIFT[name], res[name], res["none"], "tok/s", target, note))
