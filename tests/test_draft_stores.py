"""What drafts learn across requests belongs to a tenant: the suffix cache drafts a tenant's
earlier reply when it comes again, and never another tenant's (a draft that lands is faster:
its timing would tell one tenant what another wrote). Real servers on one keys file, the real
client library; the usage counts each type's drafts and the cache's hits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from test_tenants import ACME, GLOBEX, tenancy  # noqa: F401 (the fixture)

from clients.client import Finished, Message, collect
from clients.types import Constraint, Speculative
from slotwise_core.tiny_models import token_id

NO_END = {token_id(t): -100.0 for t in ("<|im_end|>", "<|endoftext|>")}
# a tool call an agent loop makes again and again: the same JSON each time
TOOL_CALL = 'root ::= "{\\"name\\": \\"read_file\\", \\"path\\": \\"src/" [a-e]+ ".py\\"}"'


def _suffix_drafted(client: Any, **options: Any) -> tuple[list[int], dict[str, Any]]:
    events = list(
        client.generate(
            [Message.user("Read the file again.")],
            max_tokens=40,
            temperature=0.0,
            logit_bias=NO_END,
            constraint=Constraint(grammar=TOOL_CALL),
            speculative=Speculative("suffix"),
            **options,
        )
    )
    end = next(e for e in events if isinstance(e, Finished))
    counts = {str(d.type): d for d in end.usage.drafts_by_type}
    return collect(iter(events)).token_ids, counts


def test_no_tenant_drafts_from_another_tenant_s_text(tenancy: Callable[..., Any]) -> None:  # noqa: F811
    t = tenancy()
    acme, globex = t.client(ACME), t.client(GLOBEX)
    first, counts = _suffix_drafted(acme)
    assert "suffix" not in counts or counts["suffix"].num_cache_hits == 0  # (nothing said yet)
    again, counts = _suffix_drafted(acme)
    assert again == first
    assert counts["suffix"].num_cache_hits > 0  # its own earlier call, drafted
    assert counts["suffix"].num_accepted_tokens > 0
    theirs, counts = _suffix_drafted(globex)  # the same call, from another tenant
    assert theirs == first
    assert "suffix" not in counts or counts["suffix"].num_cache_hits == 0
    # a salt narrows it as it narrows KV reuse: one tenant's users, each a salt of their own
    salted, counts = _suffix_drafted(acme, cache_salt="user-2")
    assert salted == first
    assert "suffix" not in counts or counts["suffix"].num_cache_hits == 0
