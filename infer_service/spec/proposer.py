"""What every draft source is to a request: a `Proposer` sees the sequence's tokens as they
come (the prompt, then each token the target emits) and, asked for at most `limit` tokens,
proposes what it expects to follow the last one. Verification is the executor's (each draft
against the target's own sample); a proposer only hears how many of its drafts landed.

A new draft source is a new file with one class (vLLM's `spec_decode/` habit), never a branch
in the executor. Proposers that learn across requests (ngram-mod's pool, the suffix cache) take
their store at construction: the store is the tenant's, so no request drafts from another
tenant's text. Pure: no llama, no grpc.
"""

from __future__ import annotations

from typing import Protocol

NO_TOKEN = -1  # in a history: a media chunk, which no n-gram spans


class Proposer(Protocol):
    """One draft source for one request's sequence."""

    name: str  # llama-server's name of the type (`ngram-mod`, ...), for usage and metrics

    def append(self, token: int) -> None:
        """The history's newest token (NO_TOKEN: a media chunk)."""

    def propose(self, limit: int) -> list[int]:
        """At most `limit` tokens expected after the history's last one ([]: none)."""

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        """How the last proposal fared: its first `num_accepted` tokens were the target's."""

    def close(self) -> None:
        """The request ended: what it gives a store across requests is handed over now."""
