"""Sessions: their lifecycle, table, swaps, journal and checkpoints on disk."""
