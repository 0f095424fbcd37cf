"""Async repositories over one `AsyncSession`.

The transaction rule: repositories never commit or roll back. They `flush` when
they need database-assigned values, and the caller owns the transaction, so any
number of repository calls compose into one atomic unit:

    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        await repos.chains.save_chain(...)
        await repos.turns.add_turn(...)
        await repos.sessions.set_state(session_id, "cold")
    # committed here, or rolled back as a whole if the block raised

A session used without `db.begin()` (or an explicit `await db.commit()`) discards
its writes when closed.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store.repos.blocks import KvBlockRepo
from chatcore.store.repos.chains import Chain, ChainRepo
from chatcore.store.repos.leases import LeaseRepo, LeaseResult
from chatcore.store.repos.sessions import SessionRepo
from chatcore.store.repos.tenants import ApiKeyRepo, TenantRepo
from chatcore.store.repos.turns import TurnRepo, TurnStats


class Repos:
    """Every repository over the same session, hence the same transaction."""

    def __init__(self, db: AsyncSession) -> None:
        self.db = db
        self.tenants = TenantRepo(db)
        self.keys = ApiKeyRepo(db)
        self.sessions = SessionRepo(db)
        self.chains = ChainRepo(db)
        self.turns = TurnRepo(db)
        self.blocks = KvBlockRepo(db)
        self.leases = LeaseRepo(db)


__all__ = [
    "ApiKeyRepo",
    "Chain",
    "ChainRepo",
    "KvBlockRepo",
    "LeaseRepo",
    "LeaseResult",
    "Repos",
    "SessionRepo",
    "TenantRepo",
    "TurnRepo",
    "TurnStats",
]
