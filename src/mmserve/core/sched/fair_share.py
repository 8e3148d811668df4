"""Fair shares of the seats between clients: the order waiting requests are admitted in, and the
order running ones are preempted in (the reverse).

Every request carries its client's `owner` key (the front end's digest of the caller's credentials;
one shared default where a door knows no caller, so there nothing changes). Within a priority, a
client's k-th request in its own order ranks as if `served[owner] + k` of its requests went first:
a new client's first request goes ahead of the 150th of a client with 200 queued, and each
client's own requests keep their order (FCFS, or priority then FCFS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mmserve.request import Request


def interleave(requests: Sequence[Request], served: Mapping[bytes, int] | None = None, *,
               by_priority: bool = False) -> list[Request]:
    """`requests` (in the scheduler's order: FCFS, or priority then FCFS) reordered so owners take
    turns: sorted by (priority if `by_priority`, the owner's rank, position). `served`: how many
    requests each owner already has ahead of all of these (its running ones, for the waiting queue)."""
    if len({r.owner for r in requests}) <= 1:
        return list(requests)   # one client: its own order
    ranks = dict(served or {})
    keys = []
    for i, r in enumerate(requests):
        rank = ranks.get(r.owner, 0)
        ranks[r.owner] = rank + 1
        keys.append((-r.priority if by_priority else 0, rank, i))
    return [requests[i] for *_, i in sorted(keys)]
