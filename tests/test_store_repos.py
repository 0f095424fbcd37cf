"""The repositories on a migrated database: isolation, cascades, secrets, chains, turns, the block index."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.outcomes import FinishReason
from chatcore.store.models import ChatSession, KvBlock, SessionChain, Turn
from chatcore.store.packing import unpack_ids
from chatcore.store.repos import Repos, TurnStats
from chatcore.store.repos.blocks import IndexedFile
from tests.test_store_support import database_url, engine, repos, sessionmaker  # noqa: F401  (fixtures)

Maker = async_sessionmaker[AsyncSession]
H = [bytes([i]) * 16 for i in range(4)]


async def _new_session(store: Repos, tenant: str = "acme") -> tuple[ChatSession, str]:
    owner = await store.tenants.get_or_create_tenant(tenant)
    return await store.sessions.create(owner.id, model_fingerprint="m1", title="t")


async def _count(maker: Maker, model: type, **where: object) -> int:
    async with maker() as db:
        query = select(func.count()).select_from(model).filter_by(**where)
        return await db.scalar(query) or 0


# Tenants and API keys.


async def test_get_or_create_tenant_is_idempotent(repos: Repos) -> None:  # noqa: F811
    first = await repos.tenants.get_or_create_tenant("acme")
    assert len(first.id) == 32 and int(first.id, 16) >= 0
    assert (await repos.tenants.get_or_create_tenant("acme")).id == first.id
    assert (await repos.tenants.get_or_create_tenant("other")).id != first.id


async def test_api_keys_store_only_hashes(sessionmaker: Maker) -> None:  # noqa: F811
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        assert await repos.keys.count_keys() == 0
        key = await repos.keys.create_api_key("acme")
        admin_key = await repos.keys.create_api_key("acme", admin=True)
    assert key.startswith("cc_") and len(key) >= 3 + 43
    async with sessionmaker() as db:
        rows = (await db.execute(text("SELECT * FROM api_keys"))).all()
    assert len(rows) == 2
    assert all(key not in str(value) and admin_key not in str(value) for row in rows for value in row)
    assert {row.prefix for row in rows} == {key[:8], admin_key[:8]}


async def test_authenticate_and_revoke(repos: Repos) -> None:  # noqa: F811
    key = await repos.keys.create_api_key("acme")
    admin_key = await repos.keys.create_api_key("acme", admin=True)
    found = await repos.keys.authenticate(key)
    assert found is not None and found[0].name == "acme" and found[1] is False
    assert (await repos.keys.authenticate(admin_key))[:2] == (found[0], True)
    assert await repos.keys.authenticate(key + "x") is None
    assert await repos.keys.authenticate("") is None

    tenant = await repos.tenants.get_tenant("acme")
    assert tenant is not None
    listed = await repos.keys.list_api_keys(tenant.id)
    plain = next(k for k in listed if not k.is_admin)
    assert await repos.keys.revoke_api_key(plain.id)
    assert not await repos.keys.revoke_api_key(plain.id)
    assert await repos.keys.authenticate(key) is None
    assert await repos.keys.authenticate(admin_key) is not None
    assert await repos.keys.count_keys() == 2  # revoked keys still count: no fallback to open mode
    assert found[2] == plain.id
    assert await repos.keys.revoked_among([plain.id, "no-such-key"]) == {plain.id, "no-such-key"}
    assert [(k.id, name) for k, name in await repos.keys.list_all("acme")] == [(k.id, "acme") for k in listed]
    assert await repos.keys.list_all("nobody") == []


# Sessions.


async def test_tenant_isolation(repos: Repos) -> None:  # noqa: F811
    mine, _ = await _new_session(repos, "acme")
    theirs, _ = await _new_session(repos, "globex")
    acme, globex = mine.tenant_id, theirs.tenant_id
    assert len(mine.id) == 22 and mine.state == "hot" and mine.next_seq == 0

    assert await repos.sessions.get(acme, mine.id) is mine
    assert await repos.sessions.get(acme, theirs.id) is None
    assert [s.id for s in await repos.sessions.list_for_tenant(acme)] == [mine.id]
    assert await repos.sessions.count_for_tenant(acme) == 1
    assert await repos.sessions.rename(acme, theirs.id, "stolen") is None
    assert not await repos.sessions.delete(acme, theirs.id)
    assert (await repos.sessions.get(globex, theirs.id)) is not None
    assert (await repos.sessions.rename(acme, mine.id, "renamed")).title == "renamed"  # type: ignore[union-attr]


async def test_list_for_tenant_most_recent_first(repos: Repos) -> None:  # noqa: F811
    sessions = [(await _new_session(repos))[0] for _ in range(3)]
    now = datetime.now(UTC)
    for age, session in zip([3, 1, 2], sessions, strict=True):
        assert await repos.sessions.touch(session.id, now - timedelta(minutes=age))
    listed = await repos.sessions.list_for_tenant(sessions[0].tenant_id)
    assert [s.id for s in listed] == [sessions[1].id, sessions[2].id, sessions[0].id]
    page = await repos.sessions.list_for_tenant(sessions[0].tenant_id, limit=1, offset=1)
    assert [s.id for s in page] == [sessions[2].id]


async def test_resume_tokens(repos: Repos) -> None:  # noqa: F811
    first, first_token = await _new_session(repos)
    second, second_token = await _new_session(repos)
    assert len(first_token) >= 22 and first.resume_token_hash != first_token
    assert repos.sessions.verify_resume_token(first, first_token)
    assert not repos.sessions.verify_resume_token(first, first_token[:-1] + "?")
    assert not repos.sessions.verify_resume_token(first, "")
    assert not repos.sessions.verify_resume_token(first, second_token)
    assert repos.sessions.verify_resume_token(second, second_token)

    rotated = await repos.sessions.rotate_resume_token(first)
    assert rotated != first_token
    assert repos.sessions.verify_resume_token(first, rotated)
    assert not repos.sessions.verify_resume_token(first, first_token)


async def test_reserve_seq(sessionmaker: Maker) -> None:  # noqa: F811
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        assert await repos.sessions.reserve_seq(session.id) == 0
        assert await repos.sessions.reserve_seq(session.id, 5) == 1
        assert session.next_seq == 6
        with pytest.raises(LookupError):
            await repos.sessions.reserve_seq("missing")
        with pytest.raises(ValueError):
            await repos.sessions.reserve_seq(session.id, 0)
    async with sessionmaker() as db, db.begin():
        assert await Repos(db).sessions.reserve_seq(session.id, 2) == 6


async def test_states_and_eviction_order(repos: Repos) -> None:  # noqa: F811
    a, _ = await _new_session(repos)
    b, _ = await _new_session(repos)
    c, _ = await _new_session(repos)
    now = datetime.now(UTC)
    await repos.sessions.touch(a.id, now - timedelta(minutes=10))
    await repos.sessions.touch(b.id, now - timedelta(minutes=20))
    await repos.sessions.touch(c.id, now - timedelta(minutes=1))
    assert await repos.sessions.set_state(c.id, "warm")
    assert not await repos.sessions.set_state("missing", "warm")
    with pytest.raises(ValueError):
        await repos.sessions.set_state(a.id, "lukewarm")  # type: ignore[arg-type]

    assert [s.id for s in await repos.sessions.list_by_state("hot")] == [b.id, a.id]
    idle = await repos.sessions.list_by_state("hot", active_before=now - timedelta(minutes=15))
    assert [s.id for s in idle] == [b.id]
    assert [s.id for s in await repos.sessions.list_by_state("warm")] == [c.id]
    assert await repos.sessions.list_by_state("cold") == []


async def test_delete_cascades_to_turns_and_chain(sessionmaker: Maker) -> None:  # noqa: F811
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        other, _ = await _new_session(repos)
        for sid in (session.id, other.id):
            await repos.turns.add_turn(sid, "user", "hi", [1, 2, 3])
            await repos.chains.save_chain(sid, list(range(32)), H[:2], 16, 32)
    assert await _count(sessionmaker, Turn) == 2
    async with sessionmaker() as db, db.begin():
        assert await Repos(db).sessions.delete(session.tenant_id, session.id)
    assert await _count(sessionmaker, Turn, session_id=session.id) == 0
    assert await _count(sessionmaker, SessionChain, session_id=session.id) == 0
    assert await _count(sessionmaker, Turn, session_id=other.id) == 1
    assert await _count(sessionmaker, SessionChain, session_id=other.id) == 1


async def test_foreign_keys_are_enforced(sessionmaker: Maker) -> None:  # noqa: F811
    with pytest.raises(IntegrityError):
        async with sessionmaker() as db, db.begin():
            await Repos(db).turns.add_turn("no-such-session", "user", "hi", [1])


async def test_one_transaction_spans_repositories(sessionmaker: Maker) -> None:  # noqa: F811
    async with sessionmaker() as db, db.begin():
        session, _ = await _new_session(Repos(db))

    async def go_cold(fail: bool) -> None:
        async with sessionmaker() as db, db.begin():
            repos = Repos(db)
            await repos.chains.save_chain(session.id, [7] * 16, H[:1], 16, 16)
            await repos.turns.add_turn(session.id, "assistant", "bye", [7])
            await repos.sessions.set_state(session.id, "cold")
            if fail:
                raise RuntimeError("crash before commit")

    with pytest.raises(RuntimeError):
        await go_cold(fail=True)
    assert await _count(sessionmaker, SessionChain) == 0
    assert await _count(sessionmaker, Turn) == 0
    assert await _count(sessionmaker, ChatSession, state="hot") == 1
    await go_cold(fail=False)
    assert await _count(sessionmaker, SessionChain) == 1
    assert await _count(sessionmaker, Turn) == 1
    assert await _count(sessionmaker, ChatSession, state="cold") == 1


# Chains.


async def test_chain_save_load_and_replace(sessionmaker: Maker) -> None:  # noqa: F811
    tokens = [0, 1, 2**32 - 1] + list(range(50))
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        assert await repos.chains.load_chain(session.id) is None
        await repos.chains.save_chain(session.id, tokens, H[:3], 16, 40)
    async with sessionmaker() as db, db.begin():
        chain = await Repos(db).chains.load_chain(session.id)
        assert chain is not None
        assert (chain.token_ids, chain.block_hashes, chain.block_size, chain.num_computed) == (tokens, H[:3], 16, 40)
        assert chain.updated_at.tzinfo is UTC
        await Repos(db).chains.save_chain(session.id, tokens[:20], H[:1], 16, 20)
    async with sessionmaker() as db:
        chain = await Repos(db).chains.load_chain(session.id)
        assert chain is not None and chain.token_ids == tokens[:20] and chain.block_hashes == H[:1]


@pytest.mark.parametrize(
    ("n_tokens", "hashes", "block_size", "num_computed"),
    [(16, 0, 0, 0), (16, 0, 16, 17), (16, 0, 16, -1), (31, 2, 16, 0)],
)
async def test_chain_rejects_inconsistent_input(
    repos: Repos,  # noqa: F811
    n_tokens: int,
    hashes: int,
    block_size: int,
    num_computed: int,
) -> None:
    session, _ = await _new_session(repos)
    with pytest.raises(ValueError):
        await repos.chains.save_chain(session.id, [1] * n_tokens, H[:hashes], block_size, num_computed)


# Turns.


async def test_turns(sessionmaker: Maker) -> None:  # noqa: F811
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        await repos.turns.add_turn(session.id, "system", "be brief", [5])
        user = await repos.turns.add_turn(session.id, "user", "hi", [1, 2], client_id="c1")
        answer = await repos.turns.add_turn(session.id, "assistant", "", [], client_id="c1")
        with pytest.raises(ValueError):
            await repos.turns.add_turn(session.id, "robot", "x", [])  # type: ignore[arg-type]
    assert (user.idx, answer.idx, answer.finish_reason) == (1, 2, None)

    stats = TurnStats(prompt_tokens=9, cached_tokens=4, cached_disk_tokens=4, completion_tokens=3, ttft_ms=1.5)
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        done = await repos.turns.finish_turn(
            answer.id, content="hello", token_ids=[7, 8, 9], finish_reason="stop", stats=stats, alternatives=["hey"]
        )
        assert done is not None
        assert await repos.turns.finish_turn(10**6, content="", token_ids=[], finish_reason="stop") is None
    async with sessionmaker() as db:
        repos = Repos(db)
        turns = await repos.turns.list_turns(session.id)
        assert [(t.idx, t.role) for t in turns] == [(0, "system"), (1, "user"), (2, "assistant")]
        last = turns[-1]
        assert (last.content, last.finish_reason, last.alternatives) == ("hello", "stop", ["hey"])
        assert (last.prompt_tokens, last.cached_tokens, last.cached_disk_tokens, last.ttft_ms) == (9, 4, 4, 1.5)
        assert last.recomputed_tokens == 0 and last.total_ms is None
        assert last.created_at.tzinfo is UTC
        assert [t.idx for t in await repos.turns.find_by_client_id(session.id, "c1")] == [1, 2]
        assert await repos.turns.find_by_client_id(session.id, "c2") == []


async def test_an_exchange_is_the_user_turn_and_the_answer_in_flight(sessionmaker: Maker) -> None:  # noqa: F811
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        await repos.turns.add_turn(session.id, "system", "be brief", [5])
        answer = await repos.turns.add_exchange(session.id, "hi", [1, 2], client_id="c1")
    async with sessionmaker() as db:
        turns = await Repos(db).turns.list_turns(session.id)
    assert [(t.idx, t.role, t.content, t.client_id, t.finish_reason) for t in turns[1:]] == [
        (1, "user", "hi", "c1", None), (2, "assistant", "", "c1", None)]
    assert unpack_ids(turns[1].token_ids) == [1, 2] and unpack_ids(turns[2].token_ids) == []
    assert answer.id == turns[2].id


async def test_seq_writes_may_record_activity_in_the_same_statement(sessionmaker: Maker) -> None:  # noqa: F811
    old = datetime(2020, 1, 1, tzinfo=UTC)
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        await repos.sessions.touch(session.id, at=old)

    async def last_active() -> datetime:
        async with sessionmaker() as db:
            return await db.scalar(select(ChatSession.last_active_at).where(ChatSession.id == session.id))

    async with sessionmaker() as db, db.begin():
        assert await Repos(db).sessions.reserve_seq(session.id, 2) == 0
    assert await last_active() == old
    async with sessionmaker() as db, db.begin():
        assert await Repos(db).sessions.reserve_seq(session.id, 2, touch=True) == 2
    touched = await last_active()
    assert touched > old
    async with sessionmaker() as db, db.begin():
        await Repos(db).sessions.touch(session.id, at=old)
        assert await Repos(db).sessions.set_seq(session.id, 9, touch=True)
    assert await last_active() > old
    async with sessionmaker() as db:
        assert await db.scalar(select(ChatSession.next_seq).where(ChatSession.id == session.id)) == 9


async def test_mark_interrupted(repos: Repos) -> None:  # noqa: F811
    a, _ = await _new_session(repos)
    b, _ = await _new_session(repos)
    await repos.turns.add_turn(a.id, "user", "q", [1])
    await repos.turns.add_turn(a.id, "assistant", "partial", [2])
    await repos.turns.add_turn(b.id, "assistant", "partial", [2])
    await repos.turns.add_turn(b.id, "assistant", "done", [3], finish_reason="stop")
    assert await repos.turns.mark_interrupted(a.id) == 1
    assert await repos.turns.mark_interrupted() == 1
    assert await repos.turns.mark_interrupted() == 0
    reasons = [(t.role, t.finish_reason) for t in await repos.turns.list_turns(a.id)]
    assert reasons == [("user", None), ("assistant", "interrupted")]


# KV block index.


async def test_kv_block_lru_and_touch(sessionmaker: Maker) -> None:  # noqa: F811
    now = datetime.now(UTC)
    async with sessionmaker() as db, db.begin():
        blocks = Repos(db).blocks
        await blocks.upsert_blocks([IndexedFile(name, f"{name}.kv", 100 * (i + 1), "x")
                                    for i, name in enumerate(["aa", "bb", "cc"])], "m1")
        for i, name in enumerate(["aa", "bb", "cc"]):
            assert await blocks.touch_blocks([name], now - timedelta(minutes=10 - i)) == 1
        await blocks.upsert_blocks([IndexedFile("dd", "dd.kv", 1000, "x")], "m2")
        await blocks.touch_blocks(["dd"], now - timedelta(minutes=30))
    async with sessionmaker() as db, db.begin():
        blocks = Repos(db).blocks
        assert [(b.hash, b.size) for b in await blocks.lru_blocks(10)] == [("dd", 1000), ("aa", 100), ("bb", 200),
                                                                          ("cc", 300)]
        assert [b.hash for b in await blocks.lru_blocks(2, model_fingerprint="m1")] == ["aa", "bb"]
        assert await blocks.touch_blocks(["aa", "zz"], now) == 1
        assert await blocks.touch_blocks(["zz"]) == 0
    async with sessionmaker() as db, db.begin():
        blocks = Repos(db).blocks
        assert [b.hash for b in await blocks.lru_blocks(10, model_fingerprint="m1")] == ["bb", "cc", "aa"]
        aa = await blocks.get_block("aa")
        assert aa is not None and aa.hits == 2 and aa.last_used_at == now
        assert await blocks.total_size() == 1600
        assert await blocks.total_size("m1") == 600
        assert await blocks.total_size("nope") == 0
        assert await blocks.delete_blocks(["dd", "zz"]) == 1
        assert await blocks.delete_blocks(["dd"]) == 0
        assert await blocks.get_block("dd") is None
        assert await blocks.delete_blocks(["aa", "bb"]) == 2
        assert [b.hash for b in await blocks.lru_blocks(10)] == ["cc"]


async def test_kv_block_upsert_replaces_file_fields(repos: Repos) -> None:  # noqa: F811
    await repos.blocks.upsert_blocks([IndexedFile("aa", "a1", 1, "c1")], "m1")
    await repos.blocks.touch_blocks(["aa"], datetime(2020, 1, 1, tzinfo=UTC))
    await repos.blocks.upsert_blocks([IndexedFile("aa", "a2", 2, "c2"), IndexedFile("bb", "b", 3, "c3")], "m2")
    again, new = await repos.blocks.get_block("aa"), await repos.blocks.get_block("bb")
    assert again is not None and new is not None
    await repos.db.refresh(again)
    assert (again.path, again.size, again.checksum, again.model_fingerprint, again.hits) == ("a2", 2, "c2", "m2", 1)
    assert again.last_used_at > datetime(2020, 1, 1, tzinfo=UTC)  # a rewrite counts as a use
    assert (new.path, new.size, new.checksum, new.hits) == ("b", 3, "c3", 0)


# Timestamps.


async def test_datetimes_round_trip_as_aware_utc(sessionmaker: Maker) -> None:  # noqa: F811
    local = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    async with sessionmaker() as db, db.begin():
        repos = Repos(db)
        session, _ = await _new_session(repos)
        await repos.sessions.touch(session.id, local)
    async with sessionmaker() as db:
        stored = await db.get(ChatSession, session.id)
        assert stored is not None
        assert stored.last_active_at == local and stored.last_active_at.tzinfo is UTC
        assert stored.last_active_at.hour == 1
        assert stored.created_at.tzinfo is UTC


async def test_naive_datetimes_are_rejected(repos: Repos) -> None:  # noqa: F811
    await repos.blocks.upsert_blocks([IndexedFile("aa", "a", 1, "c")], "m")
    with pytest.raises(StatementError, match="naive datetime"):
        await repos.blocks.touch_blocks(["aa"], datetime(2030, 1, 1))
    assert isinstance(await repos.blocks.get_block("aa"), KvBlock)


async def test_the_store_quota_counts_turns_other_answers_and_system_prompts(repos: Repos) -> None:  # noqa: F811
    owner = await repos.tenants.get_or_create_tenant("quota")
    row, _ = await repos.sessions.create(owner.id, model_fingerprint="m1", title="a long title", system_prompt="sys")
    await repos.turns.add_turn(row.id, "user", "hello", [])
    answer = await repos.turns.add_turn(row.id, "assistant", "", [])
    await repos.turns.finish_turn(answer.id, content="abc", token_ids=[], finish_reason=FinishReason.STOP)
    assert await repos.turns.chars_for_tenant(owner.id) == 3 + 5 + 3  # no other answers: nothing (a JSON null)
    await repos.turns.finish_turn(answer.id, content="abc", token_ids=[], finish_reason=FinishReason.STOP,
                                  alternatives=["xy", "é"])
    stored = await repos.turns.chars_for_tenant(owner.id)
    assert 3 + 5 + 3 + len("xy") + len("é") < stored <= 11 + 6 * 3 + 4 * 2 + 2  # their JSON text, escapes and all
    other, _ = await _new_session(repos)
    await repos.turns.add_turn(other.id, "user", "another tenant's", [])
    assert await repos.turns.chars_for_tenant(owner.id) == stored
