"""KV exhaustion (issue 9, item 3).

A tiny pool gets three times the KV demand it holds (each request's worst case: its prompt plus
max_tokens, in blocks, summed over the requests that arrive together). No deadlock: every request ends,
finished or `busy`, and no request goes longer than `max_queue_wait_s` (plus a step's slack) without
hearing from the server. Preemptions show in the metrics. A request that can never fit is refused at once.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.reliability_helpers import (
    GREEDY,
    LONG_ANSWER,
    Chat,
    Turn,
    cache,
    history,
    log_problems,
    metrics,
    report,
    sizes,
    wait_idle,
)
from tests.server_helpers import start_server

pytestmark = pytest.mark.model
BLOCK = 16
REFUSE_WITHIN_S = 2.0
SLACK_S = 10.0  # one loaded engine step, plus the event loop's turn, on a busy two-core machine


@dataclass(frozen=True)
class Exhaustion:
    pool_blocks: int
    max_tokens: int
    clients: int
    max_queue_wait_s: float


def worst_case_blocks(prompt_tokens: int, max_tokens: int) -> int:
    """The admission bound (chatcore/engine/fits.py `worst_case_blocks`), for one sequence."""
    return -(-prompt_tokens // BLOCK) + -(-max_tokens // BLOCK) + 1


async def one_request(server, index: int, ex: Exhaustion) -> tuple[Chat, Turn]:
    chat = Chat(server)
    await chat.hello()
    # The same greedy count in every session, run to max_tokens, so the answers' blocks are real demand.
    turn = await chat.send_user(LONG_ANSWER, {**GREEDY, "max_tokens": ex.max_tokens, "ignore_eos": True})
    await chat.until_done(turn, timeout=900)
    await chat.close()
    return chat, turn


def longest_silence(turn: Turn) -> float:
    """The longest time the client waited for the server's next frame of this turn."""
    times = [turn.sent_at] + turn.frame_times
    return max(b - a for a, b in itertools.pairwise(times))


@pytest.mark.parametrize("ex", sizes(Exhaustion(pool_blocks=64, max_tokens=96, clients=20, max_queue_wait_s=8),
                                     Exhaustion(pool_blocks=128, max_tokens=128, clients=40, max_queue_wait_s=15)))
async def test_three_times_the_pool(tmp_path, capsys, ex: Exhaustion) -> None:
    server = start_server(tmp_path / "exhaust", num_blocks=ex.pool_blocks, hot_window_s=0, kv_disk_gb=0,
                          max_queue_wait_s=ex.max_queue_wait_s, max_turns_per_tenant=ex.clients + 4,
                          max_num_seqs=64, disconnect_grace_s=60)
    try:
        # Requests that can never fit are refused at once, over the WebSocket and over HTTP.
        never = Chat(server)
        await never.hello()
        refusals = []
        for params, content in (({**GREEDY, "max_tokens": ex.pool_blocks * BLOCK}, "Hi"),
                                ({**GREEDY, "max_tokens": 4}, "word " * (ex.pool_blocks * BLOCK))):
            turn = await never.turn(content, params, timeout=30)
            refusals.append(turn.frames[-1]["type"] == "error" and time.monotonic() - turn.sent_at)
            assert [f.get("code") for f in turn.frames] == ["too_large"], turn.frames
        started = time.monotonic()
        resp = await asyncio.to_thread(httpx.post, server.base_url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": ex.pool_blocks * BLOCK})
        refusals.append(time.monotonic() - started)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large", resp.text
        assert max(refusals) < REFUSE_WITHIN_S, refusals
        await never.close()

        before = metrics(server).get("chatcore_preemptions_total", 0.0)
        started = time.monotonic()
        results = await asyncio.gather(*(one_request(server, i, ex) for i in range(ex.clients)))
        wall = time.monotonic() - started
        finished = busy = 0
        offered = 0
        for chat, turn in results:
            done = turn.done
            assert done is not None, turn.frames  # nobody is left hanging
            offered += worst_case_blocks(done["usage"]["prompt_tokens"], ex.max_tokens)
            if done["finish_reason"] == "error":
                assert [f["code"] for f in turn.errors] == ["busy"], turn.frames
                busy += 1
            else:
                assert done["finish_reason"] in ("stop", "length") and not turn.errors, turn.frames
                finished += 1
                saved = history(server, chat.session_id)[-1]
                assert saved["content"] == turn.text  # recompute after preemption neither lost nor repeated text
            assert longest_silence(turn) <= ex.max_queue_wait_s + SLACK_S, (longest_silence(turn), turn.frames[-3:])
        # The pool saw at least 3x its size in demand, and had to preempt.
        assert offered >= 3 * ex.pool_blocks, offered
        preemptions = metrics(server).get("chatcore_preemptions_total", 0.0) - before
        assert preemptions > 0
        assert finished > 0
        # Nothing is stuck: a new request runs to the end.
        chat = Chat(server)
        await chat.hello()
        after = await chat.turn("Say hi.", {**GREEDY, "max_tokens": 4}, timeout=300)
        assert after.done and after.done["finish_reason"] in ("stop", "length"), after.frames
        await chat.close()
        idle = await wait_idle(server, deadline_s=120)
        problems = log_problems(server)
        assert not problems, problems[:10]
        final = cache(server)["audit"]
        report(capsys, f"exhaustion [{ex.pool_blocks}-block pool, {ex.clients} requests]", {
            "offered KV demand (blocks, worst case)": offered,
            "offered / pool": offered / ex.pool_blocks,
            "finished": finished,
            "busy (no capacity within max_queue_wait_s)": busy,
            "hung": 0,
            "max_queue_wait_s": ex.max_queue_wait_s,
            "longest silence s": max(longest_silence(t) for _, t in results),
            "preemptions (metric)": preemptions,
            "never-fits refusals (ws, ws, http) s": ", ".join(f"{r:.3f}" for r in refusals),
            "wall s": wall,
            "final audit": f"ok={final['ok']} used={final['used']}",
            "blocks leaked": idle["audit"]["used"],
        })
    finally:
        server.stop()
