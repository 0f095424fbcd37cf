"""Both KV tiers under many conversations: the disk tier's conversation-level budget (real SQLite,
no model) and the prefetch of a cold history from disk into the pool (the real engine)."""

from __future__ import annotations

import asyncio
import threading

import torch

from chatcore.cache import PrefixOwner, audit, chain_hashes, longest_prefix
from chatcore.engine.commands import Audit, CachedPrefix, ResetPrefixCache, Unpin
from chatcore.sessions.disk_tier import DiskTier
from chatcore.store.db import create_engine, create_sessionmaker, migrate
from chatcore.store.repos import Repos
from tests.engine_helpers import on_engine_thread
from tests.test_sessions import make_services, one_turn_then_only_on_disk, run_turn  # noqa: F401  (a fixture)


class Ticks:
    """A clock that advances one second per reading: one turn per claim."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def disk_tier(tmp_path, blocks_budget: int, **options) -> tuple[DiskTier, int]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'tier.db'}"
    await migrate(url)
    sessionmaker = create_sessionmaker(create_engine(url))
    tier = DiskTier(tmp_path / "kv", "model-x", 1 << 40, sessionmaker, clock=Ticks(), **options)
    probe = tier.files.write(b"\0" * 16, torch.zeros(2, 2, 4, 1, 8))
    tier.files.delete(b"\0" * 16)
    tier.budget_bytes = blocks_budget * probe.size
    return tier, probe.size


def block(seed: int) -> torch.Tensor:
    return torch.full((2, 2, 4, 1, 8), float(seed))


async def on_disk(tier: DiskTier, hashes: list[bytes]) -> list[bytes]:
    async with tier.sessionmaker() as db:
        known = await Repos(db).blocks.known([h.hex() for h in hashes])
    return [h for h in hashes if h.hex() in known]


async def test_the_disk_budget_drops_whole_conversations_expected_back_last_never_a_shared_root(tmp_path) -> None:
    tier, _ = await disk_tier(tmp_path, blocks_budget=10)
    try:
        root = bytes([200]) * 16
        chains = {name: [root] + [bytes([i, k]) * 8 for k in range(3)] for i, name in enumerate("abcd")}
        # Round robin a, b, c, d, twice: each turn claims its chain, then writes it through.
        for _ in range(2):
            for name, chain in chains.items():
                tier.claim(name, chain)
                await tier.save([(h, block(i)) for i, h in enumerate(await tier.filter_unknown(chain))])
        kept = {name: await on_disk(tier, chain) for name, chain in chains.items()}
        # 13 blocks for a budget of 10. Round 1 knows no rhythm yet and drops the oldest, a. In
        # round 2, a writes its blocks again and is then the one expected back last: it goes
        # again, whole and tail first, while b, c and d (next up) keep everything. LRU would
        # drop b, then c, then d, each just before its turn. The shared root always stays.
        assert kept["a"] == [root]
        assert all(kept[name] == chains[name] for name in "bcd")
        assert all(tier.files.read(h) is not None for h in chains["b"])
        assert not tier.files.path_for(chains["a"][-1]).exists()
        # A deleted conversation's blocks are the first to go next time.
        tier.drop("b")
        tier.claim("e", [root, b"e" * 16])
        await tier.save([(b"e" * 16, block(9))])
        assert len(await on_disk(tier, chains["b"][1:])) == 2
        for name in "cd":
            assert await on_disk(tier, chains[name]) == chains[name]
    finally:
        tier.close()


class Quiet(threading.Event):
    """The engine's `prefill_quiet`, telling when the writer starts waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


async def test_writes_wait_while_a_prefill_runs(tmp_path) -> None:
    quiet = Quiet()  # clear: a request awaits its first token
    tier, _ = await disk_tier(tmp_path, blocks_budget=10, quiet=quiet, defer_s=3600.0)
    try:
        chain = [bytes([7, k]) * 8 for k in range(3)]
        tier.claim("a", chain)
        saving = asyncio.create_task(tier.save([(h, block(i)) for i, h in enumerate(chain)]))
        assert await asyncio.to_thread(quiet.waited.wait, 60)  # the writer holds its first file back
        assert not any(tier.files.path_for(h).exists() for h in chain) and not saving.done()
        quiet.set()  # the prefill produced its first token
        assert await saving == 3
        assert await on_disk(tier, chain) == chain
    finally:
        tier.close()


async def test_a_write_waits_for_prefills_only_up_to_its_deadline(tmp_path) -> None:
    quiet = Quiet()  # never set: prefills keep coming
    tier, _ = await disk_tier(tmp_path, blocks_budget=10, quiet=quiet, defer_s=0.0)
    try:
        chain = [bytes([8, k]) * 8 for k in range(2)]
        tier.claim("a", chain)
        assert await tier.save([(h, block(i)) for i, h in enumerate(chain)]) == 2
        assert quiet.waited.is_set() and await on_disk(tier, chain) == chain
    finally:
        tier.close()


