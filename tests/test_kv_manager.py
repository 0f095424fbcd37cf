"""The KV cache manager owns every table (issue 46, item 1), checked on a real `BlockPool` without a model:
`allocate_slots` answers None when the pool cannot serve, with nothing changed, and only after the
sessions' pins were reclaimed; a turn's table is pinned by the one rule (`keeps_pin`); `free` leaves
every block accounted for."""

from __future__ import annotations

from chatcore.cache import BlockPool, audit, cache_salt
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.pins import keeps_pin
from chatcore.engine.request import Request, SamplingParams
from chatcore.outcomes import FinishReason

SALT = cache_salt("test-kv-manager", 4, "none")


def admitted(kv_cache: KVCacheManager, request_id: str, prompt: list[int], session_id: str | None = None) -> Request:
    req = Request(request_id, prompt, SamplingParams(max_tokens=4), salt=SALT, session_id=session_id)
    kv_cache.get_computed_blocks(req, req.seqs)
    if not kv_cache.can_admit(req, alone=True):
        kv_cache.reclaim_pins_for(req)  # the scheduler's action when the pool lacks room
    assert kv_cache.can_admit(req, alone=True)
    kv_cache.admit(req)
    return req


def test_allocate_slots_answers_none_when_the_pool_cannot_serve_and_changes_nothing() -> None:
    pool = BlockPool(4, 4, low_watermark=0.0, high_watermark=0.0)
    kv_cache = KVCacheManager(pool, None, hot_window_s=60.0)
    req = admitted(kv_cache, "r", list(range(10)))
    seq = req.seqs[0]
    assert kv_cache.allocate_slots(req, seq, 12) is not None  # 3 blocks of 4
    before = (pool.num_available, list(kv_cache.block_ids(req, seq)))
    assert kv_cache.allocate_slots(req, seq, 8) is None  # 2 more blocks; 1 left
    assert (pool.num_available, list(kv_cache.block_ids(req, seq))) == before
    slots, copies = kv_cache.allocate_slots(req, seq, 4) or ([], [])
    assert len(slots) == 4 and copies == [] and pool.num_available == 0
    kv_cache.free(req)
    report = audit(pool)
    assert report.ok and report.used == 0 and not pool.tables, report.format()


def test_a_finished_turn_is_pinned_and_its_pin_is_reclaimed_before_an_allocation_fails() -> None:
    pool = BlockPool(4, 4, low_watermark=0.0, high_watermark=0.0)
    kv_cache = KVCacheManager(pool, None, hot_window_s=60.0)
    turn = admitted(kv_cache, "turn", list(range(6)), session_id="s1")
    seq = turn.seqs[0]
    assert kv_cache.allocate_slots(turn, seq, 6) is not None
    seq.finish_reason = FinishReason.STOP
    kv_cache.finish_seq(turn, seq)  # the session's first sample keeps its table to the end
    assert kv_cache.has_table(turn, seq)
    kv_cache.free(turn)
    assert kv_cache.pinned_sessions == ["s1"] and kv_cache.pins.blocks("s1") == 2
    other = admitted(kv_cache, "other", [50 + i for i in range(9)])
    assert kv_cache.allocate_slots(other, other.seqs[0], 16) is not None  # 4 blocks: the pin had to go
    assert kv_cache.pinned_sessions == []
    kv_cache.free(other)
    assert audit(pool).ok and not pool.tables


def test_a_stopped_sample_outside_a_session_goes_back_at_once() -> None:
    pool = BlockPool(8, 4, low_watermark=0.0, high_watermark=0.0)
    kv_cache = KVCacheManager(pool, None, hot_window_s=60.0)
    req = admitted(kv_cache, "r", list(range(6)))
    seq = req.seqs[0]
    assert kv_cache.allocate_slots(req, seq, 6) is not None
    seq.finish_reason = FinishReason.LENGTH
    kv_cache.finish_seq(req, seq)
    assert not kv_cache.has_table(req, seq) and pool.num_used == 0
    assert kv_cache.free(req) == [] and kv_cache.pinned_sessions == []


def test_the_pin_rule() -> None:
    assert keeps_pin("s", 0, FinishReason.STOP) and keeps_pin("s", 0, FinishReason.LENGTH)
    assert not keeps_pin(None, 0, FinishReason.STOP)  # not a session's turn
    assert not keeps_pin("s", 1, FinishReason.STOP)  # not its first sample
    assert not keeps_pin("s", 0, FinishReason.ERROR) and not keeps_pin("s", 0, None)  # failed, or still running
    assert keeps_pin("s") and not keeps_pin("s", saved=False) and not keeps_pin("s", session_live=False)
