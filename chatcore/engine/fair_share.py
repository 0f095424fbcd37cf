"""Each tenant's share of the engine: its sequence slots and its part of every step's token budget.

The share is computed afresh each step, over the tenants with work (a request running or waiting):
- slots: `max_num_seqs // tenants` sequences each (at least one). A request holds its `n` (or beam
  width) sequences from admission, forked or not (`seats`). A tenant may hold more than its share
  while no other tenant waits (the slots would idle otherwise), and a tenant holding none may always
  start one request; once another tenant waits and its next request does not fit, the scheduler
  preempts the newest requests of the tenant furthest over its share (recompute) until it does
  (`over_share`), but never a tenant's only request: a request larger than a share (n of 8 with nine
  tenants on 64 slots) runs to its end rather than being preempted at every arrival;
- tokens: `max_batch_tokens // tenants` each. A tenant's decode rows and prefill chunks together take
  at most its share of a step (decode rows first, its oldest requests' first; rows past the share wait,
  taking turns, which at the default budgets, a share of tokens above a share of slots, never happens).
  What one tenant leaves unused is not handed to another while both have work: a long prompt never
  makes the step that another tenant's rows wait for longer than its share, so it is chunked across
  steps with the other tenants' chunks and decode rows between. A tenant alone gets the whole budget;
- order: admission takes the tenant holding the fewest sequences first (ties: the earlier head), and
  each tenant's requests in their own order; when that tenant's request does not fit the free slots,
  nobody else is admitted before it (the slots drain for it, so no large request starves); decode rows
  interleave the tenants (`interleave`), so when a step's budget runs out it runs out for every tenant
  alike.
Equal weights; there is no priority. Nothing carries over between steps (no deficit counters): the
shares are recomputed each step from who has work, and admission's order (fewest slots held) is what
makes the slots fair over time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from chatcore.engine.request import Request


@dataclass(frozen=True, slots=True)
class Shares:
    tenants: frozenset[str]
    seqs: int  # each tenant's sequence slots
    tokens: int  # each tenant's tokens in one step

    @property
    def contended(self) -> bool:
        return len(self.tenants) > 1


def shares(requests: Iterable[Request], max_num_seqs: int, max_batch_tokens: int) -> Shares:
    """The shares of a step, over the tenants of `requests` (running and waiting)."""
    tenants = frozenset(req.tenant for req in requests)
    count = max(1, len(tenants))
    return Shares(tenants, max(1, max_num_seqs // count), max(1, max_batch_tokens // count))


def seats(req: Request) -> int:
    """The sequence slots a request holds: its `n` (or beam width) until it forks, then its live rows."""
    return len(req.live_seqs) if req.forked else max(req.params.num_sequences, len(req.live_seqs))


def held(running: Iterable[Request]) -> Counter[str]:
    """Sequence slots held per tenant."""
    counts: Counter[str] = Counter()
    for req in running:
        counts[req.tenant] += seats(req)
    return counts


def over_share(running: list[Request], share: int) -> Request | None:
    """The newest request of the tenant holding the most slots beyond `share`; None if none is over. A
    tenant's only running request is never taken: a request larger than a share still runs to its end."""
    counts = held(running)
    requests = Counter(req.tenant for req in running)
    over = [tenant for tenant, count in counts.items() if count > share and requests[tenant] > 1]
    if not over:
        return None
    tenant = max(over, key=lambda t: counts[t])
    return max((req for req in running if req.tenant == tenant), key=lambda r: r.arrival)


def heaviest_newest(running: list[Request]) -> Request:
    """The request to preempt when the pool runs out: the newest of the tenant holding the most slots."""
    counts = held(running)
    return max(running, key=lambda r: (counts[r.tenant], r.arrival))


def interleave(requests: list[Request]) -> list[Request]:
    """`requests` round-robin over their tenants, each tenant's oldest first."""
    rank: Counter[str] = Counter()
    keyed = []
    for req in sorted(requests, key=lambda r: r.arrival):
        keyed.append((rank[req.tenant], req.arrival, req))
        rank[req.tenant] += 1
    return [req for _, _, req in sorted(keyed, key=lambda k: (k[0], k[1]))]


def heads(waiting: Iterable[Request]) -> dict[str, Request]:
    """Each tenant's first waiting request, in queue order."""
    found: dict[str, Request] = {}
    for req in waiting:
        found.setdefault(req.tenant, req)
    return found
