"""Load, with the engine's debug audit on (issue 9, items 1 and 7).

Many WebSocket clients each hold a multi-turn conversation at once, half of them on one shared system
prompt and half on private ones. Every turn must complete, /healthz must answer within 1 s throughout,
the audit (run by the engine after every step: CHATCORE_DEBUG_AUDIT=1) must never fail, and at the end
every block is accounted for and none is in use. Figures: turns per second, TTFT p50/p99.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from tests.reliability_helpers import (
    GREEDY,
    QUESTIONS,
    SHARED_SYSTEM,
    Chat,
    HealthProbe,
    Turn,
    assert_contiguous,
    cache,
    history,
    log_problems,
    metrics,
    percentile,
    private_system,
    report,
    sizes,
    wait_idle,
)
from tests.server_helpers import start_server

pytestmark = pytest.mark.model
HEALTH_LIMIT_S = 1.0


@dataclass(frozen=True)
class Load:
    clients: int
    turns: int
    max_tokens: int


async def converse(server, index: int, load: Load) -> tuple[Chat, str | None, list[Turn]]:
    chat = Chat(server)
    system = SHARED_SYSTEM if index % 2 == 0 else private_system(f"load-{index}")
    await chat.hello(system_prompt=system, title=f"load {index}")
    turns = []
    for t in range(load.turns):
        question = f"{QUESTIONS[(index + t) % len(QUESTIONS)]} (client {index}, turn {t + 1})"
        turn = await chat.turn(question, {**GREEDY, "max_tokens": load.max_tokens}, timeout=600)
        assert turn.done is not None, (index, t, turn.frames)
        turns.append(turn)
    await chat.close()
    return chat, system, turns


@pytest.mark.parametrize("load", sizes(Load(clients=16, turns=3, max_tokens=12), Load(clients=64, turns=5,
                                                                                          max_tokens=16)))
async def test_many_clients_multi_turn_with_debug_audit(tmp_path, capsys, load: Load) -> None:
    server = start_server(tmp_path / "load", debug_audit=1, hot_window_s=2, max_num_seqs=64,
                          max_turns_per_tenant=load.clients, max_queue_wait_s=600, disconnect_grace_s=60)
    try:
        with HealthProbe(server) as probe:
            started = time.monotonic()
            results = await asyncio.gather(*(converse(server, i, load) for i in range(load.clients)))
            wall = time.monotonic() - started
        turns = [turn for _, _, ts in results for turn in ts]
        # Every turn completed, its frames numbered without gaps, and its answer is in the history as streamed.
        assert len(turns) == load.clients * load.turns
        for chat, _, ts in results:
            stored = [m for m in history(server, chat.session_id) if m["role"] == "assistant"]
            assert len(stored) == len(ts)
            for turn, saved in zip(ts, stored, strict=True):
                assert not turn.errors, turn.errors
                assert turn.done["finish_reason"] in ("stop", "length"), turn.done
                assert turn.frames[0]["type"] == "start"
                assert_contiguous(turn.seqs, f"session {chat.session_id}")
                assert saved["content"] == turn.text and saved["finish_reason"] == turn.done["finish_reason"]
        # Sessions on the shared system prompt found it cached (all but the very first, at most).
        shared_first = [ts[0].done["usage"]["cached_tokens"] for _, system, ts in results if system == SHARED_SYSTEM]
        assert sum(1 for c in shared_first if c > 0) >= len(shared_first) - 1, shared_first
        assert probe.latencies and not probe.failures, probe.failures[:5]
        assert probe.worst_s < HEALTH_LIMIT_S, f"/healthz took {probe.worst_s:.2f} s"
        idle = await wait_idle(server, deadline_s=120)
        problems = log_problems(server)
        assert not problems, problems[:10]
        final = cache(server)["audit"]
        samples = metrics(server)
        ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
        server_ttfts = [t.done["timing"]["ttft_ms"] / 1000 for t in turns if t.done["timing"]["ttft_ms"] is not None]
        report(capsys, f"load [{load.clients} clients x {load.turns} turns, debug audit]", {
            "turns completed": f"{len(turns)} / {load.clients * load.turns}",
            "wall s": wall,
            "turns per s": len(turns) / wall,
            "tokens per s": sum(t.done["usage"]["completion_tokens"] for t in turns) / wall,
            "TTFT p50 s (client)": percentile(ttfts, 50),
            "TTFT p99 s (client)": percentile(ttfts, 99),
            "TTFT p50 s (server)": percentile(server_ttfts, 50),
            "TTFT p99 s (server)": percentile(server_ttfts, 99),
            "/healthz probes": len(probe.latencies),
            "/healthz worst s": probe.worst_s,
            "preemptions": samples.get("chatcore_preemptions_total", 0.0),
            "audit violations (debug, every step)": len(problems),
            "final audit": f"ok={final['ok']} total={final['total']} free={final['free']} "
                           f"cached={final['cached']} used={final['used']}",
            "blocks leaked": idle["audit"]["used"],
            "turns lost": load.clients * load.turns - len(turns),
        })
    finally:
        server.stop()
