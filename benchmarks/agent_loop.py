"""The agent section of slotwise bench: an agent loop whose tool calls come back request after
request, with the suffix cache (drafts from the tenant's earlier prompts and replies) against
drafts from the request's own text alone, and a second tenant that must draft nothing from
the first's.

Each of the 20 turns is a request of its own (an agent that keeps only the latest observation
in its context, as loops that summarise do): a short task, and a reply held by a grammar to
the loop's tool call, a JSON of an edit whose file and text are the same every turn, with a
short free part (the model's own letters). What the request itself holds never contains the
call, so in-request lookup (ngram-simple) has nothing to copy; the cache has every earlier
call. Greedy, one compute thread, the wide random model the bench writes (or --model).

- tok/s of the 20 turns with the cache (`ngram-simple,suffix`) over without (`ngram-simple`);
- the same 20 turns as a second tenant after the first: its first turn's drafts from the
  cache must be 0 (the first tenant's calls are not its own; its later turns draw on its own).
"""

from __future__ import annotations

import statistics

from benchmarks.calls import generate, prepare_text
from benchmarks.harness import Bench
from benchmarks.results import Row, Stream, compared, streamed_rate
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2_grpc
from slotwise_core.tiny_models import Text, write_text_model

TURNS = 20
WIDE = Text(width=256, ff=1024, layers=8, heads=8, kv_heads=2)
CALL = (
    '{"name": "edit_file", "arguments": {"path": "src/slotwise/engine/loop.py", '
    '"old": "    return self.step(plan)", "new": "    outcome = self.step(plan)\\n'
    '    return outcome", "note": "'
)
GRAMMAR = (
    "root ::= " + '"' + CALL.replace("\\", "\\\\").replace('"', '\\"') + '" [a-z ]{4,12} "\\"}}"'
)
ROW = "agent loop, 20 turns: tok/s suffix cache / in-request drafts"
ROW_TENANT = "agent loop: cache drafts for a tenant from another's text"
KEYS = "acme key-of-acme\nglobex key-of-globex\n"


def task(k: int) -> str:
    return f"Step {k} of the refactor: apply the edit again and report."


def run(b: Bench) -> None:
    model = b.o.model or write_text_model(b.log_dir / "wide.gguf", WIDE, seed=1)
    keys = b.log_dir / "agent-keys"
    keys.write_text(KEYS)
    prep_svc = b.service("prep_service", ["--model", str(model), "--token-file", str(keys)])
    try:
        prep = prep_pb2_grpc.PrepServiceStub(prep_svc.channel)
        auth = (("authorization", "Bearer key-of-acme"),)
        prompts = [prepare_text(prep, task(k), metadata=auth) for k in range(TURNS)]
    finally:
        prep_svc.stop()
    extra = ["--token-file", str(keys)]
    rates: dict[str, list[float]] = {}
    hits: dict[str, int] = {}
    for label, types in (("in-request", "ngram-simple"), ("cache", "ngram-simple,suffix")):
        args = ["--model", str(model), "--threads", str(b.o.threads), "--threads-batch",
                str(b.o.threads), "--ctx-size", "1024", *extra]  # fmt: skip
        svc = b.service("infer_service", args)  # (b.infer's first call carries no key)
        try:
            infer = infer_pb2_grpc.InferServiceStub(svc.channel)
            streams = [_turn(infer, p, types, "acme") for p in prompts]
            rates[label] = [streamed_rate([s]) for s in streams[1:]]  # (the first: cold)
            hits[label] = sum(s.cache_hits for s in streams)
            if label == "cache":
                other = [_turn(infer, p, types, "globex") for p in prompts]
                hits["globex"] = other[0].cache_hits  # (before it said anything itself)
                hits["globex later"] = sum(s.cache_hits for s in other[1:])
                hits["acme second"] = streams[1].cache_hits
        finally:
            svc.stop()
        b.log(f"agent {label}: median {statistics.median(rates[label]):.0f} tok/s, "
              f"cache hits {hits[label]}")  # fmt: skip
    note = (
        f"median of turns 2-{TURNS}; cache hits {hits['cache']} (in-request run: "
        f"{hits['in-request']})"
    )
    b.rows.append(
        compared(ROW, [statistics.median(rates["cache"])], [statistics.median(rates["in-request"])],
                 "tok/s", ">= 1.3", note)
    )  # fmt: skip
    b.rows.append(
        Row(ROW_TENANT, float(hits["globex"]), "drafts", target="== 0",
            note="the second tenant's first turn, the same call the first tenant made 20 "
            f"times: drafts from the cache (the first tenant's second turn: "
            f"{hits['acme second']}; the second tenant's turns 2-{TURNS}, from its own: "
            f"{hits['globex later']})")
    )  # fmt: skip


def _turn(
    infer: infer_pb2_grpc.InferServiceStub, prompt: object, types: str, tenant: str
) -> Stream:
    kinds = [
        infer_pb2.SpecType.Value("SPEC_TYPE_" + t.upper().replace("-", "_"))
        for t in types.split(",")
    ]
    return generate(
        infer, prompt, 256, speculative=infer_pb2.SpeculativeOptions(types=kinds),
        grammar=GRAMMAR, metadata=(("authorization", f"Bearer key-of-{tenant}"),),
    )  # fmt: skip
