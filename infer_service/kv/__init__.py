"""The KV cache as slotwise counts it: the ledger, the pool, its pictures, the host cache
of sequences that lost their slot. Pure Python."""
