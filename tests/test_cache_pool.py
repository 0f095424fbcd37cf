"""Unit tests of the block pool, tables, prefix index and audit (pure Python, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chatcore.cache import (
    BlockPool,
    BlockTable,
    SequenceOwner,
    CacheError,
    NoFreeBlocks,
    audit,
    cache_salt,
    chain_hashes,
    hash_block,
    longest_prefix,
)

SALT = cache_salt("test-model", 16, "float32")


def filled_table(pool: BlockPool, tokens: list[int], owner: str = "t", salt: bytes = SALT) -> BlockTable:
    """A table for `tokens`, reusing the longest cached prefix, with its full blocks committed."""
    ids, hashes = longest_prefix(pool.find, tokens, pool.block_size, salt)
    table = BlockTable.from_prefix(pool, ids, hashes, owner=SequenceOwner(owner, 0))
    table.append_slots(len(tokens) - table.num_tokens)
    table.commit(tokens, len(tokens), salt)
    return table


def assert_clean(pool: BlockPool) -> None:
    report = audit(pool)
    assert report.ok, report.format()


def test_cache_package_does_not_import_torch() -> None:
    code = "import sys, chatcore.cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocate_takes_adjacent_blocks_and_release_frees_them() -> None:
    pool = BlockPool(8, 4)
    table = BlockTable(pool, SequenceOwner("a", 0))
    slots, copies = table.append_slots(10)
    assert copies == []
    assert table.block_ids == [0, 1, 2]
    assert slots == list(range(10))
    assert pool.num_used == 3
    assert_clean(pool)
    table.release()
    assert pool.num_used == 0 and pool.num_free == 8
    assert_clean(pool)


def test_adjacency_hint_follows_the_previous_block() -> None:
    pool = BlockPool(8, 4)
    a = BlockTable(pool, SequenceOwner("a", 0))
    b = BlockTable(pool, SequenceOwner("b", 0))
    a.append_slots(4)
    b.append_slots(4)
    a.append_slots(1)  # a's last block is 0 and 1 is taken: the queue head, 2
    b.append_slots(1)  # b's last block is 1 and 2 is taken: the queue head, 3
    assert a.block_ids == [0, 2] and b.block_ids == [1, 3]
    a.release()  # frees 2, then 0, each to the queue's front: it is now 0 2 4 5 6 7
    c = BlockTable(pool, SequenceOwner("c", 0))
    c.append_slots(12)  # the blocks once written first (1 and 3 are taken), a fresh one only then
    assert c.block_ids == [0, 2, 4]
    assert_clean(pool)


def test_shared_prefix_three_sequences() -> None:
    pool = BlockPool(16, 16)
    system = list(range(1000, 1040))
    tables = [filled_table(pool, system + [i] * 5, f"seq{i}") for i in range(3)]
    shared = tables[0].block_ids[:2]
    for table in tables:
        assert table.block_ids[:2] == shared
    assert [pool.ref(b) for b in shared] == [3, 3]
    tails = {t.block_ids[2] for t in tables}
    assert len(tails) == 3 and all(pool.ref(b) == 1 for b in tails)
    report = audit(pool)
    assert report.ok and report.used == 5 and report.sum_refs == 9 == report.sum_table_lens
    for table in tables:
        table.release()
    assert pool.num_used == 0 and pool.num_cached == 2
    assert_clean(pool)


def test_prefix_hit_after_release_and_token_verification() -> None:
    pool = BlockPool(8, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table = filled_table(pool, tokens)
    first_two = table.block_ids[:2]
    table.release()
    ids, hashes = longest_prefix(pool.find, tokens, 4, SALT)
    assert ids == first_two and hashes == chain_hashes(tokens, 4, SALT)
    # A hash that points at a block holding other tokens is never a hit.
    fake = pool.blocks[first_two[0]]
    fake.token_ids = (9, 9, 9, 9)
    assert longest_prefix(pool.find, tokens, 4, SALT) == ([], [])
    fake.token_ids = (1, 2, 3, 4)
    # Another salt (model, dtype, tenant) never hits.
    assert longest_prefix(pool.find, tokens, 4, cache_salt("other", 4, "float32")) == ([], [])
    assert_clean(pool)


def test_hashes_are_deterministic_across_processes() -> None:
    code = (
        "from chatcore.cache import cache_salt, hash_block, chain_hashes;"
        "s = cache_salt('m', 16, 'float32');"
        "print(chain_hashes(list(range(40)), 16, s)[-1].hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs.pop() == chain_hashes(list(range(40)), 16, cache_salt("m", 16, "float32"))[-1].hex()
    assert hash_block(bytes(16), [1, 2], SALT) != hash_block(bytes(16), [2, 1], SALT)


def test_fork_shares_and_copy_on_write_copies_partial_last_block() -> None:
    pool = BlockPool(16, 4)
    parent = filled_table(pool, list(range(10)), "parent")  # blocks: full, full, partial (2 tokens)
    children = [parent.fork(SequenceOwner("parent", i + 1)) for i in range(3)]
    assert all(pool.ref(b) == 4 for b in parent.block_ids)
    copies_seen = []
    for table in [parent, *children]:
        slots, copies = table.append_slots(1)
        copies_seen.append(copies)
        assert len(slots) == 1
    # The first three writers copy the shared partial block; the last one owns it alone.
    assert [len(c) for c in copies_seen] == [1, 1, 1, 0]
    assert all(src == copies_seen[0][0][0] for [(src, _dst)] in copies_seen[:3])
    assert len({t.block_ids[2] for t in [parent, *children]}) == 4
    assert pool.ref(parent.block_ids[0]) == 4
    assert_clean(pool)
    for table in [parent, *children]:
        table.release()
    assert pool.num_used == 0
    assert_clean(pool)


def test_full_shared_block_is_never_copied() -> None:
    pool = BlockPool(8, 4)
    parent = filled_table(pool, list(range(8)))
    child = parent.fork(SequenceOwner("parent", 1))
    _slots, copies = child.append_slots(1)
    assert copies == []
    assert child.block_ids[:2] == parent.block_ids
    assert_clean(pool)


def test_double_free_and_use_after_release_raise_without_corruption() -> None:
    pool = BlockPool(4, 4)
    table = filled_table(pool, [1, 2, 3])
    table.release()
    before = audit(pool)
    with pytest.raises(CacheError, match="use after release"):
        table.release()
    with pytest.raises(CacheError, match="use after release"):
        table.append_slots(1)
    with pytest.raises(CacheError, match="use after release"):
        table.fork(SequenceOwner("t", 1))
    with pytest.raises(CacheError, match="double free"):
        pool.dec_ref(0)
    with pytest.raises(CacheError, match="free block"):
        pool.inc_ref(0)
    with pytest.raises(CacheError, match="unknown block"):
        pool.inc_ref(99)
    after = audit(pool)
    assert after.ok and (after.free, after.cached, after.used) == (before.free, before.cached, before.used)


def test_exhaustion_raises_and_leaves_state_unchanged() -> None:
    pool = BlockPool(2, 4)
    a = BlockTable(pool, SequenceOwner("a", 0))
    a.append_slots(8)
    b = BlockTable(pool, SequenceOwner("b", 0))
    with pytest.raises(NoFreeBlocks):
        b.append_slots(1)
    assert b.block_ids == [] and b.num_tokens == 0
    with pytest.raises(NoFreeBlocks):
        a.append_slots(1)
    assert a.num_tokens == 8 and len(a.block_ids) == 2
    assert_clean(pool)


def test_eviction_order_lru_and_deepest_first() -> None:
    pool = BlockPool(6, 2)
    old = filled_table(pool, [1, 2, 3, 4, 5, 6], "old")  # 3 full blocks
    old_ids = list(old.block_ids)
    old.release()
    # Released deepest first: the tail is next to be evicted, the root last.
    assert pool.lru_ids() == list(reversed(old_ids))
    newer = filled_table(pool, [7, 8], "newer")
    newer.release()
    pool.find(pool.blocks[old_ids[0]].hash, (1, 2))  # touching the root makes it most recent
    assert pool.lru_ids()[-1] == old_ids[0]
    hog = BlockTable(pool, SequenceOwner("hog", 0))
    hog.append_slots(2 * 3)  # the 2 free blocks, then 1 eviction
    assert pool.evictions == 1
    assert pool.blocks[old_ids[2]].hash is None  # the deepest block went first
    assert longest_prefix(pool.find, [1, 2, 3, 4, 5, 6], 2, SALT)[0] == old_ids[:2]
    assert_clean(pool)


def test_evict_hook_sees_content_before_reuse() -> None:
    seen: list[tuple[int, tuple[int, ...]]] = []
    pool = BlockPool(2, 2, on_evict=lambda bid, h, toks: seen.append((bid, toks)))
    filled_table(pool, [1, 2, 3, 4]).release()
    hog = BlockTable(pool, SequenceOwner("t", 0))
    hog.append_slots(4)
    assert sorted(seen) == [(0, (1, 2)), (1, (3, 4))]
    assert_clean(pool)


def test_watermarks_gate_admission() -> None:
    pool = BlockPool(20, 4, low_watermark=0.15, high_watermark=0.3)
    assert pool.low_watermark_blocks == 3
    assert pool.can_admit(17) and not pool.can_admit(18)
    table = BlockTable(pool, SequenceOwner("t", 0))
    table.append_slots(4 * 17)
    assert not pool.can_admit(1)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    table.release()
    assert_clean(pool)


def test_grow_and_shrink_keep_block_ids() -> None:
    pool = BlockPool(4, 4, low_watermark=0.0, high_watermark=0.0)
    table = filled_table(pool, list(range(8)))
    ids_before = list(table.block_ids)
    new_ids = pool.grow(4)
    assert new_ids == [4, 5, 6, 7] and pool.num_blocks == 8
    assert table.block_ids == ids_before
    assert pool.shrink(10) == 6  # everything above the two in-use blocks (ids 0, 1)
    assert pool.num_blocks == 2 and table.block_ids == ids_before
    table.release()
    assert_clean(pool)


def test_shrink_respects_high_watermark_and_in_use_top() -> None:
    pool = BlockPool(10, 4, low_watermark=0.1, high_watermark=0.5)
    hold = BlockTable(pool, SequenceOwner("t", 0))
    hold.append_slots(4 * 4)  # blocks 0..3 in use
    removed = pool.shrink(10)
    assert pool.num_available >= pool.high_watermark * pool.num_blocks
    assert removed == 2 and pool.num_blocks == 8
    hold.release()
    pinned_top = BlockTable(pool, SequenceOwner("t", 0))
    pinned_top.append_slots(4 * 8)
    assert pool.shrink(1) == 0
    assert_clean(pool)


def test_commit_with_duplicate_content_keeps_one_indexed_block() -> None:
    pool = BlockPool(8, 4)
    a = BlockTable(pool, SequenceOwner("a", 0))
    b = BlockTable(pool, SequenceOwner("b", 0))
    tokens = [5, 6, 7, 8]
    a.append_slots(4)
    b.append_slots(4)
    a.commit(tokens, 4, SALT)
    b.commit(tokens, 4, SALT)  # computed concurrently: b's copy stays unindexed
    assert pool.blocks[a.block_ids[0]].hash is not None
    assert pool.blocks[b.block_ids[0]].hash is None
    b_block = b.block_ids[0]
    b.release()
    assert pool.is_free(b_block)
    assert a.hashes == b.hashes or b.hashes == []
    assert_clean(pool)


def test_audit_names_offending_blocks_and_tables() -> None:
    pool = BlockPool(4, 4, debug=True)
    table = filled_table(pool, [1, 2, 3, 4, 5], "leaky")
    assert all("test_cache_pool.py" in site for site in audit(pool).alloc_sites.values())
    pool.blocks[table.block_ids[0]].ref += 1  # corrupt on purpose: a reference nobody holds
    report = audit(pool)
    assert not report.ok
    assert any(f"block {table.block_ids[0]}: ref 2 but 1 table entries" in v for v in report.violations)
    assert any("sum of refs" in v for v in report.violations)
    with pytest.raises(CacheError, match="audit failed"):
        report.raise_if_bad()
    leak = report.leak_report()
    assert leak["allocated_blocks"] == 2 and leak["sum_refs"] == 3 and leak["sum_table_lens"] == 2


def test_cost_policy_keeps_popular_prefixes_over_recent_lone_tails() -> None:
    def scenario(policy: str) -> tuple[bool, list[int]]:
        pool = BlockPool(5, 2, eviction=policy)
        shared = [1, 2]
        filled_table(pool, shared, "popular").release()
        # Three conversations continue the shared block, each with its own full block.
        readers = [filled_table(pool, shared + [10 + r, 10 + r], "reader") for r in range(3)]
        tails = [t.block_ids[1] for t in readers]
        for table in readers:
            table.release()
        filled_table(pool, [7, 7], "lone").release()  # the most recent cached-free block, never continued
        evicted: list[int] = []
        pool.on_evict = lambda block_id, _hash, _tokens: evicted.append(block_id)
        hog = BlockTable(pool, SequenceOwner("hog", 0))
        hog.append_slots(2 * 4)  # four evictions
        survived = longest_prefix(pool.find, shared, 2, SALT)[0] != []
        hog.release()
        assert_clean(pool)
        assert evicted[:3] == tails  # both policies: the leaves go first, least recent first
        return survived, evicted

    assert scenario("cost")[0] is True  # the lone tail went instead of the block three chats share
    assert scenario("lru")[0] is False


def test_cost_policy_never_evicts_a_block_whose_continuation_is_cached() -> None:
    """A parent evicted before its child leaves the child unreachable: wasted space. LRU can do
    that after a hit touched the chain's head; the cost policy takes leaves first."""
    def victims(policy: str) -> tuple[list[int], list[int]]:
        pool = BlockPool(4, 2, eviction=policy)
        chain = filled_table(pool, [1, 2, 3, 4, 5, 6], "chain")
        blocks = list(chain.block_ids)
        chain.release()
        other = filled_table(pool, [9, 9], "other")
        blocks.append(other.block_ids[0])
        other.release()
        assert longest_prefix(pool.find, [1, 2, 3, 4], 2, SALT)[0] == blocks[:2]  # touches root, middle
        evicted: list[int] = []
        pool.on_evict = lambda block_id, _hash, _tokens: evicted.append(block_id)
        hog = BlockTable(pool, SequenceOwner("hog", 0))
        hog.append_slots(2 * 3)
        hog.release()
        assert_clean(pool)
        return blocks, evicted

    (root, middle, tail, other), evicted = victims("cost")
    assert evicted == [tail, other, middle]  # the root, with a cached child, stays
    (root, middle, tail, other), evicted = victims("lru")
    assert evicted == [tail, other, root]  # the middle block is now unreachable


def test_audit_recounts_the_children_the_cost_policy_relies_on() -> None:
    pool = BlockPool(4, 2, eviction="cost")
    table = filled_table(pool, [1, 2, 3, 4], "chain")
    assert pool.children_counts() == {table.hashes[0]: 1}
    assert_clean(pool)
    pool._children[table.hashes[1]] = 1  # a count with no child behind it
    assert any("hashed children" in v for v in audit(pool).violations)
    del pool._children[table.hashes[1]]
    table.release()
    assert_clean(pool)