async def test_unclaimed_blocks_go_before_any_conversation(tmp_path) -> None:
    tier, _ = await disk_tier(tmp_path, blocks_budget=4)
    try:
        stale = [bytes([9, k]) * 8 for k in range(3)]  # from before a restart: nobody claims them
        await tier.save([(h, block(k)) for k, h in enumerate(stale)])
        chain = [bytes([1, k]) * 8 for k in range(3)]
        tier.claim("s", chain)
        await tier.save([(h, block(k)) for k, h in enumerate(chain)])
        assert await on_disk(tier, chain) == chain
        assert len(await on_disk(tier, stale)) == 1
    finally:
        tier.close()


async def test_a_whole_file_that_is_not_the_one_indexed_is_rejected(tmp_path) -> None:
    tier, _ = await disk_tier(tmp_path, blocks_budget=10)
    try:
        chain = [bytes([1, k]) * 8 for k in range(3)]
        await tier.save([(h, block(k)) for k, h in enumerate(chain)])
        # Block 1's file replaced by another, internally consistent, file for the same hash.
        tier.files.write(chain[1], block(7))
        loaded = await tier.load(chain)
        assert len(loaded) == 1 and torch.equal(loaded[0], block(0))
        assert tier.rejected == 1 and await on_disk(tier, chain) == [chain[0], chain[2]]
    finally:
        tier.close()


async def test_the_sweep_removes_old_unindexed_and_temporary_files_only(tmp_path) -> None:
    import os
    import time

    tier, _ = await disk_tier(tmp_path, blocks_budget=10)
    try:
        indexed, orphan, fresh = b"i" * 16, b"o" * 16, b"f" * 16
        await tier.save([(indexed, block(1))])
        tier.files.write(orphan, block(2))  # written, then the process died before indexing it
        tier.files.write(fresh, block(3))  # another replica's, not indexed yet
        temporary = tier.files.path_for(orphan).parent / ".tmp-crashed"
        temporary.write_bytes(b"half a block")
        old = time.time() - 3600
        for path in (tier.files.path_for(indexed), tier.files.path_for(orphan), temporary):
            os.utime(path, (old, old))
        assert await tier.sweep() == 2
        assert not tier.files.path_for(orphan).exists() and not temporary.exists()
        assert tier.files.read(indexed) is not None and tier.files.path_for(fresh).exists()
    finally:
        tier.close()


async def test_prefetch_brings_a_cold_history_into_the_pool_before_its_turn(make_services) -> None:  # noqa: F811
    services, state = await one_turn_then_only_on_disk(make_services)
    tenant = services.local_tenant_id
    reopened = await services.sessions.open(tenant, state.id)
    bs = services.settings.block_size
    salt = services.engine.salt(reopened.scope_key)
    full = len(reopened.tokens) // bs

    def cached_blocks(core) -> int:
        return len(longest_prefix(core.pool.find, reopened.tokens, bs, salt)[0])

    assert await on_engine_thread(services.engine, cached_blocks) == 0
    services.residency.prefetch(reopened)  # what `hello` does
    assert reopened.prefetching is not None
    loaded = len(await reopened.prefetching) * bs
    assert loaded == full * bs
    assert await on_engine_thread(services.engine, cached_blocks) == full
    report = await services.engine.send(Audit())
    assert report.ok and report.used == 0  # installed cached-free, claimed by the session
    owners = await on_engine_thread(services.engine, lambda core: set(core.pool.forecast.owned().values()))
    assert owners == {reopened.id}
    files_before = chain_hashes(reopened.tokens, bs, salt)

    done = await run_turn(services, reopened, "And how much does it cost?")
    usage = done["usage"]
    # The turn found the history in the pool; its tokens still count as served by the disk tier.
    assert usage["cached_tokens"] >= (len(files_before) - 1) * bs
    assert usage["cached_disk_tokens"] == min(loaded, usage["cached_tokens"])
    assert reopened.prefetching is None


