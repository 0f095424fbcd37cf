"""Sessions: create, open (from memory or SQLite), delete, and the limits that guard them.

A session is hot (its chain pinned in the pool), warm (in memory, unpinned: its full blocks
cached-free in the pool's LRU) or cold (rows in SQLite only). Running turns live in
`chatcore.sessions.turns`; where a session's KV lives in `chatcore.sessions.residency`; going cold
in `chatcore.sessions.policy`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.cache import chain_hashes
from chatcore.config import Settings
from chatcore.engine.commands import DropSession, PinnedBlocks, Unpin
from chatcore.engine.engine import InferenceEngine
from chatcore.engine.token_logprobs import TokenTexts
from chatcore.metrics import Metrics
from chatcore.outcomes import FinishReason
from chatcore.sessions.char_bound import check_chars
from chatcore.sessions.disk_tier import DiskTier
from chatcore.sessions.errors import Busy, Conflict, NotFound, Unauthorized
from chatcore.sessions.frames import TurnFrames
from chatcore.sessions.leases import LeaseKeeper
from chatcore.sessions.quota import StoreQuota, longest_token
from chatcore.sessions.report import done_frame, timing, usage
from chatcore.sessions.state import HISTORY_REASONS, SessionState
from chatcore.sessions.system_prompt import check_room_for_a_turn
from chatcore.sessions.tenant_slots import TenantSlots
from chatcore.sessions.template import ChatTemplate
from chatcore.sessions.tokenize_queue import FairTokenizer
from chatcore.sessions.window import exchanges, view
from chatcore.store.models import ChatSession, Turn
from chatcore.store.repos import Chain, Repos, TurnStats

log = logging.getLogger(__name__)
T = TypeVar("T")


# The routing key nginx names a new session after ($request_id: 32 hex digits); docs/deploy.md.
SESSION_ID_HINT = re.compile(r"[0-9a-f]{32}")
# Every id a session can have: `new_session_id` (22 url-safe characters) or a routing key.
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{22}|[0-9a-f]{32}")


class SessionManager:
    def __init__(self, engine: InferenceEngine, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings,
                 metrics: Metrics, disk: DiskTier | None = None, open_tenant: str | None = None) -> None:
        """`open_tenant`: the local tenant, whom every client is in open mode (`TenantSlots`)."""
        self.engine = engine
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.metrics = metrics
        self.disk = disk
        info = engine.info
        self.fingerprint = info.fingerprint
        self.template = ChatTemplate(info.tokenizer, info.stop_token_ids)
        self.token_texts = TokenTexts(info.tokenizer)  # log-probs' token texts, for every route
        self.token_chars = longest_token(info.tokenizer)  # the most characters a generated token adds
        self.quota = StoreQuota(sessionmaker, settings.max_stored_chars_per_tenant)
        self._tokenizer = FairTokenizer()
        self.live: dict[str, SessionState] = {}
        self.slots = TenantSlots(settings, engine.info.max_num_seqs, open_tenant)  # sequences in flight per tenant
        self._loading: dict[str, asyncio.Lock] = {}
        self.leases = LeaseKeeper(sessionmaker, settings,
                                  running=lambda: [sid for sid, s in self.live.items() if s.turn_running])

    async def tokenize(self, tenant_id: str, work: Callable[[], T]) -> T:
        """Run `work`, tokenizer work on text the tenant sent (an encode, or the chat template rendered
        to ids), on the tokenizer thread, in the tenant's turn (chatcore/sessions/tokenize_queue.py):
        the event loop keeps serving meanwhile, and no tenant's queue delays another's by more than a job."""
        return await self._tokenizer.run(tenant_id, work)

    def check_chars(self, chars: int, tokens: int, what: str, bound: str) -> None:
        """`TooLarge` for text that cannot fit `tokens` tokens, before it is tokenized (`char_bound`)."""
        check_chars(chars, tokens, self.token_chars, what, bound)

    def close(self) -> None:
        """Stop the tokenizer thread (at shutdown): queued work is cancelled, not run."""
        self._tokenizer.close()

    def scope_key(self, tenant_id: str) -> str:
        return "global" if self.settings.cache_scope == "global" else f"tenant:{tenant_id}"

    # ----- create / open ---------------------------------------------------------------------
    async def create(self, tenant_id: str, *, system_prompt: str | None = None,
                     title: str = "", id_hint: str | None = None) -> tuple[SessionState, str]:
        """`id_hint`: nginx's routing key for a new session (X-Chatcore-New-Session), used as
        its id when well-formed and free, so that the session hashes to this replica. `TooLarge`, before
        anything is stored, for a system prompt that leaves no room for a turn; the system prompt counts
        against the tenant's store quota."""
        if system_prompt:
            self.check_chars(len(system_prompt), self.engine.info.max_context, "the system prompt", "the context")
            await check_room_for_a_turn(system_prompt, self.template, self.engine, partial(self.tokenize, tenant_id))
        async with (self.quota.hold(tenant_id, len(system_prompt or ""), "the system prompt"),
                    self.sessionmaker() as db, db.begin()):
            repos = Repos(db)
            if await repos.sessions.count_for_tenant(tenant_id) >= self.settings.max_sessions_per_tenant:
                raise Busy(f"the tenant already has {self.settings.max_sessions_per_tenant} sessions")
            if id_hint is not None and (not SESSION_ID_HINT.fullmatch(id_hint)
                                        or await repos.leases.get(id_hint) is not None):
                id_hint = None
            row, token = await repos.sessions.create(tenant_id, model_fingerprint=self.fingerprint,
                                                     title=title, system_prompt=system_prompt, session_id=id_hint)
            await repos.leases.acquire(row.id, self.leases.replica_id, self.leases.lease_s)
        state = SessionState(row.id, tenant_id, title, system_prompt, self.scope_key(tenant_id))
        if system_prompt:
            state.messages.append({"role": "system", "content": system_prompt})
        self.live[state.id] = state
        return state, token

    async def open(self, tenant_id: str, session_id: str) -> SessionState:
        """The session, from memory or rebuilt from SQLite; `NotFound` for another tenant's."""
        if not SESSION_ID.fullmatch(session_id):
            raise NotFound("no such session")  # no lookup, no lease, nothing kept for a made-up id
        while (state := self.live.get(session_id)) is not None:
            if state.tenant_id != tenant_id:
                raise NotFound("no such session")
            async with state.lock:
                if self.live.get(session_id) is not state:
                    continue  # demoted (or reloaded) while we waited: never hand out a dropped state
                await self.hold(state)
            return state
        lock = self._loading.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:
                state = self.live.get(session_id)
                if state is None:
                    state = await self._load(tenant_id, session_id)
                    self.live[session_id] = state
        finally:
            self._loading.pop(session_id, None)
        if state.tenant_id != tenant_id:
            raise NotFound("no such session")
        return state

    # ----- leases (docs/deploy.md) --------------------------------------------------------------
    async def _take_lease(self, tenant_id: str, session_id: str) -> str | None:
        """Own the session (waiting out a dead replica's lease); returns its previous owner."""
        result = await self.leases.acquire(session_id, tenant_id)
        if not result.found:
            raise NotFound("no such session")
        if not result.acquired:
            raise Conflict(f"session is served by replica {result.owner}; retry later")
        return result.previous

    async def hold(self, state: SessionState) -> None:
        """Before using a session kept in memory (caller holds `state.lock`): take its lease, and
        if another replica had it meanwhile, reload it from the database in place."""
        try:
            previous = await self._take_lease(state.tenant_id, state.id)
        except NotFound:
            self.live.pop(state.id, None)
            await self.engine.send(Unpin(state.id))
            raise
        if previous != self.leases.replica_id and not state.turn_running:
            fresh = await self._read(state.tenant_id, state.id)
            await self.engine.send(Unpin(state.id))  # its KV may be stale
            for name in ("title", "system_prompt", "tokens", "messages", "window_start", "turn_count", "next_seq",
                         "current"):
                setattr(state, name, getattr(fresh, name))

    async def _load(self, tenant_id: str, session_id: str) -> SessionState:
        await self._take_lease(tenant_id, session_id)
        return await self._read(tenant_id, session_id)

    async def _read(self, tenant_id: str, session_id: str) -> SessionState:
        """The session as the database has it. Called with the lease held and no turn of it
        running here, so a turn the database still shows running was lost with a replica (or a
        crash): it is closed as interrupted, and a client that re-attaches gets its `done`."""
        row, chain, turns = await self._load_rows(tenant_id, session_id)
        return await self._rebuild(row, chain, turns)

    async def _load_rows(self, tenant_id: str, session_id: str) -> tuple[ChatSession, Chain | None, list[Turn]]:
        """The session's row, chain and turns, in one transaction that closes its running turns as
        interrupted and marks it warm; `NotFound` for another tenant's."""
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            row = await repos.sessions.get(tenant_id, session_id)
            if row is None:
                raise NotFound("no such session")
            await repos.turns.mark_interrupted(session_id)
            chain = await repos.chains.load_chain(session_id)
            turns = await repos.turns.list_turns(session_id)
            await repos.sessions.set_state(session_id, "warm")
        return row, chain, turns

    async def _rebuild(self, row: ChatSession, chain: Chain | None, turns: list[Turn]) -> SessionState:
        """The in-memory state of a session from its rows: its complete exchanges, the `done` of a
        turn that was interrupted, and its model view (the stored chain, or re-rendered where
        another model wrote it)."""
        state = SessionState(row.id, row.tenant_id, row.title, row.system_prompt, self.scope_key(row.tenant_id))
        state.next_seq = row.next_seq
        if row.system_prompt:
            state.messages.append({"role": "system", "content": row.system_prompt})
        state.turn_count = max((t.idx for t in turns), default=-1) + 1
        # Only complete exchanges are part of the canonical history (not an interrupted or failed one).
        pending_user: dict[str, str] | None = None
        for turn in turns:
            if turn.role == "user":
                pending_user = {"role": "user", "content": turn.content}
            elif turn.role == "assistant" and pending_user is not None:
                if turn.finish_reason in HISTORY_REASONS:  # as in memory: no failed exchange
                    state.messages += [pending_user, {"role": "assistant", "content": turn.content}]
                pending_user = None
        last = turns[-1] if turns else None
        if last is not None and last.role == "assistant" and last.finish_reason == FinishReason.INTERRUPTED:
            # Its frames died with the replica: re-attaching clients get `done` (disconnected),
            # numbered after every frame the turn could have used (its range was reserved).
            state.current = TurnFrames(last.idx // 2, last.client_id, lambda: row.next_seq)
            state.current.emit(done_frame(FinishReason.DISCONNECTED, TurnStats(), 0))
        if chain is not None:
            state.window_start = min(chain.window_start, exchanges(state.messages))
        if chain is not None and row.model_fingerprint == self.fingerprint:
            state.tokens = list(chain.token_ids)
        elif chain is not None and state.history():
            # Another model wrote this history: re-render its window; nothing of the old KV is reused.
            messages = view(state.messages, state.window_start)
            state.tokens = await self.tokenize(row.tenant_id,
                                               lambda: self.template.render(messages, generation_prompt=False))
        return state

    async def resume(self, tenant_id: str, session_id: str, token: str | None) -> SessionState:
        """`open` for a client that proves it holds the session's resume token. The token is checked
        first: a wrong one takes no lease, loads nothing and writes nothing."""
        if not SESSION_ID.fullmatch(session_id):
            raise NotFound("no such session")
        async with self.sessionmaker() as db:
            repos = Repos(db)
            row = await repos.sessions.get(tenant_id, session_id)
            if row is None:
                raise NotFound("no such session")
            if token is None or not repos.sessions.verify_resume_token(row, token):
                raise Unauthorized("wrong resume token for this session")
        return await self.open(tenant_id, session_id)

    async def rotate_resume_token(self, tenant_id: str, session_id: str) -> str:
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            row = await repos.sessions.get(tenant_id, session_id)
            if row is None:
                raise NotFound("no such session")
            return await repos.sessions.rotate_resume_token(row)

    async def rename(self, tenant_id: str, session_id: str, title: str) -> None:
        async with self.sessionmaker() as db, db.begin():
            if await Repos(db).sessions.rename(tenant_id, session_id, title) is None:
                raise NotFound("no such session")
        if session_id in self.live:
            self.live[session_id].title = title

    async def delete(self, tenant_id: str, session_id: str) -> None:
        """Stop its turn, release its blocks, then delete its rows."""
        state = self.live.get(session_id)
        if state is not None and state.tenant_id != tenant_id:
            raise NotFound("no such session")
        await self._take_lease(tenant_id, session_id)
        if state is not None and state.request_id is not None:
            await self.engine.abort(state.request_id)
            if state.running is not None:
                await asyncio.gather(state.running, return_exceptions=True)
        await self.engine.send(DropSession(session_id))
        async with self.sessionmaker() as db, db.begin():
            if not await Repos(db).sessions.delete(tenant_id, session_id):
                raise NotFound("no such session")
        if self.disk is not None:
            self.disk.drop(session_id)
        self.live.pop(session_id, None)

    async def list(self, tenant_id: str) -> list[dict[str, Any]]:
        async with self.sessionmaker() as db:
            repos = Repos(db)
            rows = await repos.sessions.list_for_tenant(tenant_id)
        return [{
            "id": r.id, "title": r.title, "state": self.state_of(r.id, r.state),
            "created_at": r.created_at.isoformat(), "last_active_at": r.last_active_at.isoformat(),
        } for r in rows]

    def state_of(self, session_id: str, stored: str = "cold") -> str:
        running = session_id in self.live and self.live[session_id].turn_running
        if running or session_id in self.engine.state.pinned_sessions:
            return "hot"
        if session_id in self.live:
            return "warm"
        return "cold" if stored == "cold" or session_id not in self.live else stored

    async def detail(self, tenant_id: str, session_id: str) -> dict[str, Any]:
        async with self.sessionmaker() as db:
            repos = Repos(db)
            row = await repos.sessions.get(tenant_id, session_id)
            if row is None:
                raise NotFound("no such session")
            turns = await repos.turns.list_turns(session_id)
            chain = await repos.chains.load_chain(session_id)
        state = self.live.get(session_id)
        pinned = await self.engine.send(PinnedBlocks(session_id))
        history = []
        for turn in turns:
            item: dict[str, Any] = {"role": turn.role, "content": turn.content}
            if turn.role == "assistant":
                item["finish_reason"] = turn.finish_reason
                item["usage"] = usage(turn)
                item["timing"] = timing(turn)
            history.append(item)
        tokens = len(state.tokens) if state is not None else len(chain.token_ids) if chain else 0
        truncated = state.window_start if state is not None else chain.window_start if chain else 0
        return {
            "id": row.id, "title": row.title, "system_prompt": row.system_prompt,
            "state": self.state_of(row.id, row.state), "history": history, "truncated_turns": truncated,
            "cache": {"history_tokens": tokens, "device_blocks": pinned,
                      "cached_tokens": sum(t.cached_tokens for t in turns if t.role == "assistant")},
        }

    async def mark_interrupted(self) -> int:
        """At start-up: close the turns a crash left running (not those other replicas run)."""
        return await self.leases.recover()

    def counts(self) -> dict[str, int]:
        hot = sum(1 for sid in self.live if self.state_of(sid) == "hot")
        return {"hot": hot, "warm": len(self.live) - hot}

    async def save_chain(self, repos: Repos, state: SessionState, tokens: list[int], window_start: int = 0,
                         num_computed: int | None = None) -> None:
        """Write `tokens` as the session's chain, hashed in its cache scope; `num_computed`: how many
        of them have KV somewhere (all, unless given)."""
        bs = self.engine.info.block_size
        await repos.chains.save_chain(state.id, tokens, chain_hashes(tokens, bs, self.engine.salt(state.scope_key)), bs,
                                      len(tokens) if num_computed is None else num_computed,
                                      window_start=window_start)

    async def go_cold(self, state: SessionState) -> None:
        """Write what rebuilds the session (one transaction), then drop it from memory."""
        await self.engine.send(Unpin(state.id))
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            if not await repos.leases.release(self.leases.replica_id, [state.id]):
                self.live.pop(state.id, None)  # another replica took it over: what we hold is stale
                return
            if state.tokens:
                await self.save_chain(repos, state, state.tokens, state.window_start)
            await repos.sessions.set_seq(state.id, state.next_seq)
            await repos.sessions.set_state(state.id, "cold")
        self.live.pop(state.id, None)

    async def client_id_used(self, session_id: str, client_id: str) -> bool:
        async with self.sessionmaker() as db:
            return bool(await Repos(db).turns.find_by_client_id(session_id, client_id))
