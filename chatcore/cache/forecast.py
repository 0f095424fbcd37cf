"""Conversations as eviction units, and a forecast of when each one comes back.

Both tiers, the block pool and the disk tier, hold the blocks of many conversations and must
choose what to lose when full. Recency alone fails chat traffic: when more conversations take
turns than fit, LRU always evicts the conversation that comes next, and every turn recomputes.
`ReuseForecast` instead:

* groups blocks by conversation. After each turn a conversation claims its chain, in order
  (`claim`). A block shared by several chains (a system prompt) belongs to the last group that
  claimed it; a block leaves a group when that group claims a chain without it, or when the
  tier drops it (`forget`).
* forecasts each group's next use from its own rhythm. `gap` is the moving average of the time
  between its uses (before its second use: the average over all groups), and the expected wait
  until its next use is

      late = now - last - gap
      wait = -late                              while late <= ABSENT * gap
      wait = OVERDUE * (late - ABSENT * gap)    after that

  A conversation used a moment ago waits a whole gap; one about to come back waits almost
  nothing; one a little late (its turn is coming, behind slower turns than usual) comes back
  soonest of all, the latest first; one late by more than a whole gap (its user went away) waits
  longer the longer it stays away. Before any gap is known, the wait is the time since the last
  use (LRU). A round robin whose turns slow down (histories grow) makes every conversation a
  little late: counting that as "away" made the next in line the victim, which is LRU again
  (docs/measurements.md, "Late is not away").
* evicts from the group with the longest wait per unit of recompute cost of its tail block
  (`victim`), and keeps that victim until it has no evictable block left or claims a chain again:
  conversations are lost whole, from the tail, rather than every conversation losing its tail.
  Within the victim, the deepest block the tier calls evictable goes first (in the pool: a
  cached-free leaf; on disk: a block no other group holds).

Under a cyclic scan (round robin) every gap is the cycle, so the victim is the conversation used
most recently: what Belady's policy does on a cycle, where LRU evicts the next one. This is the
same rule as a radix cache's "evictable leaves first", applied per conversation.

Pure bookkeeping: keys are opaque (block ids in the pool, content hashes on disk) and the
caller passes the time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
OVERDUE = 2.0
ABSENT = 1.0  # gaps late from which a conversation counts as away, not merely delayed
GAP_WEIGHT = 0.3  # weight of the newest gap in the moving average


@dataclass(slots=True)
class _Group(Generic[K]):
    name: str
    last: float
    gap: float | None = None
    chain: list[K] = field(default_factory=list)


class ReuseForecast(Generic[K]):
    def __init__(self, depth_cost: float = 0.0) -> None:
        """`depth_cost`: the extra recompute cost of a block per block of depth before it,
        relative to a block at depth 0 (attention grows with position; the linear layers do not)."""
        self.depth_cost = depth_cost
        self._groups: dict[str, _Group[K]] = {}
        self._owner: dict[K, str] = {}
        self._holders: Counter[K] = Counter()  # how many groups' chains hold each key
        self._mean_gap: float | None = None
        self._victim: str | None = None

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    def owner(self, key: K) -> str | None:
        return self._owner.get(key)

    def owned(self) -> dict[K, str]:
        return dict(self._owner)

    def holders(self, key: K) -> int:
        """How many groups' chains hold `key` (a shared system prompt: many)."""
        return self._holders[key]

    def claim(self, group: str, chain: Sequence[K], now: float, *, use: bool = True) -> None:
        """`group` holds `chain` (root first) from now on; `use` records a turn at `now`. A group
        that claims a chain (a turn, or a prefetch bringing it back) stops being the victim."""
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = _Group(group, now)
        else:
            if use:
                self._record_gap(entry, now)
            kept = set(chain)
            for key in entry.chain:
                if key not in kept and self._owner.get(key) == group:
                    del self._owner[key]
            self._release(entry.chain)
        entry.chain = list(chain)
        self._holders.update(entry.chain)
        for key in entry.chain:
            self._owner[key] = group
        if self._victim == group:
            self._victim = None

    def _release(self, chain: list[K]) -> None:
        for key in chain:
            left = self._holders[key] - 1
            if left > 0:
                self._holders[key] = left
            else:
                del self._holders[key]

    def _record_gap(self, entry: _Group[K], now: float) -> None:
        gap = max(0.0, now - entry.last)
        entry.last = now
        entry.gap = gap if entry.gap is None else (1 - GAP_WEIGHT) * entry.gap + GAP_WEIGHT * gap
        self._mean_gap = gap if self._mean_gap is None else (1 - GAP_WEIGHT) * self._mean_gap + GAP_WEIGHT * gap

    def forget(self, key: K) -> None:
        """The tier dropped `key` (evicted, deleted): it belongs to no group any more."""
        self._owner.pop(key, None)

    def drop(self, group: str) -> None:
        """The conversation is gone (deleted): its blocks belong to no group."""
        entry = self._groups.pop(group, None)
        if entry is None:
            return
        self._release(entry.chain)
        for key in entry.chain:
            if self._owner.get(key) == group:
                del self._owner[key]
        if self._victim == group:
            self._victim = None

    def wait(self, group: str, now: float) -> float:
        """Expected time until `group` is used again."""
        entry = self._groups[group]
        gap = entry.gap if entry.gap is not None else self._mean_gap
        if gap is None:
            return now - entry.last
        late = now - entry.last - gap
        return -late if late <= ABSENT * gap else OVERDUE * (late - ABSENT * gap)

    def victim(self, now: float, evictable: Callable[[K], bool]) -> K | None:
        """The next key to evict, or None when no group has an evictable block."""
        if self._victim is not None:
            found = self._tail(self._groups[self._victim], evictable)
            if found is not None:
                return found[0]
            self._victim = None
        best: tuple[float, str, K] | None = None
        for entry in self._groups.values():
            found = self._tail(entry, evictable)
            if found is None:
                continue
            key, depth = found
            score = self.wait(entry.name, now) / (1.0 + self.depth_cost * depth)
            if best is None or score > best[0]:
                best = (score, entry.name, key)
        if best is None:
            return None
        self._victim = best[1]
        return best[2]

    def _tail(self, entry: _Group[K], evictable: Callable[[K], bool]) -> tuple[K, int] | None:
        """The group's deepest evictable key, with its depth."""
        for depth in range(len(entry.chain) - 1, -1, -1):
            key = entry.chain[depth]
            if self._owner.get(key) == entry.name and evictable(key):
                return key, depth
        return None
