"""SQLite transactions queue in the process (`chatcore.store.write_queue`), on a real SQLite file."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import func, select

from chatcore.store.db import create_engine, create_sessionmaker, migrate
from chatcore.store.models import ChatSession, Tenant
from chatcore.store.repos import Repos
from chatcore.store.write_queue import QueuedSession


async def _maker(tmp_path: Path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'chatcore.db'}"
    await migrate(url)
    engine = create_engine(url)
    return engine, create_sessionmaker(engine)


async def test_concurrent_transactions_run_one_at_a_time_and_all_commit(tmp_path: Path) -> None:
    engine, maker = await _maker(tmp_path)
    try:
        async with maker() as db, db.begin():
            repos = Repos(db)
            owner = await repos.tenants.get_or_create_tenant("acme")
            session, _ = await repos.sessions.create(owner.id, model_fingerprint="m1", title="t")
        inside = 0
        most = 0

        async def reserve() -> int:
            nonlocal inside, most
            async with maker() as db, db.begin():
                inside += 1
                most = max(most, inside)
                first = await Repos(db).sessions.reserve_seq(session.id, 3)  # awaits: others run meanwhile
                await Repos(db).sessions.touch(session.id)
                inside -= 1
            return first

        firsts = await asyncio.gather(*(reserve() for _ in range(24)))
        assert most == 1
        assert sorted(firsts) == list(range(0, 72, 3))
        async with maker() as db:
            assert await db.scalar(select(ChatSession.next_seq).where(ChatSession.id == session.id)) == 72
    finally:
        await engine.dispose()


async def test_a_transaction_opened_inside_one_of_the_same_task_is_not_queued_behind_it(tmp_path: Path) -> None:
    engine, maker = await _maker(tmp_path)
    try:
        async with maker() as outer, outer.begin():
            assert isinstance(outer, QueuedSession)
            await Repos(outer).tenants.get_or_create_tenant("acme")

            async def count() -> int:
                async with maker() as inner, inner.begin():
                    return await inner.scalar(select(func.count()).select_from(ChatSession)) or 0

            async with asyncio.timeout(30):  # the same task (`wait_for` would run it as another)
                assert await count() == 0
    finally:
        await engine.dispose()


async def test_a_failed_transaction_rolls_back_and_frees_the_queue(tmp_path: Path) -> None:
    engine, maker = await _maker(tmp_path)
    try:
        try:
            async with maker() as db, db.begin():
                await Repos(db).tenants.get_or_create_tenant("gone")
                raise RuntimeError("the caller fails mid-transaction")
        except RuntimeError:
            pass
        async with maker() as db, db.begin():  # the queue was given back: this one gets its turn
            await Repos(db).tenants.get_or_create_tenant("kept")
        async with maker() as db:
            assert set(await db.scalars(select(Tenant.name))) == {"kept"}
    finally:
        await engine.dispose()
