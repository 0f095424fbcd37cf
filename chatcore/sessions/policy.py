"""The eviction policy: hot -> warm -> cold.

* hot -> warm (the engine, `SessionPins.tend`): a pin expires after `hot_window_s`; the
  least recently pinned go first when there are more than `max_hot_sessions` pins, or when pins
  hold more than `pinned_kv_fraction` of the pool; and under allocation pressure the
  scheduler reclaims pins before it preempts anything (`SessionPins.reclaim`).
* warm -> cold (event loop, every `interval_s`): a session idle for `warm_idle_s` with no
  turn running is written to SQLite (chain and state, one transaction) and only then
  dropped from memory. Its full blocks stay in the pool's LRU, and on disk, for its return.

Which cached-free block the pool evicts first is the pool's LRU order: among the blocks a
table releases together, the deepest goes first, so shared system prompts and the roots of
long histories outlive lone tails.
"""

from __future__ import annotations

import time

from chatcore.config import Settings
from chatcore.engine.engine import InferenceEngine
from chatcore.periodic import Periodic
from chatcore.sessions.manager import SessionManager


class EvictionPolicy:
    def __init__(self, sessions: SessionManager, engine: InferenceEngine, settings: Settings,
                 interval_s: float = 1.0) -> None:
        """`sessions`: the live sessions, and how one goes cold; `engine`: which of them are pinned."""
        self.sessions = sessions
        self.engine = engine
        self.settings = settings
        self._periodic = Periodic("eviction pass", interval_s, self.demote_idle)

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def demote_idle(self, now: float | None = None) -> list[str]:
        """Send idle warm sessions cold; returns their ids."""
        now = now if now is not None else time.monotonic()
        idle = [s for s in self.sessions.live.values()
                if not s.turn_running and now - s.last_active >= self.settings.warm_idle_s
                and s.id not in self.engine.state.pinned_sessions]
        demoted: list[str] = []
        for state in idle:
            async with state.lock:
                if state.turn_running:
                    continue
                await self.sessions.go_cold(state)
                demoted.append(state.id)
        return demoted
