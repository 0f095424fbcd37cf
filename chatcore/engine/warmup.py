"""Readiness: one short real generation through the engine's door, the path a request takes.

The server runs it once after the model loads and before it reports ready. A failure there (a
kernel that does not import or build, a device error, a model that loads but cannot generate)
stops the start: `chatcore serve` logs one line with the cause and exits non-zero, so a
supervisor restarts it or alerts. Later, while the engine's last step failed
(its `state.failure`), `/readyz` runs the same generation again, one at a time: a
transient failure heals on the next check that generates, a lasting one keeps the server out of
rotation with its cause. A lost device is for good: readiness learns of it from the engine's
`DeviceLost` event, on the event loop, and every later check fails with its cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from chatcore.engine.engine import EngineStopped, InferenceEngine
from chatcore.engine.errors import describe_failure
from chatcore.engine.events import DeviceLost
from chatcore.engine.request import SamplingParams

log = logging.getLogger(__name__)
# A prefill and one decode step: both paths (and their kernels) run once.
WARMUP_TOKENS = 2
WARMUP_MESSAGE = "Hello"


class NotReady(RuntimeError):
    """The engine cannot answer; the message is the cause, one line."""


async def generate_once(engine: InferenceEngine) -> None:
    """Generate `WARMUP_TOKENS` tokens for a short chat; `NotReady` with the cause if that fails."""
    prompt = engine.chat_prompt([{"role": "user", "content": WARMUP_MESSAGE}])
    request = engine.make_request(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True))
    final = None
    try:
        async for out in engine.generate(request):
            final = out
    except Exception as exc:  # whatever the engine raised is the cause
        raise NotReady(describe_failure(exc)) from exc
    if final is None or final.error is not None:
        raise NotReady(final.error if final is not None and final.error else "the generation ended without output")
    if not final.outputs or len(final.outputs[0].token_ids) != WARMUP_TOKENS:
        raise NotReady(f"the generation produced no {WARMUP_TOKENS} tokens")


async def warm_up(engine: InferenceEngine) -> None:
    """The start's check: `NotReady` unless the engine generates."""
    started = time.perf_counter()
    await generate_once(engine)
    log.info("engine: warm-up generation of %d tokens in %.2f s", WARMUP_TOKENS, time.perf_counter() - started)


class Readiness:
    """What `/readyz` asks of the engine: its thread answers between two steps, and, while its last
    step failed, a generation succeeds again (one at a time; others meanwhile get the cause)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._probing = asyncio.Lock()
        self.device_lost: str | None = None  # the cause, once the engine reported `DeviceLost`
        self._watching: asyncio.Task[None] | None = None

    def start(self, on_device_lost: Callable[[str], None] | None = None) -> None:
        """Follow the engine's events on this event loop; `on_device_lost(cause)` runs here too (the
        server's exit), after readiness has turned."""
        self._watching = asyncio.create_task(self._watch(on_device_lost), name="readiness-events")

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching

    async def _watch(self, on_device_lost: Callable[[str], None] | None) -> None:
        async for event in self.engine.events():
            if isinstance(event, DeviceLost):
                self.device_lost = event.cause
                if on_device_lost is not None:
                    on_device_lost(event.cause)

    async def check(self) -> None:
        if self.device_lost is not None:
            raise NotReady(f"the device failed and its state is lost: {self.device_lost}")
        try:
            await self.engine.stats()
        except EngineStopped as exc:
            raise NotReady(describe_failure(exc)) from exc
        failure = self.engine.state.failure
        if failure is None:
            return
        if self._probing.locked():
            raise NotReady(failure)
        async with self._probing:
            try:
                await generate_once(self.engine)
            except NotReady as exc:
                raise NotReady(f"{failure} (again: {exc})" if str(exc) != failure else failure) from exc
