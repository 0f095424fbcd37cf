"""The sessions suite: its offline replay on hand-made traces and its overflow sizing (its run
through real servers is checked in tests/test_bench.py, on the shared tiny bench run)."""

from __future__ import annotations

import pytest

from chatcore.bench.replay import Request, belady_hits, one_slot_hits, pool_hits, replay
from chatcore.bench.sessions import OVERFLOW, overflow_tiers

BS = 4


def cyclic(sessions: int, rounds: int) -> list[Request]:
    """Sessions taking turns round-robin, each sending the same 9-token prompt every turn (a
    1-token answer, no end-of-turn tokens): 9 computed tokens = 2 full blocks, both looked up
    ((9 - 1) // 4 = 2), so a hit is 8 tokens. No two sessions share a token."""
    return [Request(s, t, tuple(100 * s + i for i in range(9)), (7,), ())
            for t in range(rounds) for s in range(sessions)]


def test_belady_on_a_cycle_where_lru_keeps_nothing() -> None:
    """A B C A B C A B C with room for two sessions (4 blocks).

    LRU always evicts the session that comes next: no hits. Belady, by hand: after A B the cache
    is full; C evicts B (next used at 4, A at 3); A (3) hits, B (4) misses and evicts A (next at
    6; C's is 5); C (5) hits, A (6) misses and evicts C (next at 8; B's is 7); B (7) hits, C (8)
    misses. Three hits of 8 tokens."""
    trace = cyclic(3, 3)
    assert belady_hits(trace, 4, BS) == [0, 0, 0, 8, 0, 8, 0, 8, 0]
    # The pool also holds each request's partial tail block (10 tokens: 3 blocks), hence 5.
    assert pool_hits(trace, 5, BS, "lru") == [0] * 9
    assert one_slot_hits(trace) == [0] * 9  # the previous request is always another session
    with pytest.raises(ValueError):
        belady_hits(trace, 1, BS)


def test_one_slot_reuses_only_the_previous_request() -> None:
    a0 = Request(0, 0, (1, 2, 3, 4, 5), (6,), (9,))
    a1 = Request(0, 1, a0.history + (10, 11), (12,), (9,))
    b0 = Request(1, 0, (1, 2, 30, 40), (6,), (9,))
    # a1 follows a0: its computed tokens (the prompt and the answer but its last id) are reused.
    assert one_slot_hits([a0, a1]) == [0, 5]
    # b0 in between leaves only the two tokens a1 shares with it.
    assert one_slot_hits([a0, b0, a1]) == [0, 2, 2]


def test_replay_with_room_for_everything_hits_alike() -> None:
    trace = cyclic(3, 3)
    result = replay(trace, 64, BS)
    rates = {p: r["hit_rate"] for p, r in result["policies"].items()}
    assert rates.pop("one_slot") == 0
    assert list(rates.values()) == [pytest.approx(48 / 81)] * len(rates)  # each turn after the first: 8 of 9
    assert result["policies"]["belady"]["hit_rate_by_turn"] == [0, pytest.approx(8 / 9), pytest.approx(8 / 9)]


def test_overflow_tiers_hold_two_thirds_of_the_working_set() -> None:
    trace = [Request(s, 0, tuple(range(1000 * s, 1000 * s + 600)), (1,) * 8, (2, 3)) for s in range(40)]
    sizing = overflow_tiers(trace, 16, 1000)
    assert sizing["working_set_blocks"] == 40 * (610 // 16)
    assert sizing["device_blocks"] + sizing["disk_blocks"] == round(sizing["working_set_blocks"] / OVERFLOW)
    assert sizing["device_blocks"] >= 2 * -(-610 // 16) and sizing["device_blocks"] < sizing["disk_blocks"]
    assert sizing["disk_bytes"] == sizing["disk_blocks"] * 16 * 1000
