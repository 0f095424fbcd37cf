"""Hot sessions' pinned block chains. Used only on the engine thread.

A pin is the block table a finished turn handed back (`keep_table`): the whole history's
KV, partial last block included, held with real references. Pins are short-lived: each
expires after the hot window, and under memory pressure the least recently used pins go
first, before any running request is preempted. An expired or reclaimed pin's full blocks
stay findable as cached-free, so the session is merely warm.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from chatcore.cache import BlockTable


@dataclass(slots=True)
class Pin:
    table: BlockTable
    expires_at: float


class PinRegistry:
    def __init__(self, hot_window_s: float) -> None:
        self.hot_window_s = hot_window_s
        self._pins: OrderedDict[str, Pin] = OrderedDict()

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def session_ids(self) -> list[str]:
        return list(self._pins)

    def tables(self) -> dict[str, BlockTable]:
        return {sid: pin.table for sid, pin in self._pins.items()}

    def pin(self, session_id: str, table: BlockTable, now: float | None = None) -> None:
        """Hold `table` for the hot window, replacing (and releasing) any older pin."""
        self.release(session_id)
        table.owner = f"session:{session_id}"
        self._pins[session_id] = Pin(table, (now or time.monotonic()) + self.hot_window_s)

    def take(self, session_id: str) -> BlockTable | None:
        """Hand the pinned table to a new turn (ownership moves with it)."""
        pin = self._pins.pop(session_id, None)
        return pin.table if pin is not None else None

    def release(self, session_id: str) -> bool:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        pin.table.release()
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Release every pin whose hot window has passed; returns their sessions."""
        now = now if now is not None else time.monotonic()
        expired = [sid for sid, pin in self._pins.items() if pin.expires_at <= now]
        for sid in expired:
            self.release(sid)
        return expired

    def reclaim(self, blocks_wanted: int, available: Callable[[], int]) -> int:
        """Release least recently pinned sessions until `available()` reaches `blocks_wanted`."""
        released = 0
        while self._pins and available() < blocks_wanted:
            sid = next(iter(self._pins))
            self.release(sid)
            released += 1
        return released

    def trim(self, max_pins: int) -> list[str]:
        dropped: list[str] = []
        while len(self._pins) > max_pins:
            sid = next(iter(self._pins))
            self.release(sid)
            dropped.append(sid)
        return dropped
