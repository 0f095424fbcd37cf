"""A turn whose save fails: the real engine and a real SQLite file, made to fail by a trigger that
aborts the write as a full disk or a lost connection would."""

from __future__ import annotations

import sqlite3

import pytest

from chatcore.engine.commands import Audit, Unpin
from chatcore.server.errors import turn_frame
from tests.test_sessions import GREEDY, make_services, run_turn  # noqa: F401  (a fixture)

pytestmark = pytest.mark.model


def database_file(services) -> str:
    return str(services.settings.data_dir / "chatcore.db")


async def test_a_turn_whose_save_fails_ends_with_error_and_done_and_keeps_memory_as_the_database(
        make_services) -> None:  # noqa: F811
    services = await make_services(hot_window_s=60)
    state, _ = await services.sessions.create(services.local_tenant_id, system_prompt="You are concise.")
    await run_turn(services, state, "Name a colour.")
    tokens, messages = list(state.tokens), list(state.messages)

    with sqlite3.connect(database_file(services)) as db:
        db.execute("CREATE TRIGGER fail_finish BEFORE UPDATE ON turns "
                   "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    frames = await services.turns.start(state, "Name another.", GREEDY)
    follower = frames.subscribe(None)  # what an attached client receives (errors reach followers only)
    await frames.finished.wait()
    received = [turn_frame(follower.get_nowait()) for _ in range(follower.qsize())]  # as the server sends them
    assert [f["type"] for f in received][-2:] == ["error", "done"], received
    assert received[-2]["code"] == "internal" and received[-1]["finish_reason"] == "error"
    assert state.tokens == tokens and state.messages == messages and not state.turn_running
    # Nothing stays referenced: not the turn's table, not the pin it continued.
    report = await services.engine.send(Audit())
    assert report.ok and report.used == 0, report.format()
    assert state.id not in services.engine.state.pinned_sessions

    with sqlite3.connect(database_file(services)) as db:
        db.execute("DROP TRIGGER fail_finish")
    after = await run_turn(services, state, "And one more?")
    assert after["finish_reason"] in ("stop", "length")
    # What memory holds is what a reload from the database gives.
    await services.residency.background_idle()
    await services.sessions.go_cold(state)
    reloaded = await services.sessions.open(services.local_tenant_id, state.id)
    assert reloaded.tokens == state.tokens
    assert [m["content"] for m in reloaded.history()] == [m["content"] for m in state.history()]


async def test_unknown_and_malformed_session_ids_are_not_found_and_leave_nothing_behind(
        make_services) -> None:  # noqa: F811
    from chatcore.sessions.errors import NotFound

    services = await make_services()
    manager = services.sessions
    for session_id in ["A" * 22, "0" * 32, "../" * 8, "x" * 10_000, ""]:
        with pytest.raises(NotFound):
            await manager.open(services.local_tenant_id, session_id)
    assert manager._loading == {} and manager.live == {}


async def test_a_failed_exchange_stays_out_of_the_history_after_a_reload(make_services) -> None:  # noqa: F811
    from chatcore.store.repos import Repos

    services = await make_services()
    state, _ = await services.sessions.create(services.local_tenant_id)
    await run_turn(services, state, "Name a colour.")
    history, tokens = state.history(), list(state.tokens)
    # The rows a turn that ended in `error` leaves (its exchange never joined the history in memory).
    async with services.sessionmaker() as db, db.begin():
        repos = Repos(db)
        await repos.turns.add_turn(state.id, "user", "This one fails.", [1, 2, 3])
        failed = await repos.turns.add_turn(state.id, "assistant", "", [])
        await repos.turns.finish_turn(failed.id, content="half an ans", token_ids=[4, 5], finish_reason="error")
    await services.sessions.go_cold(state)
    reloaded = await services.sessions.open(services.local_tenant_id, state.id)
    assert reloaded.history() == history and reloaded.tokens == tokens
    after = await run_turn(services, reloaded, "Name another.")
    assert after["finish_reason"] in ("stop", "length")


async def test_a_cancel_that_comes_while_the_prefix_is_attached_is_not_lost(make_services) -> None:  # noqa: F811
    services = await make_services(hot_window_s=60)
    state, _ = await services.sessions.create(services.local_tenant_id, system_prompt="You are concise.")
    await run_turn(services, state, "Name a colour.")
    tokens = list(state.tokens)
    # `start` returns before the turn's task has run at all: the cancel reaches the engine before
    # the request does (its abort finds nothing), while the turn attaches the pinned history.
    frames = await services.turns.start(state, "Count slowly to one hundred.", GREEDY)
    await services.turns.cancel(state)
    await frames.finished.wait()
    done = frames.done_frame
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] == 0
    assert not [f for f in frames.frames if f["type"] == "token"]
    assert state.tokens[:len(tokens)] == tokens
    await services.engine.send(Unpin(state.id))
    report = await services.engine.send(Audit())
    assert report.ok and report.used == 0, report.format()


async def test_opening_a_session_while_it_goes_cold_returns_its_live_state(make_services) -> None:  # noqa: F811
    import asyncio

    services = await make_services()
    manager = services.sessions
    state, _ = await manager.create(services.local_tenant_id)
    await run_turn(services, state, "Name a colour.")
    async with state.lock:  # as the eviction policy demotes it
        opening = asyncio.create_task(manager.open(services.local_tenant_id, state.id))
        await manager.go_cold(state)  # its awaits let `open` run up to the session's lock
        assert not opening.done()
    opened = await opening
    assert opened is not state and manager.live[state.id] is opened  # not a dropped copy: no fork
    assert opened.tokens == state.tokens


async def test_a_turn_whose_bookkeeping_fails_still_sends_done_and_keeps_its_pin(make_services) -> None:  # noqa: F811
    import asyncio

    services = await make_services(hot_window_s=60)
    state, _ = await services.sessions.create(services.local_tenant_id, system_prompt="You are concise.")

    def broken(*args, **kwargs) -> None:  # as a Prometheus counter refuses a negative increment
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    services.turns.metrics.record_request = broken
    done = await asyncio.wait_for(run_turn(services, state, "Name a colour."), 120)
    assert done["finish_reason"] in ("stop", "length") and state.messages[-1]["role"] == "assistant"
    assert state.id in services.engine.state.pinned_sessions  # the turn's table became the session's pin
    await services.engine.send(Unpin(state.id))
    report = await services.engine.send(Audit())
    assert report.ok and report.used == 0, report.format()
