"""The sequences each tenant has in flight, and the bound on them.

A request holds its sequences (its `n`, or its beam width) from before it is tokenized until it ends:
tokenizing, compiling its grammar, queued in the engine, running. The bound:
- keyed mode: `max_turns_per_tenant` sequences a tenant;
- open mode (no keys: every client is the local tenant, so a per-tenant bound would be a server-wide
  one far below what the engine serves): the engine's capacity (`max_num_seqs`) plus its bounded queue
  (`max_waiting_requests`); past the capacity requests wait their turn in the engine's queue.
Refusals (`Busy`) name the setting that bounds them. The engine shares its slots between the tenants
that have work (chatcore/engine/fair_share.py); this bound keeps any one tenant's queue finite.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from chatcore.config import Settings
from chatcore.sessions.errors import Busy


class TenantSlots:
    def __init__(self, settings: Settings, engine_capacity: int, open_tenant: str | None = None) -> None:
        """`engine_capacity`: the engine's `max_num_seqs`; `open_tenant`: the local tenant (open mode)."""
        self.settings = settings
        self.engine_capacity = engine_capacity
        self.open_tenant = open_tenant
        self._held: Counter[str] = Counter()

    def held(self, tenant: str) -> int:
        return self._held[tenant]

    def _limit(self, tenant: str) -> tuple[int, str]:
        """The tenant's bound and how to name it."""
        if tenant == self.open_tenant:
            queue = self.settings.max_waiting_requests
            return (self.engine_capacity + queue,
                    f"open mode's max_num_seqs={self.engine_capacity} + max_waiting_requests={queue}")
        limit = self.settings.max_turns_per_tenant
        return limit, f"max_turns_per_tenant={limit}"

    def take(self, tenant: str, seqs: int) -> None:
        """Hold `seqs` sequences for the tenant, or `Busy` naming the bound it would pass."""
        limit, named = self._limit(tenant)
        if self._held[tenant] + seqs > limit:
            raise Busy(f"the tenant already runs {self._held[tenant]} sequences; {seqs} more would pass {named}")
        self._held[tenant] += seqs

    def give(self, tenant: str, seqs: int) -> None:
        self._held[tenant] -= seqs

    @contextmanager
    def hold(self, tenant: str, seqs: int) -> Iterator[None]:
        """`take`, and `give` back on the way out."""
        self.take(tenant, seqs)
        try:
            yield
        finally:
            self.give(tenant, seqs)
