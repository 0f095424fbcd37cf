"""Session leases: which replica owns a session, until when (`sessions.owner_replica`,
`sessions.lease_expires_at`).

A replica may act on a session (load it, run a turn, write its chain) only while it holds the
lease. Taking one is a compare-and-set: an UPDATE that succeeds only if the lease is free,
lapsed or already ours *and* its owner is still the one just read, so two replicas racing for
the same session cannot both win, on SQLite or PostgreSQL, and the winner learns who held it
before (if that was another replica, its copy of the session in memory is stale). Times are
the replicas' clocks (aware UTC): keep them in sync, well within `lease_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.outcomes import FinishReason
from chatcore.store.models import ChatSession, Turn
from chatcore.store.types import utcnow


@dataclass(frozen=True, slots=True)
class LeaseResult:
    """`acquired`: the lease is ours until `expires_at`. Otherwise `owner` holds it until
    `expires_at`, or the session does not exist (`found` False). `previous` is the owner
    before this call (None: nobody)."""

    acquired: bool
    found: bool
    owner: str | None
    previous: str | None
    expires_at: datetime | None


class LeaseRepo:
    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def acquire(self, session_id: str, replica: str, lease_s: float, *, tenant_id: str | None = None,
                      now: datetime | None = None) -> LeaseResult:
        """Take or renew the lease if it is unowned, expired or already `replica`'s.

        With `tenant_id`, another tenant's session counts as missing.
        """
        now = now or utcnow()
        for _ in range(3):  # a lost compare-and-set means someone changed the row: look again
            row = (await self.db.execute(
                select(ChatSession.tenant_id, ChatSession.owner_replica, ChatSession.lease_expires_at)
                .where(ChatSession.id == session_id))).one_or_none()
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return LeaseResult(False, False, None, None, None)
            owner, expires = row.owner_replica, row.lease_expires_at
            if owner not in (None, replica) and expires is not None and expires > now:
                return LeaseResult(False, True, owner, owner, expires)
            until = now + timedelta(seconds=lease_s)
            same_owner = ChatSession.owner_replica.is_(None) if owner is None else ChatSession.owner_replica == owner
            result = await self.db.execute(
                update(ChatSession)
                .where(ChatSession.id == session_id, same_owner, _takeable(replica, now))
                .values(owner_replica=replica, lease_expires_at=until)
                .execution_options(synchronize_session=False))
            if result.rowcount == 1:
                return LeaseResult(True, True, replica, owner, until)
        return LeaseResult(False, True, owner, owner, expires)

    async def renew(self, replica: str, session_ids: Sequence[str], lease_s: float,
                    now: datetime | None = None) -> set[str]:
        """Extend the leases `replica` still owns among `session_ids`; returns those renewed.
        A session missing from the result was taken by another replica (or deleted)."""
        if not session_ids:
            return set()
        until = (now or utcnow()) + timedelta(seconds=lease_s)
        result = await self.db.execute(
            update(ChatSession)
            .where(ChatSession.id.in_(list(session_ids)), ChatSession.owner_replica == replica)
            .values(lease_expires_at=until)
            .returning(ChatSession.id)
            .execution_options(synchronize_session=False))
        return set(result.scalars().all())

    async def release(self, replica: str, session_ids: Sequence[str] | None = None) -> int:
        """Give up `replica`'s leases (all of them, or of `session_ids`); returns how many it held."""
        query = update(ChatSession).where(ChatSession.owner_replica == replica)
        if session_ids is not None:
            if not session_ids:
                return 0
            query = query.where(ChatSession.id.in_(list(session_ids)))
        result = await self.db.execute(query.values(owner_replica=None, lease_expires_at=None)
                                       .execution_options(synchronize_session=False))
        return result.rowcount

    async def get(self, session_id: str) -> tuple[str | None, datetime | None] | None:
        """(owner, expires_at) of the session's lease; None when the session does not exist."""
        row = (await self.db.execute(select(ChatSession.owner_replica, ChatSession.lease_expires_at)
                                     .where(ChatSession.id == session_id))).one_or_none()
        return None if row is None else (row.owner_replica, row.lease_expires_at)

    async def interrupt_orphans(self, replica: str, *, include_own: bool, now: datetime | None = None) -> int:
        """Close as "interrupted" the turns left running in sessions nobody holds a live lease on:
        unowned, lapsed (their replica died), and with `include_own` (at start-up: a previous
        run of this replica) this replica's. Returns how many turns were closed."""
        now = now or utcnow()
        lapsed = and_(ChatSession.lease_expires_at.is_not(None), ChatSession.lease_expires_at <= now)
        if not include_own:
            lapsed = and_(lapsed, ChatSession.owner_replica != replica)
        orphaned = or_(ChatSession.owner_replica.is_(None), lapsed)
        if include_own:
            orphaned = or_(orphaned, ChatSession.owner_replica == replica)
        result = await self.db.execute(
            update(Turn)
            .where(Turn.role == "assistant", Turn.finish_reason.is_(None),
                   Turn.session_id.in_(select(ChatSession.id).where(orphaned)))
            .values(finish_reason=FinishReason.INTERRUPTED)
            .execution_options(synchronize_session=False))
        return result.rowcount


def _takeable(replica: str, now: datetime):  # type: ignore[no-untyped-def]
    return or_(ChatSession.owner_replica.is_(None), ChatSession.owner_replica == replica,
               ChatSession.lease_expires_at.is_(None), ChatSession.lease_expires_at <= now)