async def test_a_prefetch_that_found_nothing_on_disk_is_not_repeated_until_the_history_changes(
        make_services) -> None:  # noqa: F811
    """An imported history (never computed, so neither in the pool nor on disk): the first `hello`'s
    prefetch hashes the chain and finds nothing; later ones start nothing until the history changes."""
    services = await make_services(kv_disk_gb=1)
    state, _ = await services.sessions.create(services.local_tenant_id)
    bs = services.settings.block_size
    state.tokens = [1000 + i % 300 for i in range(8 * bs)]
    services.residency.prefetch(state)  # what `hello` does
    assert state.prefetching is not None
    assert await state.prefetching == range(0)
    assert state.prefetching is None and state.disk_missed is state.tokens
    for _ in range(3):
        services.residency.prefetch(state)
        assert state.prefetching is None  # no task: no hashing, no index query
    state.tokens = [*state.tokens, *range(2000, 2000 + bs)]  # a turn replaced the history
    services.residency.prefetch(state)
    assert state.prefetching is not None
    assert await state.prefetching == range(0)
    assert state.disk_missed is state.tokens


def test_a_block_that_cannot_be_installed_leaves_nothing_referenced(make_core) -> None:
    import pytest

    core = make_core()
    bs = core.pool.block_size
    tokens = list(range(100, 100 + 4 * bs))
    salt = core.salt()
    wrong_shape = [torch.zeros(3, 3)] * 4  # a file of another model's shape, say
    with pytest.raises(RuntimeError):
        core.kv_cache.disk.install(tokens, salt, 4, 0, wrong_shape, PrefixOwner("test"))
    report = audit(core.pool)
    assert report.ok and report.used == 0 and not core.pool.tables, report.format()


async def test_a_turn_prefetches_the_session_expected_back_next(make_services) -> None:  # noqa: F811
    services = await make_services(kv_disk_gb=1, hot_window_s=0)
    disk = services.residency.disk
    disk.clock = Ticks()  # the forecast's clock: one second per reading, so the order is fixed
    tenant = services.local_tenant_id
    a, b, c = [(await services.sessions.create(tenant, system_prompt=f"You are assistant {name}."))[0]
               for name in "abc"]
    # Round robin a, b, c, a, b. Each turn reads the clock twice: looking ahead (a prefetch that
    # finds the history in the pool leaves nothing), then claiming its chain at 2, 4, 6, 8, 10.
    for number, state in enumerate((a, b, c, a, b)):
        await run_turn(services, state, f"Say hello to user number {number}.")
    await services.residency.background_idle()
    for state in (a, b, c):
        await services.engine.send(Unpin(state.id))
    await services.engine.send(ResetPrefixCache())
    bs = services.settings.block_size

    async def cached_blocks(state) -> int:
        salt = services.engine.salt(state.scope_key)
        return await services.engine.send(CachedPrefix(state.tokens, salt, len(state.tokens) // bs))

    assert [await cached_blocks(s) for s in (a, b, c)] == [0, 0, 0]
    # a's turn (out of order) looks ahead at 11: c (used at 6; no gap of its own, the mean gap is 6)
    # is due in 1 s, b (used at 10, its gap 6) in 5 s. c's history comes back from disk meanwhile.
    await run_turn(services, a, "One more thing.")
    assert b.prefetching is None and c.prefetching is not None
    loaded = len(await c.prefetching) * bs
    # Every block on disk (the history's last full block is not, when it holds the answer's
    # last, never computed, tokens).
    salt = services.engine.salt(c.scope_key)
    stored = await on_disk(disk, chain_hashes(c.tokens, bs, salt))
    assert stored == chain_hashes(c.tokens, bs, salt)[: len(stored)]
    assert loaded == len(stored) * bs
    assert await cached_blocks(c) == len(stored)
    assert await cached_blocks(b) == 0
    done = await run_turn(services, c, "And now?")
    assert done["usage"]["cached_disk_tokens"] == loaded and done["usage"]["cached_tokens"] >= loaded


async def test_a_conversation_expected_back_last_does_not_write_what_the_budget_would_delete(tmp_path) -> None:
    tier, block_bytes = await disk_tier(tmp_path, blocks_budget=10)
    try:
        root = bytes([200]) * 16
        chains = {name: [root] + [bytes([i, k]) * 8 for k in range(3)] for i, name in enumerate("abcd")}
        written: dict[tuple[int, str], int] = {}
        for turn in range(3):
            if turn == 2:
                tier.budget_bytes += 2 * block_bytes
            for k, (name, chain) in enumerate(chains.items()):
                tier.clock = lambda t=4.0 * turn + k: t  # a turn a second, however often the tier reads it
                tier.claim(name, chain)
                new = await tier.filter_unknown(chain)
                todo = await tier.worth_writing(name, new)
                assert todo == new[: len(todo)]  # a leading part: the root side is kept
                written[turn, name] = await tier.save([(h, block(i)) for i, h in enumerate(todo)])
        # Round 1 writes everything (no rhythm yet: d's write makes a, the oldest, the victim).
        # In round 2, a lost its 3 blocks and is, once it claims again, the conversation expected
        # back last: writing them would only delete them again. b, c and d have nothing new.
        # In round 3 the budget has room for 2 more blocks: a writes its first two, not its tail.
        assert [written[0, n] for n in "abcd"] == [4, 3, 3, 3]
        assert [written[1, n] for n in "abcd"] == [0, 0, 0, 0]
        assert [written[2, n] for n in "abcd"] == [2, 0, 0, 0]
        assert await on_disk(tier, chains["a"]) == chains["a"][:3]
        for name in "bcd":
            assert await on_disk(tier, chains[name]) == chains[name]
    finally:
        tier.close()


async def test_a_prefetch_makes_room_by_releasing_pins_expected_back_later(make_services) -> None:  # noqa: F811
    from chatcore.cache import BlockTable, SequenceOwner

    services = await make_services(kv_disk_gb=1, hot_window_s=3600)  # pins stay until released
    services.residency.prefetch_next = lambda current: None  # only the prefetch under test reads the disk
    clock = [0.0]
    await on_engine_thread(services.engine, lambda core: setattr(core.pool, "clock", lambda: clock[0]))
    tenant = services.local_tenant_id
    a, b, c = [(await services.sessions.create(tenant, system_prompt=f"You are assistant {name}."))[0]
               for name in "abc"]
    # Round robin c, a, b twice, a turn a second: every gap is 3 s. At 6.5 s, c is due in 0.5 s,
    # a in 1.5 s and b (just used) in 2.5 s.
    for second, state in enumerate((c, a, b, c, a, b), 1):
        clock[0] = float(second)
        await run_turn(services, state, f"Say hello to user number {second}.")
    await services.residency.background_idle()
    clock[0] = 6.5
    await services.engine.send(Unpin(c.id))
    await services.engine.send(ResetPrefixCache())  # c's history is on disk only
    bs = services.settings.block_size
    salt = services.engine.salt(c.scope_key)
    in_pool = await services.engine.send(CachedPrefix(c.tokens, salt, len(c.tokens) // bs))
    # What a prefetch brings back: the blocks on disk past those still in the pool (the history's
    # last full block is not on disk when it holds the answer's last, never computed, tokens).
    stored = await on_disk(services.residency.disk, chain_hashes(c.tokens, bs, salt))
    assert stored == chain_hashes(c.tokens, bs, salt)[: len(stored)]
    missing = len(stored) - in_pool

    def leave_room_for_one_block_less(core) -> BlockTable:
        # Other requests' blocks: the pool can take one block fewer than c's history needs.
        filler = BlockTable(core.pool, SequenceOwner("other requests", 0))
        filler.append_slots((core.pool.num_available - core.pool.low_watermark_blocks - missing + 1) * bs)
        return filler

    filler = await on_engine_thread(services.engine, leave_room_for_one_block_less)
    try:
        assert await on_engine_thread(services.engine, lambda core: core.kv_cache.pins._room()) == missing - 1
        services.residency.prefetch(c)
        assert c.prefetching is not None
        assert await c.prefetching == range(in_pool, in_pool + missing)
        # b, expected back last, gave its pin up (its blocks stay cached-free); a kept its own.
        assert services.engine.state.pinned_sessions == {a.id}
    finally:
        await on_engine_thread(services.engine, lambda core: filler.release())
    done = await run_turn(services, c, "And now?")
    assert done["usage"]["cached_disk_tokens"] == missing * bs


async def test_prefetched_blocks_evicted_before_the_turn_takes_them_count_as_recomputed(make_services) -> None:  # noqa: F811
    """Tokens count as served by the disk tier only if a table held their blocks when the request
    took its prefix. Here the prefetched history is evicted while the turn reads the rest of its
    prompt from disk (as another session's prefetch may evict it): the turn recomputes it, says so,
    and still ends with `done` (a negative device share once stranded it: metrics refused it)."""
    services, state = await one_turn_then_only_on_disk(make_services)
    reopened = await services.sessions.open(services.local_tenant_id, state.id)
    services.residency.prefetch(reopened)
    assert len(await reopened.prefetching) > 0
    disk = services.residency.disk
    load = disk.load

    async def evicting_load(hashes):
        await services.engine.send(ResetPrefixCache())
        return await load(hashes)

    disk.load = evicting_load
    done = await asyncio.wait_for(run_turn(services, reopened, "And how much does it cost?"), 120)
    usage = done["usage"]
    assert 0 <= usage["cached_disk_tokens"] <= usage["cached_tokens"]
    assert usage["cached_device_tokens"] == usage["cached_tokens"] - usage["cached_disk_tokens"] >= 0
    assert usage["recomputed_tokens"] == usage["prompt_tokens"] - usage["cached_tokens"]
    report = await services.engine.send(Audit())
    assert report.ok, report.format()
