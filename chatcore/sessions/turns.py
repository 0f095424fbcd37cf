"""Running one turn of a session: prompt, prefix, stream, persist, pin.

Order of a turn:
1. The new user turn's tokens are appended to the canonical history (only those tokens).
2. The rows (user turn, assistant turn in flight) and a range of frame numbers are written.
3. The prefix: the session's pinned chain if hot; else the pool's longest hit, extended by
   blocks read back from the disk tier (verified); the rest is recomputed.
4. Tokens stream as frames. A cancel or a disconnect aborts the request.
5. The answer's ids join the history with the template's end-of-turn tokens; the turn, the
   chain and the last frame number are written in one transaction, and only then is `done`
   sent. The request's table becomes the session's pin; new full blocks go to the disk tier
   in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from contextlib import aclosing
from typing import TYPE_CHECKING

import torch

from chatcore.cache import BlockTable, chain_hashes, longest_prefix
from chatcore.engine.core import EngineCore
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request, SamplingParams
from chatcore.engine.scheduler import QueueFull, RequestRejected
from chatcore.engine.token_logprobs import chat_content
from chatcore.sessions.leases import LeaseLost
from chatcore.sessions.manager import Busy, Conflict, TooLarge
from chatcore.sessions.state import HISTORY_REASONS, SessionState
from chatcore.sessions.turn import TurnFrames
from chatcore.sessions.window import Window, next_prompt
from chatcore.store.repos import Repos, TurnStats
from chatcore.turnlog import log_turn

if TYPE_CHECKING:
    from chatcore.sessions.manager import SessionManager

log = logging.getLogger(__name__)


class TurnRunner:
    def __init__(self, manager: SessionManager) -> None:
        self.m = manager
        self.engine = manager.engine
        self.background: set[asyncio.Task[object]] = set()

    async def start(self, state: SessionState, content: str, params: SamplingParams,
                    client_id: str | None = None, still_current: Callable[[], bool] = lambda: True,
                    max_tokens_given: bool = True) -> TurnFrames:
        """Start a turn, or return the turn this `client_id` already started (idempotency).
        `still_current`: whether the caller (a socket) still holds the session once the lock is
        taken; meanwhile another socket may have taken it over, and must find no turn it did not see.
        `max_tokens_given`: False when `params.max_tokens` is the default, which then shrinks to the
        context the prompt leaves."""
        async with state.lock:
            if not still_current():
                raise Conflict("another connection took over this session")
            if client_id is not None and state.current is not None and state.current.client_id == client_id:
                return state.current
            if state.turn_running:
                raise Busy("a turn is already running in this session")
            if self.m.active_turns[state.tenant_id] >= self.m.settings.max_turns_per_tenant:
                raise Busy(f"the tenant already runs {self.m.settings.max_turns_per_tenant} turns")
            # Taken before the first await (the lease, the tokenizer thread, the database), so that
            # no other turn of the tenant passes the check meanwhile; the turn task gives it back.
            self.m.active_turns[state.tenant_id] += 1
            try:
                return await self._begin(state, content, params, client_id, max_tokens_given)
            except BaseException:
                self.m.active_turns[state.tenant_id] -= 1
                raise

    async def _begin(self, state: SessionState, content: str, params: SamplingParams,
                     client_id: str | None, max_tokens_given: bool) -> TurnFrames:
        """The turn's prompt, rows and task (the caller holds `state.lock`, so the history stays put)."""
        await self.m.hold(state)  # the lease: this replica alone runs the session's turns
        context = self.engine.core.scheduler.max_context
        window = await self.m.tokenize(lambda: self._prompt(state, content, params.max_tokens, context))
        prompt, added = window.prompt, window.added
        if not max_tokens_given and len(prompt) < context:
            params = replace(params, max_tokens=min(params.max_tokens, context - len(prompt)))
        req = self.engine.make_request(prompt, params, scope_key=state.scope_key)
        req.keep_table = True
        try:
            self.engine.core.scheduler.check_fits(req)
        except RequestRejected as exc:
            raise TooLarge(str(exc)) from exc
        exchange = state.turn_count // 2
        reserve = 3 + params.max_tokens * params.num_sequences
        async with self.m.sessionmaker() as db, db.begin():
            repos = Repos(db)
            first = await repos.sessions.reserve_seq(state.id, reserve)
            await repos.turns.add_turn(state.id, "user", content, prompt[len(prompt) - added:],
                                       client_id=client_id)
            assistant = await repos.turns.add_turn(state.id, "assistant", "", [], client_id=client_id)
            await repos.sessions.touch(state.id)
        state.next_seq = max(state.next_seq, first)
        state.turn_count += 2
        state.last_active = time.monotonic()
        frames = TurnFrames(exchange, client_id, state.take_seq)
        state.current = frames
        state.request_id = req.request_id
        state.cancel_reason = None
        state.running = asyncio.create_task(
            self._run(state, frames, req, content, window, assistant.id), name=f"turn-{state.id}")
        return frames

    def _prompt(self, state: SessionState, content: str, max_tokens: int, context: int) -> Window:
        """On the tokenizer thread: the turn's prompt within the context (`chatcore.sessions.window`);
        `TooLarge` for a message over the limit, before rendering anything."""
        template = self.m.template
        settings = self.m.settings
        message_tokens = len(template.tokenizer.encode(content, add_special_tokens=False))
        if message_tokens > settings.max_message_tokens:
            raise TooLarge(f"the message is {message_tokens} tokens; "
                           f"the limit is {settings.max_message_tokens}")
        return next_prompt(template, state.tokens, state.messages, state.window_start, state.system_prompt, content,
                           max_tokens=max_tokens, context=context, policy=settings.context_policy,
                           low_water=settings.context_low_water)

    async def background_idle(self) -> None:
        """Wait for the disk-tier writes started so far."""
        await asyncio.gather(*list(self.background), return_exceptions=True)

    async def cancel(self, state: SessionState, reason: str = "cancelled") -> None:
        if state.turn_running and state.request_id is not None:
            state.cancel_reason = reason
            await self.engine.abort(state.request_id)

    # ----- the turn task ---------------------------------------------------------------------
    async def _run(self, state: SessionState, frames: TurnFrames, req: Request, content: str,
                   window: Window, assistant_id: int) -> None:
        final: RequestOutput | None = None
        error: str | None = None
        try:  # the tenant's slot is given back whatever happens, a cancellation too
            try:
                frames.emit({"type": "start", "truncated_turns": window.window_start})
                await self._attach_prefix(state, req, window.use_pin)
                # A cancel (or an expired grace period) that came while the prefix was attached found
                # no request in the engine to abort: honour it here. From here to the engine's `add`
                # nothing awaits, so a later cancel finds the request.
                if state.cancel_reason is None:
                    async with aclosing(self.engine.generate(req)) as stream:
                        async for out in stream:
                            for delta in out.deltas:
                                if delta.logprobs:
                                    frames.emit({"type": "token", "index": delta.index, "text": delta.text,
                                                 "logprobs": chat_content(self.m.token_texts, delta.logprobs)})
                                elif delta.text:
                                    frames.emit({"type": "token", "index": delta.index, "text": delta.text})
                            if out.finished:
                                final = out
            except QueueFull:
                error = "busy"
            except Exception as exc:  # the turn fails, the session and the server live on
                log.exception("turn failed in session %s", state.id)
                error = f"{type(exc).__name__}"
            try:
                if req.prefix_table is not None:  # it never reached the engine, which would release it
                    await self.engine.call(lambda core: core.discard(req))
            except Exception:  # the engine is stopping: it releases everything itself
                log.exception("could not release the prefix of a turn in session %s", state.id)
            await self._finish(state, frames, req, content, window, final, error, assistant_id)
        finally:
            self.m.active_turns[state.tenant_id] -= 1
            state.request_id = None
            state.last_active = time.monotonic()

    async def _attach_prefix(self, state: SessionState, req: Request, use_pin: bool) -> None:
        prompt = req.prompt
        disk = self.m.disk
        bs = self.engine.core.pool.block_size
        max_blocks = (len(prompt) - 1) // bs
        prefetched = await self._prefetched(state)

        def take_pin(core: EngineCore) -> int:
            table = self.m.pins.take(state.id)
            if table is not None:
                if use_pin and table.num_tokens < len(prompt):
                    req.prefix_table = table
                    return -1
                table.release()
            return len(longest_prefix(core.pool.find, prompt, bs, req.salt, max_blocks)[0])

        device_blocks = await self.engine.call(take_pin)
        req.cached_disk_tokens = min(prefetched, max(device_blocks, 0) * bs)
        if device_blocks < 0 or disk is None or device_blocks >= max_blocks:
            return
        tensors = await disk.load(chain_hashes(prompt, bs, req.salt)[device_blocks:max_blocks])
        if not tensors:
            return

        def install(core: EngineCore) -> None:
            table, loaded = install_blocks(core, prompt, req.salt, max_blocks, device_blocks, tensors,
                                           req.request_id)
            req.cached_disk_tokens += loaded
            req.prefix_table = table

        await self.engine.call(install)

    async def _prefetched(self, state: SessionState) -> int:
        """Wait for the session's prefetch, if one runs; the tokens it brought back."""
        task, state.prefetching = state.prefetching, None
        if task is None:
            return 0
        try:
            return await task
        except Exception:
            log.exception("prefetch failed in session %s", state.id)
            return 0

    def prefetch(self, state: SessionState) -> None:
        """Start bringing the session's history back from the disk tier (on `hello`): the reads
        overlap other sessions' compute, and its next turn finds the blocks in the pool."""
        if self.m.disk is not None and state.tokens and state.prefetching is None and not state.turn_running:
            state.prefetching = asyncio.create_task(self.load_history(state), name=f"prefetch-{state.id}")

    async def load_history(self, state: SessionState) -> int:
        """Install the session's full blocks missing from the pool, read from the disk tier, as
        cached-free blocks claimed by the session; returns how many tokens were installed."""
        disk = self.m.disk
        assert disk is not None
        tokens = list(state.tokens)
        bs = self.engine.core.pool.block_size
        salt = self.engine.core.salt(state.scope_key)
        max_blocks = len(tokens) // bs

        def in_pool(core: EngineCore) -> int:
            if state.id in self.m.pins:
                return max_blocks
            return len(longest_prefix(core.pool.find, tokens, bs, salt, max_blocks)[0])

        device_blocks = await self.engine.call(in_pool)
        if device_blocks >= max_blocks:
            return 0
        tensors = await disk.load(chain_hashes(tokens, bs, salt)[device_blocks:max_blocks])
        if not tensors:
            return 0

        def install(core: EngineCore) -> int:
            table, loaded = install_blocks(core, tokens, salt, max_blocks, device_blocks, tensors,
                                           f"prefetch:{state.id}")
            core.pool.claim(state.id, table.block_ids, use=False)
            table.release()
            return loaded

        return await self.engine.call(install)

    async def _finish(self, state: SessionState, frames: TurnFrames, req: Request, content: str, window: Window,
                      final: RequestOutput | None, error: str | None, assistant_id: int) -> None:
        if final is not None and final.outputs:
            best = final.outputs[0]
            reason = best.finish_reason
            if reason == "cancelled":
                reason = state.cancel_reason or "cancelled"
            elif reason not in HISTORY_REASONS:
                error = final.error or reason
                reason = "error"
            text, generated = best.text, best.token_ids
        elif error is None and state.cancel_reason is not None:
            reason, text, generated = state.cancel_reason, "", []  # cancelled before it started
        else:
            reason, text, generated = "error", "", []
        # The history this turn makes, assigned only once the database has it.
        history: tuple[list[int], list[dict[str, str]]] | None = None
        if reason in HISTORY_REASONS:
            system = [{"role": "system", "content": state.system_prompt}] \
                if state.system_prompt and not state.messages else []
            history = (req.prompt + generated + self.m.template.close_answer(generated),
                       system + state.messages + [{"role": "user", "content": content},
                                                  {"role": "assistant", "content": text}])
        chain = history[0] if history is not None else state.tokens
        window_start = window.window_start if history is not None else state.window_start
        usage = final.usage if final is not None else None
        timings = final.timings if final is not None else None
        disk_tokens = usage.cached_disk_tokens if usage else 0
        cached = usage.cached_tokens if usage else 0
        stats = TurnStats(
            prompt_tokens=len(req.prompt), cached_tokens=cached, cached_device_tokens=cached - disk_tokens,
            cached_disk_tokens=disk_tokens, recomputed_tokens=len(req.prompt) - cached,
            completion_tokens=usage.completion_tokens if usage else 0,
            queue_ms=timings.queue_ms if timings else None, ttft_ms=timings.ttft_ms if timings else None,
            total_ms=timings.total_ms if timings else None)
        alternatives = [o.text for o in final.outputs[1:]] if final is not None and len(final.outputs) > 1 else None
        salt = self.engine.core.salt(state.scope_key)
        bs = self.engine.core.pool.block_size
        last_seq = state.next_seq + 1  # the done frame's number
        saved = False
        try:
            async with self.m.sessionmaker() as db, db.begin():
                repos = Repos(db)
                await self.m.leases.fence(repos, state.id)  # LeaseLost: another replica owns it now
                await repos.turns.finish_turn(assistant_id, content=text, token_ids=generated,
                                              finish_reason=reason, stats=stats, alternatives=alternatives)
                await repos.chains.save_chain(state.id, chain, chain_hashes(chain, bs, salt), bs, len(chain),
                                              window_start=window_start)
                await repos.sessions.set_seq(state.id, last_seq)
                await repos.sessions.touch(state.id)
            saved = True
        except LeaseLost:
            log.error("session %s moved to another replica during a turn; the turn is not saved", state.id)
            self.m.live.pop(state.id, None)  # stale here
            error = "conflict"
        except Exception:  # locked, disk full, a failover: memory keeps the history the database has
            log.exception("the turn of session %s could not be saved", state.id)
            reason, error = "error", "internal"
        if saved and history is not None:
            state.tokens, state.messages = history
            state.window_start = window_start
        self.m.metrics.record_request(reason, stats.prompt_tokens, stats.cached_device_tokens,
                                      stats.cached_disk_tokens, stats.queue_ms, stats.ttft_ms,
                                      timings.inter_token_ms if timings else [])
        log_turn(tenant_id=state.tenant_id, session_id=state.id, request_id=req.request_id,
                 prompt_tokens=stats.prompt_tokens, cached_device=stats.cached_device_tokens,
                 cached_disk=stats.cached_disk_tokens, ttft_ms=stats.ttft_ms,
                 completion_tokens=stats.completion_tokens, finish_reason=reason)
        try:
            await self._pin(state, req, keep=saved)
        finally:
            self._notify(frames, reason, error, stats, window.window_start)

    @staticmethod
    def _notify(frames: TurnFrames, reason: str, error: str | None, stats: TurnStats, truncated: int) -> None:
        """The turn's last frames: `error` if it failed, then always `done`."""
        if error is not None:
            code = "busy" if "max_queue_wait_s" in (error or "") or error == "busy" else "internal"
            code = "conflict" if error == "conflict" else code
            frames.emit_error(code, "no capacity right now, try again" if code == "busy" else "the turn failed")
        frames.emit({
            "type": "done", "finish_reason": reason,
            "usage": {"prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
                      "completion_tokens": stats.completion_tokens,
                      "cached_device_tokens": stats.cached_device_tokens,
                      "cached_disk_tokens": stats.cached_disk_tokens,
                      "recomputed_tokens": stats.recomputed_tokens, "truncated_turns": truncated},
            "timing": {"queue_ms": stats.queue_ms, "ttft_ms": stats.ttft_ms, "total_ms": stats.total_ms},
        })

    async def _pin(self, state: SessionState, req: Request, *, keep: bool) -> None:
        """The finished request's table becomes the session's pin, and its new full blocks go to
        disk; unless the turn is not `keep` (not saved) or the session is gone: then it is released."""
        disk = self.m.disk

        def pin(core: EngineCore) -> list[bytes]:
            table = req.kept_table
            req.kept_table = None
            if table is None or table.released:
                return []
            if not keep or state.id not in self.m.live:
                table.release()
                return []
            self.m.pins.pin(state.id, table)
            core.pool.claim(state.id, table.block_ids)
            return list(table.hashes)

        hashes = await self.engine.call(pin)
        if disk is None or not hashes:
            return
        disk.claim(state.id, hashes)
        task = asyncio.create_task(self._write_through(hashes))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _write_through(self, hashes: list[bytes]) -> None:
        disk = self.m.disk
        assert disk is not None
        try:
            todo = await disk.filter_unknown(hashes)
            if not todo:
                return

            def read(core: EngineCore) -> list[tuple[bytes, object]]:
                out = []
                for block_hash in todo:
                    block_id = core.pool.index.get(block_hash)
                    if block_id is not None and core.pool.blocks[block_id].hash == block_hash:
                        out.append((block_hash, core.kv.read_block(block_id)))
                return out

            await disk.save(await self.engine.call(read))  # type: ignore[arg-type]
        except Exception:
            log.exception("disk tier write failed")


def install_blocks(core: EngineCore, tokens: list[int], salt: bytes, max_blocks: int, device_blocks: int,
                   tensors: list[torch.Tensor], owner: str) -> tuple[BlockTable, int]:
    """On the engine thread: a table over the pool's longest prefix of `tokens`, extended by the
    blocks read from disk (which start at block `device_blocks`); returns it and the tokens
    written from disk. Stops short, rather than evict, when the pool is below its low watermark."""
    bs = core.pool.block_size
    ids, found = longest_prefix(core.pool.find, tokens, bs, salt, max_blocks)
    skip = len(ids) - device_blocks
    usable = tensors[skip:] if skip >= 0 else []
    table = BlockTable.from_prefix(core.pool, ids, found, owner=owner)
    if not usable or not core.pool.can_admit(len(usable)):
        return table, 0
    try:
        table.append_slots(len(usable) * bs)
        for j, tensor in enumerate(usable):
            core.kv.write_block(table.block_ids[len(ids) + j], tensor)
        table.commit(tokens, (len(ids) + len(usable)) * bs, salt)
    except BaseException:
        table.release()  # a block file of the wrong shape, say: nothing may stay referenced
        raise
    return table, len(usable) * bs
