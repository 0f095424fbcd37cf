"""A session's in-memory state while it is hot or warm."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from chatcore.outcomes import FinishReason
from chatcore.sessions.frames import TurnFrames

# How a turn may end and still join the canonical history (in memory and when read back).
HISTORY_REASONS = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED,
                             FinishReason.DISCONNECTED})


@dataclass(eq=False)
class SessionState:
    id: str
    tenant_id: str
    title: str
    system_prompt: str | None
    scope_key: str
    # The model's view as tokens: exactly what the model has seen, turn after turn (the cached history).
    tokens: list[int] = field(default_factory=list)
    # Every completed turn as a message (the system prompt first, if any): the canonical history.
    messages: list[dict[str, str]] = field(default_factory=list)
    # Complete exchanges before the model's view (`chatcore.sessions.window`); `tokens` starts after them.
    window_start: int = 0
    turn_count: int = 0
    next_seq: int = 0
    last_active: float = field(default_factory=time.monotonic)
    current: TurnFrames | None = None
    running: asyncio.Task[None] | None = None
    prefetching: asyncio.Task[range] | None = None  # disk reads started by `hello` (TurnRunner.prefetch)
    # The `tokens` a prefetch last found nothing of on the disk tier. `tokens` is replaced when it
    # changes, never changed in place, so while it is this very list no prefetch starts: each one
    # would hash the whole chain and look it up again, for nothing (a `hello` storm on a long history).
    disk_missed: list[int] | None = None
    request_id: str | None = None
    cancel_reason: FinishReason | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set while a client socket is attached; the grace timer runs while it is None mid-turn.
    grace_timer: asyncio.TimerHandle | None = None

    @property
    def turn_running(self) -> bool:
        return self.running is not None and not self.running.done()

    def history(self) -> list[dict[str, str]]:
        """Completed user and assistant messages, for the client."""
        return [m for m in self.messages if m["role"] != "system"]

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq
