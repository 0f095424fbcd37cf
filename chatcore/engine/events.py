"""The engine's events: what its output side tells callers besides each request's outputs (as vLLM's
engine core reports itself dead on its output queue). Two kinds: `DeviceLost`, an event each
subscriber gets once (`subscribe`), and the engine's state, an `EngineSnapshot` that each event
loop's `EngineView` keeps, the latest one winning (`publish_state`, `view`; chatcore/engine/snapshot.py).

Invariants:
- the engine thread publishes an event and runs no caller code: `publish` and `publish_state` only
  queue the event on each subscriber's event loop (`call_soon_threadsafe`), and it is handled there;
- a subscriber gets every event published before it subscribed, then each later one, in order, once:
  a lost device is a state, and a caller that subscribes after the loss still learns of it;
- a loop's view starts from the last state published, then receives each later one, in order;
- every subscription ends once the engine's thread has ended (`close`); a subscriber whose event loop
  has closed is dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from chatcore.engine.snapshot import EngineSnapshot, EngineView


@dataclass(frozen=True, slots=True)
class DeviceLost:
    """The device failed for good (`torch.AcceleratorError`: an illegal memory access, a launch failure;
    its state is lost): the engine takes no more work, and each later call gets `EngineStopped`. `cause`:
    the failure, in one line."""

    cause: str


EngineEvent = DeviceLost  # the closed set of events (a union once there are more)
_Subscriber = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[EngineEvent | None]"]


class EngineEvents:
    def __init__(self, state: EngineSnapshot) -> None:
        """`state`: the engine's state before its thread starts."""
        self._lock = threading.Lock()  # the engine thread publishes, event loops subscribe
        self._published: list[EngineEvent] = []
        self._subscribers: list[_Subscriber] = []
        self._closed = False
        self._state = state
        self._views: dict[asyncio.AbstractEventLoop, EngineView] = {}

    @property
    def state(self) -> EngineSnapshot:
        """The last state published: for the engine thread, which publishes it."""
        return self._state

    def publish_state(self, state: EngineSnapshot) -> None:
        """On the engine thread: `state` replaces the last one in every event loop's view."""
        with self._lock:
            self._state = state
            views = list(self._views.items())
        for loop, view in views:
            try:
                loop.call_soon_threadsafe(view.receive, state)
            except RuntimeError:  # its loop has closed
                with self._lock:
                    self._views.pop(loop, None)

    def view(self) -> EngineView:
        """The running event loop's view of the engine's state (made, with the last state, on first use)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            view = self._views.get(loop)
            if view is None:
                for closed in [other for other in self._views if other.is_closed()]:
                    del self._views[closed]
                view = self._views[loop] = EngineView(self._state)
        return view

    def publish(self, event: EngineEvent) -> None:
        """On the engine thread: queue `event` for every subscriber, and for those to come."""
        with self._lock:
            self._published.append(event)
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            self._deliver(subscriber, event)

    def close(self) -> None:
        """The engine's thread has ended: every subscription ends after the events it has."""
        with self._lock:
            self._closed = True
            subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            self._deliver(subscriber, None)

    async def subscribe(self) -> AsyncIterator[EngineEvent]:
        """The events, on the caller's event loop, until the engine's thread ends."""
        queue: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        subscriber = (asyncio.get_running_loop(), queue)
        with self._lock:
            for event in self._published:
                queue.put_nowait(event)
            if self._closed:
                queue.put_nowait(None)
            else:
                self._subscribers.append(subscriber)
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            with self._lock:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)

    def _deliver(self, subscriber: _Subscriber, event: EngineEvent | None) -> None:
        loop, queue = subscriber
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # its loop has closed: nobody listens there any more
            with self._lock:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)
