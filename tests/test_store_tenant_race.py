"""`get_or_create_tenant` under concurrent callers: replicas starting together on a fresh database.

The race is forced, not hoped for: every caller's first read (`get_tenant`, which finds nothing)
waits at a barrier until all callers have read, so all of them go on to insert the same name. A
read-then-insert version fails here on every run with a unique violation on `uq_tenants_name`.
Each caller has a sessionmaker of its own, as replicas do: one process's SQLite transactions
queue behind each other (`chatcore.store.write_queue`), so one sessionmaker would never race.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from chatcore.store.db import create_sessionmaker
from chatcore.store.models import Tenant
from chatcore.store.repos import Repos
from chatcore.store.repos.tenants import TenantRepo
from tests.test_store_support import database_url, engine, sessionmaker  # noqa: F401  (fixtures)

Maker = async_sessionmaker[AsyncSession]
CALLERS = 8


def hold_first_reads_until_all_have_read(monkeypatch: pytest.MonkeyPatch, callers: int) -> None:
    """Make each repository's first `get_tenant` return only once `callers` repositories have read."""
    barrier = asyncio.Barrier(callers)
    read_once: set[int] = set()
    get_tenant = TenantRepo.get_tenant

    async def get_tenant_in_step(self: TenantRepo, name: str) -> Tenant | None:
        tenant = await get_tenant(self, name)
        if id(self) not in read_once:
            read_once.add(id(self))
            await barrier.wait()
        return tenant

    monkeypatch.setattr(TenantRepo, "get_tenant", get_tenant_in_step)


async def _create_in_own_transaction(maker: Maker, name: str) -> str:
    async with maker() as db, db.begin():
        return (await Repos(db).tenants.get_or_create_tenant(name)).id


async def test_concurrent_callers_all_get_the_one_tenant(
        engine: AsyncEngine, sessionmaker: Maker, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    hold_first_reads_until_all_have_read(monkeypatch, CALLERS)
    callers = [_create_in_own_transaction(create_sessionmaker(engine), "local") for _ in range(CALLERS)]
    ids = await asyncio.wait_for(asyncio.gather(*callers), timeout=60)
    assert len(set(ids)) == 1
    async with sessionmaker() as db:
        assert await db.scalar(select(func.count()).select_from(Tenant)) == 1
        assert (await db.get(Tenant, ids[0])).name == "local"


async def test_a_caller_whose_insert_conflicts_keeps_its_transaction(
        engine: AsyncEngine, sessionmaker: Maker, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The loser's conflicting insert leaves its transaction usable: its API key is committed."""
    hold_first_reads_until_all_have_read(monkeypatch, 2)

    async def create_key() -> str:
        async with create_sessionmaker(engine)() as db, db.begin():
            return await Repos(db).keys.create_api_key("acme")

    keys = await asyncio.wait_for(asyncio.gather(create_key(), create_key()), timeout=60)
    async with sessionmaker() as db:
        repos = Repos(db)
        found = [await repos.keys.authenticate(key) for key in keys]
    assert all(hit is not None for hit in found)
    assert found[0][0].id == found[1][0].id
