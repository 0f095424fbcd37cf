"""The KV cache manager owns every table (issue 46, item 1), checked on a real `BlockPool` without a model:
`allocate_slots` answers None when the pool cannot serve, with nothing changed, and only after the
sessions' pins were reclaimed; a turn's table is pinned by the one rule (`keeps_pin`); `free` leaves
every block accounted for. Issue 56, item 2: `can_admit` is a question (reclaiming pins is the
caller's action); the block ids a step keeps are a copy that copy-on-write leaves alone; resize, stats
and the prefix cache's reset go through the manager."""

from __future__ import annotations

import torch

from chatcore.cache import BlockPool, audit, cache_salt
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.pins import keeps_pin
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.engine.scheduler import Scheduler
from chatcore.kv.tensors import KVTensors
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


def _pool_state(pool: BlockPool, kv_cache: KVCacheManager) -> tuple[object, ...]:
    """Everything a question might change: each block's count and state, the pins, the registry."""
    return ([block.ref for block in pool.blocks], pool.free_ids(), pool.lru_ids(), kv_cache.pinned_sessions,
            [(table.owner, list(table.block_ids)) for table in pool.tables])


def test_can_admit_changes_nothing_and_reclaiming_pins_is_the_callers_action() -> None:
    pool = BlockPool(4, 4, low_watermark=0.0, high_watermark=0.0)
    kv_cache = KVCacheManager(pool, None, hot_window_s=60.0)
    turn = admitted(kv_cache, "turn", list(range(6)), session_id="s1")
    assert kv_cache.allocate_slots(turn, turn.seqs[0], 6) is not None
    turn.seqs[0].finish_reason = FinishReason.STOP
    kv_cache.free(turn)  # s1's pin holds 2 of the 4 blocks
    other = Request("other", [50 + i for i in range(9)], SamplingParams(max_tokens=4), salt=SALT)
    kv_cache.get_computed_blocks(other, other.seqs)  # 3 blocks to go
    before = _pool_state(pool, kv_cache)
    assert not kv_cache.can_admit(other, alone=True) and not kv_cache.can_admit(other, alone=False)
    assert _pool_state(pool, kv_cache) == before and kv_cache.pinned_sessions == ["s1"]
    kv_cache.reclaim_pins_for(other)
    assert kv_cache.pinned_sessions == [] and kv_cache.can_admit(other, alone=False)
    kv_cache.admit(other)
    kv_cache.free(other)
    assert audit(pool).ok and not pool.tables


def test_the_block_ids_a_step_keeps_never_change_under_copy_on_write() -> None:
    pool = BlockPool(16, 4, low_watermark=0.0, high_watermark=0.0)
    kv_cache = KVCacheManager(pool, None, hot_window_s=60.0)
    scheduler = Scheduler(kv_cache, max_batch_tokens=64, max_num_seqs=4, max_queue_wait_s=60.0, max_context=64)
    req = Request("r", list(range(6)), SamplingParams(max_tokens=4, n=2), salt=SALT)
    scheduler.add(req)
    (entry,) = scheduler.schedule().prefill  # the prompt's 6 tokens: a full block and a partial one
    kept = list(entry.block_ids)
    assert isinstance(entry.block_ids, tuple) and len(kept) == 2
    first = req.seqs[0]
    first.num_computed = len(first.tokens)
    second = TokenSequence(1, list(first.tokens), len(first.tokens), num_computed=len(first.tokens))
    kv_cache.fork(req, first, second)  # the partial last block is now shared
    req.seqs.append(second)
    for seq in req.seqs:
        seq.tokens.append(100 + seq.index)
        _, copies = kv_cache.allocate_slots(req, seq, 1) or ([], [])
        assert copies == [] or copies[0][0] == kept[1]  # the first writer copies the shared block
    assert kv_cache.block_ids(req, first)[1] != kept[1]  # the table's last block moved ...
    assert list(entry.block_ids) == kept  # ... the step's row did not
    kv_cache.free(req)
    scheduler.remove(req)
    assert audit(pool).ok and not pool.tables


def test_resize_stats_and_prefix_cache_reset_go_through_the_manager() -> None:
    pool = BlockPool(8, 4, low_watermark=0.0, high_watermark=0.0)
    kv = KVTensors(1, 8, 4, 1, 8, torch.float32)
    kv_cache = KVCacheManager(pool, kv, hot_window_s=60.0)
    req = admitted(kv_cache, "r", list(range(9)))
    seq = req.seqs[0]
    assert kv_cache.allocate_slots(req, seq, 9) is not None
    seq.num_computed = 9
    kv_cache.cache_blocks(req, seq)
    kv_cache.free(req)  # 2 full blocks stay cached-free
    assert kv_cache.resize(16) == 16 == kv.num_blocks == kv_cache.num_blocks
    stats = kv_cache.stats()
    assert (stats.total, stats.cached, stats.used, stats.hashed) == (16, 2, 0, 2)
    assert kv_cache.reset_prefix_cache() == 2
    stats = kv_cache.stats()
    assert (stats.cached, stats.free, stats.hashed) == (0, 16, 0)
    assert kv_cache.resize(4) == 4 == kv.num_blocks == pool.num_blocks
    assert kv_cache.audit().ok
