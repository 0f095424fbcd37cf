"""Conversation-level eviction: the forecast alone, then a round-robin trace replayed through the pool."""

from __future__ import annotations

import random

import pytest

from chatcore.cache import BlockPool, BlockTable, SequenceOwner, audit, cache_salt, longest_prefix
from chatcore.cache.forecast import ReuseForecast

BS = 4
SALT = cache_salt("test-model", BS, "float32")


def always(_: object) -> bool:
    return True


def test_round_robin_evicts_the_conversation_used_last_and_keeps_it_the_victim() -> None:
    forecast: ReuseForecast[str] = ReuseForecast()
    for now in range(8):  # a, b, c, d, a, b, c, d: every gap is 4
        name = "abcd"[now % 4]
        forecast.claim(name, [f"{name}{i}" for i in range(3)], float(now))
    # d was used last, so it comes back last: its tail goes first, then the rest of d.
    evicted = []
    for _ in range(3):
        key = forecast.victim(8.0, always)
        assert key is not None
        evicted.append(key)
        forecast.forget(key)
    assert evicted == ["d2", "d1", "d0"]
    assert forecast.victim(8.0, always) == "c2"


def test_an_overdue_conversation_goes_before_a_regular_one() -> None:
    forecast: ReuseForecast[str] = ReuseForecast()
    for now, name in [(0, "old"), (1, "old"), (2, "new"), (3, "new"), (4, "new"), (5, "new")]:
        forecast.claim(name, [f"{name}0"], float(now))
    # "old" came every 1 s and has been away for 4 s; "new" was used a moment ago.
    assert forecast.wait("old", 5.0) > forecast.wait("new", 5.0)
    assert forecast.victim(5.0, always) == "old0"


def test_the_victim_changes_when_it_is_used_again_and_blocks_move_with_claims() -> None:
    forecast: ReuseForecast[str] = ReuseForecast()
    forecast.claim("a", ["root", "a1"], 0.0)
    forecast.claim("b", ["root", "b1"], 1.0)  # the shared root now belongs to b
    assert forecast.owner("root") == "b"
    forecast.claim("a", ["root", "a1"], 2.0)
    forecast.claim("b", ["root", "b1"], 3.0)
    assert forecast.victim(3.5, lambda key: key != "root") == "b1"
    forecast.claim("b", ["root", "b1", "b2"], 4.0)  # b is back: no longer the victim
    assert forecast.victim(4.5, lambda key: key != "root") == "b2"
    forecast.claim("b", ["b9"], 5.0)  # a branch without the old chain: root and b1 leave b
    assert forecast.owner("root") is None and forecast.owner("b1") is None
    forecast.drop("a")
    assert forecast.owner("a1") is None and len(forecast) == 1


def replay(policy: str, sessions: int, turns: int, capacity: int,
           slowdown: float = 1.0) -> tuple[list[float], BlockPool]:
    """Round robin over `sessions`, one turn at a time; per turn, the token hit rate. Each round's
    turns take `slowdown` times as long as the last round's (histories grow, turns slow down)."""
    clock = [0.0]
    pool = BlockPool(capacity, BS, low_watermark=0.0, high_watermark=0.0, eviction=policy,
                     clock=lambda: clock[0])
    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(2 * BS)]
    histories = {s: list(system) for s in range(sessions)}
    rates: list[float] = []
    for turn in range(turns):
        hit = total = 0
        for s in range(sessions):
            clock[0] += slowdown ** turn
            prompt = histories[s] + [rng.randrange(1000) for _ in range(3 * BS - 1)]
            ids, hashes = longest_prefix(pool.find, prompt, BS, SALT, (len(prompt) - 1) // BS)
            table = BlockTable.from_prefix(pool, ids, hashes, owner=SequenceOwner(f"s{s}", 0))
            answer = [rng.randrange(1000) for _ in range(BS)]
            table.append_slots(len(prompt) + len(answer) - table.num_tokens)
            histories[s] = prompt + answer
            table.commit(histories[s], len(histories[s]), SALT)
            pool.claim(f"s{s}", table.block_ids)
            table.release()
            hit += len(ids) * BS
            total += len(prompt)
        rates.append(hit / total)
        audit(pool).raise_if_bad()
    return rates, pool


@pytest.mark.parametrize("sessions", [12, 32])
def test_a_cyclic_trace_keeps_some_conversations_whole_where_lru_keeps_none(sessions: int) -> None:
    turns = 8
    # Each turn adds 4 blocks; the final working set (2 shared + 4*turns per session) is 1.5x the pool.
    working_set = 2 + sessions * 4 * turns
    capacity = working_set * 2 // 3
    lru, _ = replay("lru", sessions, turns, capacity)
    ours, pool = replay("session", sessions, turns, capacity)
    assert pool.evictions > 0
    # Once the working set outgrows the pool, LRU evicts each conversation just before it comes
    # back, and only the shared system prompt hits. Conversation-level eviction keeps most whole.
    assert max(lru[-2:]) < 0.2
    assert min(ours[-2:]) > 0.6
    assert sum(ours[-2:]) > 4 * sum(lru[-2:])


@pytest.mark.parametrize("slowdown", [1.1, 1.3])
def test_a_cycle_that_slows_down_still_keeps_conversations_whole(slowdown: float) -> None:
    """Each round takes longer than the last, so every conversation comes back a little after its
    average gap. Being late by less than a gap is not being gone: the next in line must not become
    the victim (which would make the policy LRU again)."""
    sessions, turns = 32, 8
    capacity = (2 + sessions * 4 * turns) * 2 // 3
    lru, _ = replay("lru", sessions, turns, capacity, slowdown)
    ours, _ = replay("session", sessions, turns, capacity, slowdown)
    assert max(lru[-2:]) < 0.2
    assert min(ours[-2:]) > 0.6
