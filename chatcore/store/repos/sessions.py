"""Chat sessions: ownership, resume tokens, frame sequence numbers and hot/warm/cold state."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store import tokens
from chatcore.store.models import SESSION_STATES, ChatSession, SessionState
from chatcore.store.types import utcnow


class SessionRepo:
    """Sessions of all tenants.

    Methods taking a `tenant_id` are for request handlers: another tenant's session
    is invisible to them (None / False). Methods taking only a `session_id` are for
    the sessions layer, which has already checked ownership.
    """

    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def create(
        self,
        tenant_id: str,
        *,
        model_fingerprint: str,
        title: str = "",
        system_prompt: str | None = None,
        session_id: str | None = None,
    ) -> tuple[ChatSession, str]:
        """Create a hot session; returns it with its plaintext resume token (stored hashed only).

        `session_id` names it (behind nginx, after the routing key; see docs/deploy.md);
        by default the id is random."""
        token = tokens.new_resume_token()
        session = ChatSession(
            id=session_id or tokens.new_session_id(),
            tenant_id=tenant_id,
            title=title,
            system_prompt=system_prompt,
            model_fingerprint=model_fingerprint,
            resume_token_hash=tokens.digest(token),
            state="hot",
            next_seq=0,
        )
        self.db.add(session)
        await self.db.flush()
        return session, token

    async def get(self, tenant_id: str, session_id: str) -> ChatSession | None:
        """The session if it exists and belongs to `tenant_id`."""
        session = await self.db.get(ChatSession, session_id)
        return session if session is not None and session.tenant_id == tenant_id else None

    async def list_for_tenant(self, tenant_id: str, *, limit: int | None = None, offset: int = 0) -> list[ChatSession]:
        """The tenant's sessions, most recently active first."""
        query = (
            select(ChatSession)
            .where(ChatSession.tenant_id == tenant_id)
            .order_by(ChatSession.last_active_at.desc(), ChatSession.id)
            .offset(offset)
            .limit(limit)
        )
        return list(await self.db.scalars(query))

    async def count_for_tenant(self, tenant_id: str) -> int:
        query = select(func.count()).select_from(ChatSession).where(ChatSession.tenant_id == tenant_id)
        return await self.db.scalar(query) or 0

    async def rename(self, tenant_id: str, session_id: str, title: str) -> ChatSession | None:
        session = await self.get(tenant_id, session_id)
        if session is not None:
            session.title = title
            await self.db.flush()
        return session

    async def delete(self, tenant_id: str, session_id: str) -> bool:
        """Delete the session; the database cascades to its turns and chain."""
        result = await self.db.execute(
            delete(ChatSession).where(ChatSession.id == session_id, ChatSession.tenant_id == tenant_id)
        )
        return bool(result.rowcount)

    async def touch(self, session_id: str, at: datetime | None = None) -> bool:
        """Record activity now (or at `at`); False when the session does not exist."""
        result = await self.db.execute(
            update(ChatSession).where(ChatSession.id == session_id).values(last_active_at=at or utcnow())
        )
        return bool(result.rowcount)

    async def set_state(self, session_id: str, state: SessionState) -> bool:
        if state not in SESSION_STATES:
            raise ValueError(f"unknown session state {state!r}")
        result = await self.db.execute(update(ChatSession).where(ChatSession.id == session_id).values(state=state))
        return bool(result.rowcount)

    def verify_resume_token(self, session: ChatSession, token: str) -> bool:
        """Whether `token` is this session's resume token (constant-time comparison)."""
        return tokens.matches(token, session.resume_token_hash)

    async def rotate_resume_token(self, session: ChatSession) -> str:
        """Replace the resume token; returns the new plaintext token. The old one stops working."""
        token = tokens.new_resume_token()
        session.resume_token_hash = tokens.digest(token)
        await self.db.flush()
        return token

    async def reserve_seq(self, session_id: str, n: int = 1, *, touch: bool = False) -> int:
        """Reserve `n` frame sequence numbers atomically; returns the first one.

        The reserved numbers are `[first, first + n)`; `next_seq` becomes `first + n`. `touch`:
        record activity now in the same statement (as `touch` would).
        Raises `LookupError` when the session does not exist.
        """
        if n < 1:
            raise ValueError(f"reserve at least one sequence number, not {n}")
        values = {"next_seq": ChatSession.next_seq + n} | ({"last_active_at": utcnow()} if touch else {})
        result = await self.db.execute(
            update(ChatSession)
            .where(ChatSession.id == session_id)
            .values(**values)
            .returning(ChatSession.next_seq)
        )
        end = result.scalar_one_or_none()
        if end is None:
            raise LookupError(f"no session {session_id!r}")
        return end - n

    async def set_seq(self, session_id: str, value: int, *, touch: bool = False) -> bool:
        """Set `next_seq` (after a turn, to the last frame number actually used); `touch`: record
        activity now in the same statement."""
        values = {"next_seq": value} | ({"last_active_at": utcnow()} if touch else {})
        result = await self.db.execute(update(ChatSession).where(ChatSession.id == session_id).values(**values))
        return bool(result.rowcount)

    async def list_by_state(
        self, state: SessionState, *, active_before: datetime | None = None, limit: int | None = None
    ) -> list[ChatSession]:
        """Sessions in `state`, least recently active first (eviction order), optionally
        only those last active before `active_before`."""
        query = select(ChatSession).where(ChatSession.state == state)
        if active_before is not None:
            query = query.where(ChatSession.last_active_at < active_before)
        query = query.order_by(ChatSession.last_active_at, ChatSession.id).limit(limit)
        return list(await self.db.scalars(query))
