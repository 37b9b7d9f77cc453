"""The cluster run: N sessions over M infer replicas behind nginx for T seconds, a replica
killed (-9) every K seconds and started again.

    python tests/cluster.py --sessions 24 --replicas 3 --seconds 600 --kill-every 30   # documented
    python tests/cluster.py --sessions 4 --replicas 3 --seconds 12 --kill-every 4      # CI's

Every session is a thread that sends image turns through nginx (the tiny mrope pair, one shared
sessions directory). A turn that fails (its replica died under it) is sent again, as an
application would, once the session says it does not hold it. Prints JSON: turns completed,
turns lost (completed but missing from the session afterwards: goal 0), kills, and the failover
time from a kill to the next served turn of a session that was on the killed replica (median,
max).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from clients.client import NO_RETRY, Message, SlotwiseClient, SlotwiseError, collect
from slotwise_core.tiny_models import write_tiny_models
from support.cluster import Cluster
from support.media import image_bytes


class Session(threading.Thread):
    def __init__(self, cluster: Cluster, session_id: str, until: float):
        super().__init__(daemon=True)
        self.cluster, self.session_id, self.until = cluster, session_id, until
        self.completed = 0
        self.retries = 0
        self.served: list[float] = []  # when each turn completed
        self.refusals: Counter[str] = Counter()  # why a turn was sent again
        self.examples: dict[str, str] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with SlotwiseClient(
                self.cluster.prep_address, self.cluster.infer_address, retry=NO_RETRY
            ) as client:
                self._run(client)
        except BaseException as e:
            self.error = e

    def _run(self, client: SlotwiseClient) -> None:
        client.create_session(self.session_id)
        messages: list[Message] = []
        first = 0
        while time.monotonic() < self.until:
            k = self.completed
            sent = [*messages, Message.user(image_bytes(48, 40, seed=k), f"turn {k}?")]
            try:
                prepared = client.prepare(sent, first_message=first)
                done = collect(client.generate(prepared, session_id=self.session_id, max_tokens=4))
            except SlotwiseError as e:
                why = f"{e.code().name} {e.reason or ''}".strip()
                self.refusals[why] += 1
                self.examples.setdefault(why, e.details()[:200])
                if self._holds(client, k + 1):  # it completed; only its report was lost
                    done = None
                else:
                    self.retries += 1
                    time.sleep(0.2)
                    continue
            self.served.append(time.monotonic())
            self.completed += 1
            text = done.text if done is not None else ""
            messages = [*sent, Message.assistant(text or ".")]
            first = len(messages) - 1

    def _holds(self, client: SlotwiseClient, turns: int) -> bool:
        for _ in range(50):
            try:
                return client.get_session(self.session_id).num_turns >= turns
            except SlotwiseError:
                time.sleep(0.2)
        return False


def run(
    *, sessions: int, replicas: int, seconds: float, kill_every: float, seed: int = 0
) -> dict[str, object]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        pair = write_tiny_models(Path(tmp) / "models", ["mrope"])["mrope"]
        cluster = Cluster(pair, Path(tmp) / "cluster", num_infer=replicas).start()
        try:
            until = time.monotonic() + seconds
            threads = [Session(cluster, f"run-{i:03d}", until) for i in range(sessions)]
            for t in threads:
                t.start()
            kills: list[tuple[float, list[str]]] = []  # when, and the sessions it served
            # what each replica held when it (re)started: served since then is what changed
            baseline: dict[str, dict[str, int]] = {p.name: {} for p in cluster.infer}
            start = time.monotonic()
            while (next_kill := start + (len(kills) + 1) * kill_every) < until:
                time.sleep(max(0.0, next_kill - time.monotonic()))  # on a fixed schedule
                served = {  # what each replica served since it (re)started
                    p.name: [s for s, n in cluster.sessions_on(p).items()
                             if baseline[p.name].get(s) != n]
                    for p in cluster.infer if p.alive
                }  # fmt: skip
                busy = [p for p in cluster.infer if served.get(p.name)]
                victim = rng.choice(busy or [p for p in cluster.infer if p.alive])
                homed = served[victim.name]
                victim.stop()  # kill -9
                kills.append((time.monotonic(), homed))
                cluster.restart(victim)
                baseline[victim.name] = cluster.sessions_on(victim)
            for t in threads:
                t.join(seconds + 120)
            with SlotwiseClient(cluster.prep_address, cluster.infer_address) as client:
                held = {t.session_id: client.get_session(t.session_id).num_turns for t in threads}
        finally:
            cluster.close()
    by_id = {t.session_id: t for t in threads}
    failovers = [  # from a kill to the next turn served of each session the victim held
        next(served for served in by_id[sid].served if served > killed) - killed
        for killed, homed in kills
        for sid in homed
        if any(served > killed for served in by_id[sid].served)
    ]
    errors = [repr(t.error) for t in threads if t.error is not None]
    return {
        "sessions": sessions,
        "replicas": replicas,
        "seconds": seconds,
        "kills": len(kills),
        "turns_completed": sum(t.completed for t in threads),
        "turns_lost": sum(max(0, t.completed - held[t.session_id]) for t in threads),
        "turns_retried": sum(t.retries for t in threads),
        "retried_because": dict(sum((t.refusals for t in threads), Counter()).most_common(6)),
        "examples": {k: v for t in threads for k, v in t.examples.items()},
        "failovers": len(failovers),
        "failover_ms_median": round(statistics.median(failovers) * 1000) if failovers else None,
        "failover_ms_max": round(max(failovers) * 1000) if failovers else None,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--kill-every", type=float, default=30)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    figures = run(
        sessions=a.sessions,
        replicas=a.replicas,
        seconds=a.seconds,
        kill_every=a.kill_every,
        seed=a.seed,
    )
    print(json.dumps(figures, indent=2))
    return 0 if figures["turns_lost"] == 0 and not figures["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
