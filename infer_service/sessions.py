"""A session: one conversation's sequence, ledger and options, kept between turns."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from infer_service.ledger import ContextConfig, EvictionUnit, Ledger, Policy
from infer_service.media import MediaHandle
from infer_service.runtime import SamplingConfig
from prep_service.descriptors import Fingerprint


@dataclass(frozen=True)
class Pixels:
    width: int
    height: int
    media_id: str  # the image's content hash (several slices of one image share it)


@dataclass
class Session:
    session_id: str
    context: ContextConfig
    sampling: SamplingConfig
    ledger: Ledger
    media: dict[str, MediaHandle] = field(default_factory=dict)  # media key -> native chunk
    pixels: dict[str, Pixels] = field(default_factory=dict)  # media key -> where its pixels are
    num_turns: int = 0
    num_shifts: int = 0
    slot: int | None = None  # the slot whose sequence holds it, if any
    busy: bool = False  # a turn is running
    # the ledger and shift count of the last completed turn while a turn runs
    snapshot: tuple[list[dict[str, Any]], int] | None = None
    last_used: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        for h in self.media.values():
            h.close()
        self.media.clear()

    def header(self, fingerprint: Fingerprint, layout: dict[str, int]) -> dict[str, Any]:
        """What the session file says besides the KV bytes."""
        c = self.context
        return {
            "fingerprint": asdict(fingerprint),
            "layout": layout,
            "context": {
                "policy": c.policy.value,
                "keep": c.keep,
                "discard_fraction": c.discard_fraction,
                "unit": c.unit.value,
                "truncate_prompt": c.truncate_prompt,
            },
            "sampling": asdict(self.sampling),
            "ledger": self.ledger.to_json(),
            "pixels": {k: asdict(p) for k, p in self.pixels.items()},
            "num_turns": self.num_turns,
            "num_shifts": self.num_shifts,
        }

    @classmethod
    def from_header(cls, session_id: str, header: dict[str, Any], new_ledger: Any) -> Session:
        """Rebuild from a header (KeyError/TypeError/ValueError on a malformed one)."""
        c = header["context"]
        context = ContextConfig(
            policy=Policy(c["policy"]),
            keep=int(c["keep"]),
            discard_fraction=float(c["discard_fraction"]),
            unit=EvictionUnit(c["unit"]),
            truncate_prompt=bool(c["truncate_prompt"]),
        )
        ledger: Ledger = new_ledger(context)
        ledger.load_json(header["ledger"])
        return cls(
            session_id=session_id,
            context=context,
            sampling=SamplingConfig(**header["sampling"]),
            ledger=ledger,
            pixels={k: Pixels(**p) for k, p in header["pixels"].items()},
            num_turns=int(header["num_turns"]),
            num_shifts=int(header["num_shifts"]),
        )
