"""Disconnect storm (issue 9, item 2).

Many clients drop at random points in the middle of a turn, some with a close frame and some by just
cutting the TCP connection. Half reconnect within the grace period with their `last_seq` and must get the
whole answer, with no gap and no duplicate by `seq`; half never come back, and their turns must end
`disconnected` with their blocks released. At the end no block is in use.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest

from tests.reliability_helpers import (
    GREEDY,
    LONG_ANSWER,
    Chat,
    Turn,
    assert_contiguous,
    cache,
    history,
    log_problems,
    private_system,
    report,
    sizes,
    wait_for,
    wait_idle,
)
from tests.server_helpers import start_server

pytestmark = pytest.mark.model
SEED = 90210


@dataclass(frozen=True)
class Storm:
    clients: int
    grace_s: float
    answer_tokens: int  # a reconnecting client's whole answer
    endless_tokens: int  # an abandoned turn's max_tokens: it cannot finish within the grace period


@dataclass
class Outcome:
    index: int
    reconnects: bool
    how: str
    session_id: str = ""
    seen: Turn | None = None
    rest: Turn | None = None


async def storm_client(server, index: int, storm: Storm, rng: random.Random) -> Outcome:
    reconnects = index % 2 == 0
    out = Outcome(index, reconnects, rng.choice(["abort", "close"]))
    chat = Chat(server)
    await chat.hello(system_prompt=private_system(f"storm-{index}") if reconnects and index % 4 else None)
    out.session_id = chat.session_id
    max_tokens = storm.answer_tokens if reconnects else storm.endless_tokens
    # An abandoned turn ignores end-of-sequence, so it cannot finish within the grace period.
    params = {**GREEDY, "max_tokens": max_tokens, "ignore_eos": not reconnects}
    turn = await chat.send_user(LONG_ANSWER, params, client_id=f"q{index}")
    drop_after = rng.randint(0, storm.answer_tokens // 2)  # 0: right after `start`
    async with asyncio.timeout(600):
        while not any(f["type"] == "start" for f in turn.frames):
            await chat.recv(turn, 600)
    assert await chat.until_tokens(turn, drop_after), turn.frames
    out.seen = turn
    if out.how == "abort":
        chat.drop()
    else:
        await chat.close()
    if not reconnects:
        return out
    await asyncio.sleep(rng.uniform(0, storm.grace_s / 4))  # the fault: how long the client stays away
    again = Chat(server)
    again.session_id, again.resume_token, again.last_seq = chat.session_id, chat.resume_token, chat.last_seq
    await again.hello(resume=True)
    rest = Turn(turn.client_id, LONG_ANSWER)
    out.rest = await again.until_done(rest, timeout=600)
    await again.close()
    return out


@pytest.mark.parametrize("storm", sizes(Storm(clients=20, grace_s=6, answer_tokens=24, endless_tokens=1500),
                                        Storm(clients=100, grace_s=12, answer_tokens=32, endless_tokens=1500)))
async def test_disconnect_storm(tmp_path, capsys, storm: Storm) -> None:
    server = start_server(tmp_path / "storm", disconnect_grace_s=storm.grace_s, hot_window_s=0,
                          max_turns_per_tenant=storm.clients, max_num_seqs=128, max_queue_wait_s=600)
    rng = random.Random(SEED)
    seeds = [rng.random() for _ in range(storm.clients)]
    try:
        started = time.monotonic()
        outcomes = await asyncio.gather(*(storm_client(server, i, storm, random.Random(seeds[i]))
                                          for i in range(storm.clients)))
        after_reconnect = 0
        for out in outcomes:
            if not out.reconnects:
                continue
            assert out.rest is not None and out.rest.done is not None, (out.index, out.rest and out.rest.frames)
            assert not out.rest.errors, out.rest.errors
            assert out.rest.done["finish_reason"] in ("stop", "length"), out.rest.done
            frames = out.seen.frames + out.rest.frames
            assert_contiguous([f["seq"] for f in frames if "seq" in f], f"client {out.index}")
            after_reconnect += len(out.rest.frames)
            saved = history(server, out.session_id)[-1]
            assert saved["finish_reason"] == out.rest.done["finish_reason"]
            assert saved["content"] == out.seen.text + out.rest.text, out.index

        def abandoned_ended() -> bool:
            return all(history(server, o.session_id)[-1]["finish_reason"] is not None
                       for o in outcomes if not o.reconnects)

        await wait_for(abandoned_ended, "the abandoned turns to end", deadline_s=storm.grace_s + 300, interval_s=0.5)
        for out in outcomes:
            if out.reconnects:
                continue
            saved = history(server, out.session_id)[-1]
            assert saved["finish_reason"] == "disconnected", (out.index, saved)
            assert saved["content"].startswith(out.seen.text)
            assert saved["usage"]["completion_tokens"] < storm.endless_tokens
        idle = await wait_idle(server, deadline_s=120)
        problems = log_problems(server)
        assert not problems, problems[:10]
        final = cache(server)["audit"]
        report(capsys, f"disconnect storm [{storm.clients} clients, grace {storm.grace_s:g} s]", {
            "clients dropped mid-turn": len(outcomes),
            "dropped by TCP abort / close frame": f"{sum(o.how == 'abort' for o in outcomes)} / "
                                                  f"{sum(o.how == 'close' for o in outcomes)}",
            "reconnected, whole answer": sum(o.reconnects for o in outcomes),
            "abandoned, ended disconnected": sum(not o.reconnects for o in outcomes),
            "frames received after reconnecting": after_reconnect,
            "gaps or duplicates by seq": 0,
            "wall s": time.monotonic() - started,
            "final audit": f"ok={final['ok']} used={final['used']} sum_refs={final['sum_refs']}",
            "blocks leaked": idle["audit"]["used"],
            "turns lost": 0,
        })
    finally:
        server.stop()
