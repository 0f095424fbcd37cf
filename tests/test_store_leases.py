"""Session leases on SQLite and PostgreSQL: take, conflict, lapse and takeover, renew, release,
a race between replicas, and closing the turns of dead replicas."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.store.repos import Repos
from chatcore.store.types import utcnow
from tests.test_store_support import database_url, engine, sessionmaker  # noqa: F401  (fixtures)

Maker = async_sessionmaker[AsyncSession]
LEASE_S = 3.0


async def _session(maker: Maker, tenant: str = "acme") -> tuple[str, str]:
    async with maker() as db, db.begin():
        repos = Repos(db)
        owner = await repos.tenants.get_or_create_tenant(tenant)
        row, _ = await repos.sessions.create(owner.id, model_fingerprint="m1")
        return row.id, owner.id


async def _acquire(maker: Maker, sid: str, replica: str, **kwargs):  # type: ignore[no-untyped-def]
    async with maker() as db, db.begin():
        return await Repos(db).leases.acquire(sid, replica, LEASE_S, **kwargs)


async def test_take_conflict_lapse_takeover(sessionmaker: Maker) -> None:  # noqa: F811
    sid, tenant_id = await _session(sessionmaker)
    first = await _acquire(sessionmaker, sid, "a", tenant_id=tenant_id)
    assert first.acquired and first.previous is None and first.owner == "a"
    again = await _acquire(sessionmaker, sid, "a")
    assert again.acquired and again.previous == "a" and again.expires_at >= first.expires_at
    other = await _acquire(sessionmaker, sid, "b")
    assert not other.acquired and other.found and other.owner == "a"
    assert other.expires_at == again.expires_at
    # Replica a stops renewing: once its lease lapses, b takes the session over.
    later = utcnow() + timedelta(seconds=LEASE_S + 1)
    taken = await _acquire(sessionmaker, sid, "b", now=later)
    assert taken.acquired and taken.previous == "a" and taken.owner == "b"
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        assert await repos.leases.renew("a", [sid], LEASE_S) == set()  # a learns it lost the session
        assert await repos.leases.renew("b", [sid], LEASE_S) == {sid}
        assert (await repos.leases.get(sid))[0] == "b"


async def test_missing_and_other_tenant_are_not_found(sessionmaker: Maker) -> None:  # noqa: F811
    sid, _ = await _session(sessionmaker)
    assert not (await _acquire(sessionmaker, "nope", "a")).found
    result = await _acquire(sessionmaker, sid, "a", tenant_id="another-tenant")
    assert not result.found and not result.acquired
    async with sessionmaker() as db:
        assert (await Repos(db).leases.get(sid)) == (None, None)


async def test_release_frees_only_own_leases(sessionmaker: Maker) -> None:  # noqa: F811
    s1, _ = await _session(sessionmaker)
    s2, _ = await _session(sessionmaker)
    s3, _ = await _session(sessionmaker)
    for sid, replica in ((s1, "a"), (s2, "a"), (s3, "b")):
        assert (await _acquire(sessionmaker, sid, replica)).acquired
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        assert await repos.leases.release("a", [s1]) == 1
        assert await repos.leases.release("a", [s3]) == 0  # b's
        assert await repos.leases.release("a") == 1  # s2
        assert await repos.leases.get(s1) == (None, None)
        assert (await repos.leases.get(s3))[0] == "b"
    assert (await _acquire(sessionmaker, s1, "b")).previous is None


async def test_replicas_racing_for_one_session_one_wins(sessionmaker: Maker) -> None:  # noqa: F811
    sid, _ = await _session(sessionmaker)
    for round_ in range(3):
        replicas = [f"r{round_}-{i}" for i in range(8)]
        now = utcnow() + timedelta(seconds=(LEASE_S + 1) * round_)  # each round, the last lease lapsed
        results = await asyncio.gather(*(_acquire(sessionmaker, sid, r, now=now) for r in replicas),
                                       return_exceptions=True)
        won = [r for r, res in zip(replicas, results, strict=True) if not isinstance(res, Exception) and res.acquired]
        assert len(won) == 1, results
        async with sessionmaker() as db:
            assert (await Repos(db).leases.get(sid))[0] == won[0]


async def test_interrupt_orphans_spares_live_leases(sessionmaker: Maker) -> None:  # noqa: F811
    sids = {}
    for name, replica, lapsed in (("live", "b", False), ("dead", "c", True), ("own", "a", False),
                                  ("free", None, False)):
        sid, _ = await _session(sessionmaker)
        sids[name] = sid
        async with sessionmaker() as db, db.begin():
            repos = Repos(db)
            await repos.turns.add_turn(sid, "user", "hi", [1])
            await repos.turns.add_turn(sid, "assistant", "", [])  # in flight
            if replica is not None:
                now = utcnow() - timedelta(seconds=LEASE_S + 1) if lapsed else None
                assert (await repos.leases.acquire(sid, replica, LEASE_S, now=now)).acquired

    async def open_turns() -> set[str]:
        async with sessionmaker() as db:
            repos = Repos(db)
            return {name for name, sid in sids.items()
                    if any(t.role == "assistant" and t.finish_reason is None
                           for t in await repos.turns.list_turns(sid))}

    async with sessionmaker() as db, db.begin():
        assert await Repos(db).leases.interrupt_orphans("a", include_own=False) == 2  # dead, free
    assert await open_turns() == {"live", "own"}
    async with sessionmaker() as db, db.begin():
        assert await Repos(db).leases.interrupt_orphans("a", include_own=True) == 1  # own (at start-up)
    assert await open_turns() == {"live"}
    async with sessionmaker() as db:
        turns = await Repos(db).turns.list_turns(sids["dead"])
    assert [t.finish_reason for t in turns] == [None, "interrupted"]
