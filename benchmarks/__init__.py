"""Benchmarks: ratios measured within one run (`slotwise bench`, BENCHMARKS.md)."""
