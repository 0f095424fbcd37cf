"""Where a session's KV lives between its turns: pinned in the pool, cached-free there, or on disk.

The engine pins a finished turn's table under its session (`KVCacheManager`); this module decides
the rest, by session id, never holding a table:
- a turn's prefix: the pin, else the pool's cached prefix, else blocks read back from the disk
  tier (`turn_prefix`, `read_prefix`);
- prefetch: a session's history read back from disk ahead of its turn (on `hello`, and for the
  session the disk tier's forecast expects back next);
- after a turn: the pin stays, and its new full blocks go to disk in the background (`settle`); a
  turn that was not saved, or whose session is gone, gives its pin back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from chatcore.cache import chain_hashes
from chatcore.engine.commands import CachedPrefix, Prefetch, ReadBlocks, SessionPrefix, Unpin
from chatcore.engine.pins import keeps_pin
from chatcore.engine.request import Request
from chatcore.sessions.state import SessionState

if TYPE_CHECKING:
    from chatcore.engine.engine import InferenceEngine
    from chatcore.sessions.disk_tier import DiskTier
    from chatcore.sessions.manager import SessionManager

log = logging.getLogger(__name__)
LOOKAHEAD_S = 30.0  # how soon a session must be expected back for a turn to prefetch it (`prefetch_next`)


class Residency:
    def __init__(self, sessions: SessionManager, engine: InferenceEngine, disk: DiskTier | None) -> None:
        """`sessions`: the live sessions; `disk`: the disk tier, if any."""
        self.sessions = sessions
        self.engine = engine
        self.disk = disk
        self.background: set[asyncio.Task[object]] = set()

    # ----- a turn's prefix ---------------------------------------------------------------------
    async def turn_prefix(self, state: SessionState, use_pin: bool) -> SessionPrefix:
        """Where the turn's prefix may come from, once the session's prefetch (if one runs) is done."""
        return SessionPrefix(state.id, use_pin=use_pin, disk_tier=self.disk is not None,
                             prefetched=await self._prefetched(state))

    async def read_prefix(self, req: Request, prefix: SessionPrefix, device_blocks: int) -> SessionPrefix:
        """`prefix` with the prompt's full blocks past the pool's `device_blocks` read back from the
        disk tier (verified), for the request's second add."""
        disk = self.disk
        assert disk is not None
        bs = self.engine.info.block_size
        max_blocks = (len(req.prompt) - 1) // bs
        tensors = await disk.load(chain_hashes(req.prompt, bs, req.salt)[device_blocks:max_blocks])
        return SessionPrefix(prefix.session_id, use_pin=prefix.use_pin, prefetched=prefix.prefetched,
                             disk=(device_blocks, tensors))

    async def _prefetched(self, state: SessionState) -> range:
        """Wait for the session's prefetch, if one runs; the blocks it brought back."""
        task, state.prefetching = state.prefetching, None
        if task is None:
            return range(0)
        try:
            return await task
        except Exception:
            log.exception("prefetch failed in session %s", state.id)
            return range(0)

    # ----- prefetch ----------------------------------------------------------------------------
    def prefetch(self, state: SessionState) -> None:
        """Start bringing the session's history back from the disk tier (on `hello`, or ahead of
        its expected turn): the reads overlap other sessions' compute, and its next turn finds the
        blocks in the pool. A prefetch that found everything in the pool already leaves nothing
        behind, so a later one may still fetch what gets evicted meanwhile. One that found nothing on
        disk is not repeated until the history changes (`SessionState.disk_missed`)."""
        if self.disk is not None and state.tokens and state.prefetching is None and not state.turn_running \
                and state.disk_missed is not state.tokens:
            task = state.prefetching = asyncio.create_task(self.load_history(state), name=f"prefetch-{state.id}")

            def nothing_loaded(done: asyncio.Task[range]) -> None:
                if state.prefetching is done and not done.cancelled() and done.exception() is None \
                        and not done.result():
                    state.prefetching = None

            task.add_done_callback(nothing_loaded)

    def prefetch_next(self, current: SessionState) -> None:
        """While `current`'s turn computes, start bringing back the idle session the disk tier's
        forecast expects back soonest (within `LOOKAHEAD_S`). Under round robin that is the next
        turn's session: its history, evicted to disk, waits in the pool when its turn comes, and
        the read overlaps this turn's compute instead of delaying that one. The pool's eviction
        takes the conversation expected back last, never the one just prefetched."""
        disk = self.disk
        if disk is None:
            return
        idle = [s.id for s in self.sessions.live.values()
                if s is not current and s.tokens and s.prefetching is None and not s.turn_running]
        soonest = disk.soonest(idle, LOOKAHEAD_S)
        if soonest is not None:
            self.prefetch(self.sessions.live[soonest])

    async def load_history(self, state: SessionState) -> range:
        """Install the session's full blocks missing from the pool, read from the disk tier, as
        cached-free blocks claimed by the session; returns the installed blocks' places in the chain."""
        disk = self.disk
        assert disk is not None
        current = state.tokens
        tokens = list(current)
        bs = self.engine.info.block_size
        salt = self.engine.salt(state.scope_key)
        max_blocks = len(tokens) // bs
        device_blocks = await self.engine.send(CachedPrefix(tokens, salt, max_blocks, state.id))
        if device_blocks >= max_blocks:
            return range(0)
        tensors = await disk.load(chain_hashes(tokens, bs, salt)[device_blocks:max_blocks])
        if not tensors:
            state.disk_missed = current
            return range(0)
        return await self.engine.send(Prefetch(state.id, tokens, salt, device_blocks, tensors))

    # ----- after a turn ------------------------------------------------------------------------
    async def settle(self, state: SessionState, pinned_hashes: list[bytes], *, saved: bool) -> None:
        """The engine pinned the finished turn's chain (`pinned_hashes`): its new full blocks go to
        disk in the background; unless the turn was not saved or the session is gone, which gives
        the pin back (`keeps_pin`, the one rule of a pin)."""
        if not pinned_hashes:
            return
        if not keeps_pin(state.id, saved=saved, session_live=state.id in self.sessions.live):
            await self.engine.send(Unpin(state.id))
            return
        disk = self.disk
        if disk is None:
            return
        disk.claim(state.id, pinned_hashes)
        task = asyncio.create_task(self._write_through(state.id, pinned_hashes))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _write_through(self, session_id: str, hashes: list[bytes]) -> None:
        disk = self.disk
        assert disk is not None
        try:
            todo = await disk.worth_writing(session_id, await disk.filter_unknown(hashes))
            if todo:
                await disk.save(await self.engine.send(ReadBlocks(todo)))
        except Exception:
            log.exception("disk tier write failed")

    async def background_idle(self) -> None:
        """Wait for the disk-tier writes started so far."""
        await asyncio.gather(*list(self.background), return_exceptions=True)
