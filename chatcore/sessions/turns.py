"""Running one turn of a session: prompt, prefix, stream, persist, notify.

Order of a turn:
1. The new user turn's tokens are appended to the canonical history (only those tokens).
   The turn reserves its message and its answers' worst case in the tenant's store quota
   (chatcore/sessions/quota.py), or is refused before anything is written or generated.
2. The rows (user turn, assistant turn in flight) and a range of frame numbers are written.
3. The prefix: the session's pinned chain if hot; else the pool's longest hit, extended by
   blocks read back from the disk tier (verified); the rest is recomputed.
4. Tokens stream as frames. A cancel or a disconnect aborts the request.
5. The answer's ids join the history with the template's end-of-turn tokens; the turn, the
   chain and the last frame number are written in one transaction, and only then is `done`
   sent. The engine pinned the request's table under the session; where its KV lives from then
   on is `chatcore.sessions.residency`'s to decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

from chatcore.engine.commands import SessionPrefix
from chatcore.engine.errors import PrefixOnDisk, QueueFull
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request, SamplingParams
from chatcore.engine.token_logprobs import chat_content
from chatcore.outcomes import ErrorCode, FinishReason
from chatcore.sessions.errors import Busy, Conflict, TooLarge
from chatcore.sessions.frames import TurnFrames
from chatcore.sessions.leases import LeaseLost
from chatcore.sessions.quota import Reservation, answer_chars
from chatcore.sessions.report import done_frame
from chatcore.sessions.state import HISTORY_REASONS, SessionState
from chatcore.sessions.window import Window, next_prompt
from chatcore.store.repos import Repos, TurnStats
from chatcore.turnlog import log_turn

if TYPE_CHECKING:
    from chatcore.config import Settings
    from chatcore.engine.engine import InferenceEngine
    from chatcore.metrics import Metrics
    from chatcore.sessions.manager import SessionManager
    from chatcore.sessions.residency import Residency

log = logging.getLogger(__name__)


class TurnRunner:
    def __init__(self, sessions: SessionManager, engine: InferenceEngine, residency: Residency,
                 settings: Settings, metrics: Metrics) -> None:
        """`sessions`: the sessions turns run in (their leases, rows, histories and tokenizer thread);
        `residency`: where their KV lives between turns (pins, prefetch, the disk tier)."""
        self.sessions = sessions
        self.engine = engine
        self.residency = residency
        self.settings = settings
        self.metrics = metrics
        self.background: set[asyncio.Task[object]] = set()

    async def start(self, state: SessionState, content: str, params: SamplingParams,
                    client_id: str | None = None, still_current: Callable[[], bool] = lambda: True,
                    max_tokens_given: bool = True) -> TurnFrames:
        """Start a turn, or return the turn this `client_id` already started (idempotency).
        `still_current`: whether the caller (a socket) still holds the session once the lock is
        taken; meanwhile another socket may have taken it over, and must find no turn it did not see.
        `max_tokens_given`: False when `params.max_tokens` is the default, which then shrinks to the
        context the prompt leaves. Refusals raise a `SessionError`, or the engine's own refusal
        (`RequestRejected`, `GrammarError`, `GrammarBusy`), each carrying its `ErrorCode`."""
        async with state.lock:
            if not still_current():
                raise Conflict("another connection took over this session")
            if client_id is not None and state.current is not None and state.current.client_id == client_id:
                return state.current
            if state.turn_running:
                raise Busy("a turn is already running in this session")
            # Taken before the first await (the lease, the tokenizer thread, the database), so that
            # no other turn of the tenant passes the check meanwhile; the turn task gives it back.
            self.sessions.slots.take(state.tenant_id, params.num_sequences)
            try:
                return await self._begin(state, content, params, client_id, max_tokens_given)
            except BaseException:
                self.sessions.slots.give(state.tenant_id, params.num_sequences)
                raise

    async def _begin(self, state: SessionState, content: str, params: SamplingParams,
                     client_id: str | None, max_tokens_given: bool) -> TurnFrames:
        """The turn's prompt, rows and task (the caller holds `state.lock`, so the history stays put)."""
        await self.sessions.hold(state)  # the lease: this replica alone runs the session's turns
        context = self.engine.info.max_context
        limit = self.settings.max_message_tokens
        self.sessions.check_chars(len(content), limit, "the message", "max_message_tokens")
        window = await self.sessions.tokenize(state.tenant_id,
                                              lambda: self._prompt(state, content, params.max_tokens, context))
        params = await self._compile(params, state.tenant_id)
        prompt, added = window.prompt, window.added
        if not max_tokens_given and len(prompt) < context:
            params = replace(params, max_tokens=min(params.max_tokens, context - len(prompt)))
        req = self.engine.make_request(prompt, params, scope_key=state.scope_key, tenant=state.tenant_id)
        req.session_id = state.id
        self.engine.check_fits(req)  # `RequestRejected`, which carries its code (`too_large`)
        exchange = state.turn_count // 2
        reserve = 3 + params.max_tokens * params.num_sequences
        answers = answer_chars(params.max_tokens, params.num_sequences, self.sessions.token_chars)
        stored = await self.sessions.quota.reserve(
            state.tenant_id, len(content) + answers,
            f"the turn (its message, and {answers} for answers of max_tokens {params.max_tokens} × n "
            f"{params.num_sequences} at {self.sessions.token_chars} characters a token at most)")
        try:
            async with self.sessions.sessionmaker() as db, db.begin():
                repos = Repos(db)
                first = await repos.sessions.reserve_seq(state.id, reserve, touch=True)
                assistant = await repos.turns.add_exchange(state.id, content, prompt[len(prompt) - added:],
                                                           client_id=client_id)
        except BaseException:
            stored.settle()
            raise
        state.next_seq = max(state.next_seq, first)
        state.turn_count += 2
        state.last_active = time.monotonic()
        frames = TurnFrames(exchange, client_id, state.take_seq)
        state.current = frames
        state.request_id = req.request_id
        state.cancel_reason = None
        state.running = asyncio.create_task(
            self._run(state, frames, req, content, window, assistant.id, stored), name=f"turn-{state.id}")
        return frames

    async def _compile(self, params: SamplingParams, tenant_id: str) -> SamplingParams:
        """`params` with its grammar compiled (chatcore/engine/grammar.py), within the tenant's turn slot."""
        if params.response_format is None:
            return params
        # `GrammarError` (`bad_request`) or `GrammarBusy` (`busy`), each carrying its code
        compiled = await self.engine.grammar_compiler.compile_async(params.response_format, tenant_id)
        return replace(params, response_format=compiled)

    def _prompt(self, state: SessionState, content: str, max_tokens: int, context: int) -> Window:
        """On the tokenizer thread: the turn's prompt within the context (`chatcore.sessions.window`);
        `TooLarge` for a message over the limit, before rendering anything."""
        template = self.sessions.template
        settings = self.settings
        message_tokens = len(template.tokenizer.encode(content, add_special_tokens=False))
        if message_tokens > settings.max_message_tokens:
            raise TooLarge(f"the message is {message_tokens} tokens; "
                           f"the limit is {settings.max_message_tokens}")
        return next_prompt(template, state.tokens, state.messages, state.window_start, state.system_prompt, content,
                           max_tokens=max_tokens, context=context, policy=settings.context_policy,
                           low_water=settings.context_low_water)

    async def cancel(self, state: SessionState, reason: FinishReason = FinishReason.CANCELLED) -> None:
        if state.turn_running and state.request_id is not None:
            state.cancel_reason = reason
            await self.engine.abort(state.request_id)

    def arm_grace(self, state: SessionState) -> None:
        """Nobody follows the running turn any more: cancel it as `disconnected` unless a client
        re-attaches (which cancels the timer) within the grace period. The timer is bound to this
        turn: if the turn ends on its own and another starts, the late timer leaves that one alone."""
        frames = state.current
        if frames is None or not state.turn_running:
            return
        if state.grace_timer is not None:
            state.grace_timer.cancel()

        def expire() -> None:
            state.grace_timer = None
            if state.current is frames and state.turn_running:
                task = asyncio.ensure_future(self.cancel(state, FinishReason.DISCONNECTED))
                self.background.add(task)
                task.add_done_callback(self.background.discard)

        state.grace_timer = asyncio.get_running_loop().call_later(self.settings.disconnect_grace_s, expire)

    # ----- the turn task ---------------------------------------------------------------------
    async def _run(self, state: SessionState, frames: TurnFrames, req: Request, content: str,
                   window: Window, assistant_id: int, stored: Reservation) -> None:
        """`stored`: the turn's store quota, given back once its answer is saved (or is not)."""
        final: RequestOutput | None = None
        error: ErrorCode | None = None
        try:  # the tenant's slot and quota are given back whatever happens, a cancellation too
            try:
                frames.emit({"type": "start", "truncated_turns": window.window_start})
                final = await self._serve(state, frames, req, window.use_pin)
            except QueueFull as exc:
                error = exc.code
            except Exception:  # the turn fails, the session and the server live on
                log.exception("turn failed in session %s", state.id)
                error = ErrorCode.INTERNAL
            await self._finish(state, frames, req, content, window, final, error, assistant_id)
        finally:
            self.sessions.slots.give(state.tenant_id, req.params.num_sequences)
            stored.settle()
            state.request_id = None
            state.last_active = time.monotonic()

    async def _serve(self, state: SessionState, frames: TurnFrames, req: Request,
                     use_pin: bool) -> RequestOutput | None:
        """Add the request with the session's prefix and stream it; when the pool lacks blocks the
        disk tier may hold, read them back and add it again. A cancel (or an expired grace period)
        that came before the request reached the engine (while its prefetch or its disk read was
        awaited) found nothing to abort: honour it here. From each check to the engine's add nothing
        awaits, so a later cancel finds the request."""
        residency = self.residency
        prefix = await residency.turn_prefix(state, use_pin)
        residency.prefetch_next(state)
        if state.cancel_reason is not None:
            return None
        try:
            return await self._stream(frames, req, prefix)
        except PrefixOnDisk as declined:
            prefix = await residency.read_prefix(req, prefix, declined.device_blocks)
        if state.cancel_reason is not None:
            return None
        return await self._stream(frames, req, prefix)

    async def _stream(self, frames: TurnFrames, req: Request, prefix: SessionPrefix) -> RequestOutput | None:
        """Run the request, its tokens sent as frames; its final output."""
        final: RequestOutput | None = None
        async with aclosing(self.engine.generate(req, prefix)) as stream:
            async for out in stream:
                for delta in out.deltas:
                    if delta.logprobs:
                        frames.emit({"type": "token", "index": delta.index, "text": delta.text,
                                     "logprobs": chat_content(self.sessions.token_texts, delta.logprobs)})
                    elif delta.text:
                        frames.emit({"type": "token", "index": delta.index, "text": delta.text})
                if out.finished:
                    final = out
        return final

    async def _finish(self, state: SessionState, frames: TurnFrames, req: Request, content: str, window: Window,
                      final: RequestOutput | None, error: ErrorCode | None, assistant_id: int) -> None:
        """Classify how the turn ended, persist it, pin its table, and send its last frames."""
        reason, error, text, generated = self._classify(state, final, error)
        text = storable(text)
        # The history this turn makes, assigned only once the database has it.
        history: tuple[list[int], list[dict[str, str]]] | None = None
        if reason in HISTORY_REASONS:
            system = [{"role": "system", "content": state.system_prompt}] \
                if state.system_prompt and not state.messages else []
            history = (req.prompt + generated + self.sessions.template.close_answer(generated),
                       system + state.messages + [{"role": "user", "content": content},
                                                  {"role": "assistant", "content": text}])
        stats = turn_stats(req, final)
        alternatives = [storable(o.text) for o in final.outputs[1:]] \
            if final is not None and len(final.outputs) > 1 else None
        try:
            await self._persist(state, assistant_id, reason, text, generated, stats, alternatives, history,
                                window.window_start)
            saved = True
        except LeaseLost:
            log.error("session %s moved to another replica during a turn; the turn is not saved", state.id)
            self.sessions.live.pop(state.id, None)  # stale here
            saved, error = False, ErrorCode.CONFLICT
        except Exception:  # locked, disk full, a failover: memory keeps the history the database has
            log.exception("the turn of session %s could not be saved", state.id)
            saved, reason, error = False, FinishReason.ERROR, ErrorCode.INTERNAL
        try:  # bookkeeping: a failure here must neither keep `done` from the client nor strand the table
            self.metrics.record_request(reason, stats.prompt_tokens, stats.cached_device_tokens,
                                        stats.cached_disk_tokens, stats.queue_ms, stats.ttft_ms,
                                        final.timings.inter_token_ms if final is not None and final.timings else [])
            log_turn(tenant_id=state.tenant_id, session_id=state.id, request_id=req.request_id,
                     prompt_tokens=stats.prompt_tokens, cached_device=stats.cached_device_tokens,
                     cached_disk=stats.cached_disk_tokens, ttft_ms=stats.ttft_ms,
                     completion_tokens=stats.completion_tokens, finish_reason=reason)
        except Exception:
            log.exception("could not record the turn of session %s", state.id)
        try:
            await self.residency.settle(state, final.pinned_hashes if final is not None else [], saved=saved)
        finally:
            said = final.error if final is not None and error == ErrorCode.BAD_REQUEST else None
            self._notify(frames, reason, error, stats, window.window_start, said)

    @staticmethod
    def _classify(state: SessionState, final: RequestOutput | None,
                  error: ErrorCode | None) -> tuple[FinishReason, ErrorCode | None, str, list[int]]:
        """How the turn ended: its finish reason, its error code if it failed, and the best answer's
        text and token ids. A cancelled turn ends with the reason its cancel gave."""
        if final is not None and final.outputs:
            best = final.outputs[0]
            reason = best.finish_reason
            if reason == FinishReason.CANCELLED:
                reason = state.cancel_reason or FinishReason.CANCELLED
            elif reason not in HISTORY_REASONS:
                error = final.error_code or ErrorCode.INTERNAL
                reason = FinishReason.ERROR
            return reason, error, best.text, best.token_ids
        if error is None and state.cancel_reason is not None:
            return state.cancel_reason, None, "", []  # cancelled before it started
        return FinishReason.ERROR, error, "", []

    async def _persist(self, state: SessionState, assistant_id: int, reason: FinishReason, text: str,
                       generated: list[int], stats: TurnStats, alternatives: list[str] | None,
                       history: tuple[list[int], list[dict[str, str]]] | None, window_start: int) -> None:
        """Write the turn, the session's chain and the done frame's number in one transaction (under
        the session's lease: `LeaseLost` if another replica owns it now), then, if the turn joins
        the history, take that history into memory."""
        chain = history[0] if history is not None else state.tokens
        window_start = window_start if history is not None else state.window_start
        async with self.sessions.sessionmaker() as db, db.begin():
            repos = Repos(db)
            await self.sessions.leases.fence(repos, state.id)
            await repos.turns.finish_turn(assistant_id, content=text, token_ids=generated,
                                          finish_reason=reason, stats=stats, alternatives=alternatives)
            await self.sessions.save_chain(repos, state, chain, window_start)
            await repos.sessions.set_seq(state.id, state.next_seq + 1, touch=True)  # the done frame's number
        if history is not None:
            state.tokens, state.messages = history
            state.window_start = window_start

    @staticmethod
    def _notify(frames: TurnFrames, reason: FinishReason, error: ErrorCode | None, stats: TurnStats,
                truncated: int, said: str | None) -> None:
        """The turn's last frames: `error` if it failed, then always `done`. A failure that is the client's
        (`bad_request`: its schema dead-ended) keeps the engine's message `said`; any other is `internal`."""
        if said is not None:
            frames.emit_error(ErrorCode.BAD_REQUEST, said)
        elif error is not None:
            code = error if error in (ErrorCode.BUSY, ErrorCode.CONFLICT) else ErrorCode.INTERNAL
            frames.emit_error(code, "no capacity right now, try again" if code == ErrorCode.BUSY else "the turn failed")
        frames.emit(done_frame(reason, stats, truncated))


def storable(text: str) -> str:
    """`text` as the history keeps it: PostgreSQL cannot store NUL, and a model generates one when it
    samples byte 0 (a token of byte-level vocabularies, which `logit_bias` can force). It is kept as
    U+FFFD in the database and in memory alike; the token ids, which the cache and the prompt use,
    stay exact. Client text holding a NUL is refused before it gets here (server/body_decoding.py)."""
    return text.replace("\x00", "\ufffd")


def turn_stats(req: Request, final: RequestOutput | None) -> TurnStats:
    """How the turn was served, from the engine's final output (zeros for a turn that never ran)."""
    usage = final.usage if final is not None else None
    timings = final.timings if final is not None else None
    disk_tokens = usage.cached_disk_tokens if usage else 0
    cached = usage.cached_tokens if usage else 0
    return TurnStats(
        prompt_tokens=len(req.prompt), cached_tokens=cached, cached_device_tokens=cached - disk_tokens,
        cached_disk_tokens=disk_tokens, recomputed_tokens=len(req.prompt) - cached,
        completion_tokens=usage.completion_tokens if usage else 0,
        queue_ms=timings.queue_ms if timings else None, ttft_ms=timings.ttft_ms if timings else None,
        total_ms=timings.total_ms if timings else None)
