"""The engine's state as callers see it: one snapshot, published by the engine thread, read on each
caller's event loop.

Invariants:
- the engine thread publishes an `EngineSnapshot` after a step, a command or its pin housekeeping
  whenever the state differs from the last one it published, and before it hands out that step's
  outputs or that command's result: a caller that holds an output or a result finds the state it
  left already in its view;
- an `EngineView` belongs to one event loop: the snapshots reach it through that loop
  (`call_soon_threadsafe`), and only code on that loop reads or changes it. No other thread reads
  engine state, except the disk tier's writer, which waits on the view's `prefill_quiet` gate;
- the gate is set only while the engine's last snapshot says no prefill runs or is queued, and no
  request this loop sent is still on its way to the engine thread, so it is never set too early.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from chatcore.engine.fits import PoolLimits


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """`failure`: why the last step failed, None once one computes again (readiness reads it).
    `prefill_quiet`: no request awaits its first token and no command is queued. `pinned_sessions`:
    the sessions whose chains are pinned. `preemptions`: the scheduler's running count. `pool`: the
    pool's size as admission sees it (`InferenceEngine.check_fits`)."""

    pool: PoolLimits
    failure: str | None = None
    prefill_quiet: bool = True
    pinned_sessions: frozenset[str] = field(default_factory=frozenset)
    preemptions: int = 0


class EngineView:
    """The engine's state as one event loop last heard it."""

    def __init__(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        self._adds_in_flight = 0  # requests this loop sent that the engine thread has not answered
        # Set while no prefill runs: background work that competes for the cores (the disk tier's
        # writes, on their own thread) waits for it, so a prefill that users wait on runs alone.
        self.prefill_quiet = threading.Event()
        self._gate()

    def receive(self, snapshot: EngineSnapshot) -> None:
        """On this view's loop: the engine thread published `snapshot`."""
        self.snapshot = snapshot
        self._gate()

    def add_sent(self) -> None:
        """A request leaves this loop for the engine thread: its prefill is coming."""
        self._adds_in_flight += 1
        self._gate()

    def add_answered(self) -> None:
        """The engine thread answered an add (the snapshot it published first says what it started)."""
        self._adds_in_flight -= 1
        self._gate()

    def _gate(self) -> None:
        if self.snapshot.prefill_quiet and not self._adds_in_flight:
            self.prefill_quiet.set()
        else:
            self.prefill_quiet.clear()
