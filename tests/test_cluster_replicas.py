"""Two replicas' worth of parts in one process, on SQLite and PostgreSQL: the shared disk tier
(one writes, the other reads; a block evicted between the index query and the read; both index
the same block at once), and the session lease as the sessions layer uses it (two `Services` on
one database: takeover, reload of a stale copy, the fence that keeps a lost session's turn
from being saved)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.config import Settings
from chatcore.engine.commands import Audit
from chatcore.engine.request import SamplingParams
from chatcore.server.services import Services
from chatcore.sessions.disk_tier import DiskTier
from chatcore.sessions.errors import Conflict
from chatcore.store.models import ChatSession
from chatcore.store.repos import Repos
from chatcore.store.types import utcnow
from tests.test_store_support import database_url, engine, sessionmaker  # noqa: F401  (fixtures)

Maker = async_sessionmaker[AsyncSession]
FP = "model-fingerprint"


def _blocks(n: int, seed: int = 0) -> list[tuple[bytes, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(bytes([seed, i]) * 8, torch.randn(2, 2, 4, 3, 8, generator=gen).to(torch.bfloat16)) for i in range(n)]


# ----- the shared disk tier --------------------------------------------------------------------
async def test_a_block_written_by_one_replica_is_read_by_another(sessionmaker: Maker,  # noqa: F811
                                                                 tmp_path: Path) -> None:
    a = DiskTier(tmp_path / "kv", FP, 1 << 30, sessionmaker)
    b = DiskTier(tmp_path / "kv", FP, 1 << 30, sessionmaker)
    try:
        blocks = _blocks(4)
        assert await a.save(blocks) == 4
        assert not list((tmp_path / "kv").rglob(".tmp-*"))  # written to a temporary file, then renamed
        assert await b.filter_unknown([h for h, _ in blocks]) == []
        loaded = await b.load([h for h, _ in blocks])
        assert len(loaded) == 4 and all(torch.equal(x, t) for x, (_, t) in zip(loaded, blocks, strict=True))
    finally:
        a.close()
        b.close()


async def test_a_block_evicted_by_another_replica_mid_load_ends_the_run(sessionmaker: Maker,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    a = DiskTier(tmp_path / "kv", FP, 1 << 30, sessionmaker)
    b = DiskTier(tmp_path / "kv", FP, 1 << 30, sessionmaker)
    try:
        blocks = _blocks(4, seed=1)
        hashes = [h for h, _ in blocks]
        await a.save(blocks)
        read = b.files.read

        def read_racing_an_eviction(block_hash: bytes, **kwargs: object) -> torch.Tensor | None:
            if block_hash == hashes[2]:  # replica a's budget deletes it after b's index query
                a.files.delete(block_hash)
            return read(block_hash, **kwargs)  # type: ignore[arg-type]

        b.files.read = read_racing_an_eviction  # type: ignore[method-assign]
        loaded = await b.load(hashes)
        assert len(loaded) == 2 and torch.equal(loaded[1], blocks[1][1])
        assert (b.missing, b.rejected) == (1, 0)  # missing is not corrupt
        async with sessionmaker() as db:
            assert await Repos(db).blocks.known([h.hex() for h in hashes]) == {h.hex() for h in hashes} - {
                hashes[2].hex()}
        assert await b.filter_unknown(hashes) == [hashes[2]]  # b writes it again after its next turn
    finally:
        a.close()
        b.close()


async def test_two_replicas_index_the_same_blocks_at_once(sessionmaker: Maker, tmp_path: Path) -> None:  # noqa: F811
    tiers = [DiskTier(tmp_path / "kv", FP, 1 << 30, sessionmaker) for _ in range(3)]
    try:
        blocks = _blocks(6, seed=2)  # the same content (a shared system prompt) on every replica
        written = await asyncio.gather(*(t.save(blocks) for t in tiers))
        assert written == [6, 6, 6]
        async with sessionmaker() as db:
            assert len(await Repos(db).blocks.known([h.hex() for h, _ in blocks])) == 6
        assert len(await tiers[1].load([h for h, _ in blocks])) == 6
    finally:
        for tier in tiers:
            tier.close()


# ----- leases through the sessions layer ---------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # runs until cancelled, on any CPU
LEASE_S = 1.0


@pytest.fixture
async def replicas(database_url: str, tmp_path: Path, loaded_fp32):  # type: ignore[no-untyped-def]  # noqa: F811
    """Two replicas (`Services`) sharing one database and one disk tier, in this process."""
    started: list[Services] = []
    for name in ("a", "b"):
        settings = Settings(data_dir=tmp_path / name, database_url=database_url, kv_disk_dir=tmp_path / "kv",
                            replica_id=f"replica-{name}", lease_s=LEASE_S, dtype="float32", num_blocks=256,
                            debug_audit=True, kv_disk_gb=1)
        started.append(await Services.start(settings, loaded_fp32))
    yield started
    for services in started:
        report = await services.engine.send(Audit())
        assert report.ok, report.format()
        await services.stop()


async def _turn(services: Services, state, content: str,  # type: ignore[no-untyped-def]
                params: SamplingParams = GREEDY) -> dict:
    frames = await services.turns.start(state, content, params)
    await frames.finished.wait()
    assert frames.done_frame is not None
    return frames.done_frame


@pytest.mark.model
async def test_takeover_reloads_a_stale_copy(replicas: list[Services]) -> None:
    a, b = replicas
    tenant = a.local_tenant_id
    assert b.local_tenant_id == tenant
    on_a, _ = await a.sessions.create(tenant)
    await _turn(a, on_a, "Hello, who are you?")
    # b takes the session once a's lease lapses (a runs nothing, so it does not renew).
    on_b = await b.sessions.open(tenant, on_a.id)
    assert len(on_b.history()) == 2 and on_b.tokens == on_a.tokens
    await _turn(b, on_b, "What can you do?")
    # a still holds its old copy in memory; opening it again waits out b's lease, then reloads.
    again = await a.sessions.open(tenant, on_a.id)
    assert again is on_a and len(again.history()) == 4 and again.tokens == on_b.tokens
    done = await _turn(a, again, "Thanks.")
    assert done["finish_reason"] in ("stop", "length")
    async with a.sessionmaker() as db:
        assert (await Repos(db).leases.get(on_a.id))[0] == "replica-a"
        assert [t.idx for t in await Repos(db).turns.list_turns(on_a.id)] == list(range(6))


@pytest.mark.model
async def test_a_running_turn_keeps_its_lease_and_a_lost_one_is_not_saved(replicas: list[Services]) -> None:
    a, b = replicas
    tenant = a.local_tenant_id
    state, _ = await a.sessions.create(tenant)
    await _turn(a, state, "Hi!")
    frames = await a.turns.start(state, "Continue the sequence forever: 1, 2, 3, 4, 5,", LONG)
    with pytest.raises(Conflict):  # a renews while the turn runs: b gives up after one lease
        await b.sessions.open(tenant, state.id)
    # Simulate a replica stalled past its lease while another took the session. replica-c's lease
    # stays live through the test: a lapsed one lets either sweep close the turn as "interrupted".
    async with a.sessionmaker() as db, db.begin():
        await db.execute(update(ChatSession).where(ChatSession.id == state.id).values(
            owner_replica="replica-c", lease_expires_at=utcnow() + timedelta(minutes=5)))
    await a.turns.cancel(state)
    await frames.finished.wait()
    async with a.sessionmaker() as db:
        turns = await Repos(db).turns.list_turns(state.id)
    assert turns[-1].role == "assistant" and turns[-1].finish_reason is None  # nothing written by a
    assert state.id not in a.sessions.live
