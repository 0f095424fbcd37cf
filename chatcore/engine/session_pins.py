"""The sessions' pins: each a finished turn's table, held by session id between turns (SGLang's `lock_ref`).

`KVCacheManager` composes one `SessionPins` and hands it the table a turn keeps (the rule:
`chatcore.engine.pins.keeps_pin`); the sessions layer drops a pin by id (`unpin`, `drop`) and never
holds one. Pins expire after the hot window, are trimmed to `max_hot_sessions` and
`pinned_kv_fraction` of the pool (`tend`), and are reclaimed least recently pinned first when the
scheduler needs blocks (`reclaim`), before any running request is preempted. A released pin's full
blocks stay findable as cached-free: the session is merely warm.

Invariant: this class holds the pins' tables and nothing else; it releases one only through the
manager's `_release` (given as `release`), and every table it holds is owned by `PinOwner`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from chatcore.cache import BlockPool, BlockTable, PinOwner


@dataclass(slots=True)
class Pin:
    table: BlockTable
    expires_at: float


class SessionPins:
    def __init__(self, pool: BlockPool, hot_window_s: float, release: Callable[[BlockTable], None]) -> None:
        self.pool = pool
        self.hot_window_s = hot_window_s
        self._release = release
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # least recently pinned first

    def pin(self, session_id: str, table: BlockTable) -> None:
        """Hold `table` for the hot window, replacing (and releasing) any older pin of the session."""
        self.unpin(session_id)
        table.owner = PinOwner(session_id)
        self._pins[session_id] = Pin(table, time.monotonic() + self.hot_window_s)
        self.pool.claim(session_id, table.block_ids)

    def take(self, session_id: str) -> BlockTable | None:
        """The session's pinned table, no longer a pin: the caller holds it (or releases it) now."""
        pin = self._pins.pop(session_id, None)
        return pin.table if pin is not None else None

    def unpin(self, session_id: str) -> bool:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self._release(pin.table)
        return True

    def drop(self, session_id: str) -> None:
        """A deleted session: its pin goes, and the eviction forecast forgets it."""
        self.unpin(session_id)
        self.pool.drop_group(session_id)

    @property
    def sessions(self) -> list[str]:
        """Pinned sessions, least recently pinned first."""
        return list(self._pins)

    def blocks(self, session_id: str) -> int:
        """How many blocks the session's pin holds (0 when it holds none)."""
        pin = self._pins.get(session_id)
        return len(pin.table) if pin is not None else 0

    def reclaim(self, blocks_wanted: int) -> int:
        """Release least recently pinned sessions until the pool has `blocks_wanted` available."""
        released = 0
        while self._pins and self.pool.num_available < blocks_wanted:
            self.unpin(next(iter(self._pins)))
            released += 1
        return released

    def tend(self, max_pins: int, max_fraction: float, now: float | None = None) -> None:
        """Expire pins past their hot window, then release the least recently pinned while there are
        more than `max_pins`, or while they hold more than `max_fraction` of the pool."""
        now = now if now is not None else time.monotonic()
        for sid in [sid for sid, pin in self._pins.items() if pin.expires_at <= now]:
            self.unpin(sid)
        while len(self._pins) > max_pins:
            self.unpin(next(iter(self._pins)))
        limit = int(max_fraction * self.pool.num_blocks)
        pinned = sum(len(pin.table) for pin in self._pins.values())
        while self._pins and pinned > limit:
            sid, pin = next(iter(self._pins.items()))
            pinned -= len(pin.table)
            self.unpin(sid)

    def make_room(self, session_id: str, wanted: int) -> None:
        """Release the pins of sessions the pool's forecast expects back after `session_id`, latest
        first, until the pool can take the `wanted` blocks read back for it. Without this, a small
        pool full of just-finished turns' pins refused every prefetch (an install stops at the low
        watermark) and each turn read its history again on its own critical path."""
        if self._room() >= wanted:
            return
        forecast, now = self.pool.forecast, self.pool.clock()
        waits = {g: forecast.wait(g, now) for g in [session_id, *self._pins] if g in forecast}
        mine = waits.pop(session_id, None)
        if mine is None:
            return
        for later in sorted((s for s, wait in waits.items() if wait > mine), key=waits.__getitem__, reverse=True):
            if self._room() >= wanted:
                break
            self.unpin(later)

    def _room(self) -> int:
        """Blocks an install may take now: those available above the low watermark."""
        return self.pool.num_available - self.pool.low_watermark_blocks
