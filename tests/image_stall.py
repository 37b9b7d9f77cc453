"""The image prefill stall: stream A generates text while client B sends a 1000x1000 JPEG
through a projector heavy enough to cost what a real one does.

    python tests/image_stall.py --vision-width 512 --vision-layers 8

A thin wrapper of `slotwise bench --only stall` (benchmarks/stall.py has the measurement); any
of the bench's options pass through, e.g. `--repeats 1`, `--llama-server PATH`, `--encode-threads
N`. Prints B's time to first token against A's longest gap between two tokens while B waited
(goal <= 0.05), and A's tokens/s during B's wait against without it (goal >= 0.5).
"""

from __future__ import annotations

import sys

from benchmarks import bench


def main(argv: list[str] | None = None) -> int:
    return bench.main(["--only", "stall", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
