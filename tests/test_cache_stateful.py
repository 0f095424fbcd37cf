"""Random interleavings of allocate, append, fork, write, release, lookup, evict, grow and shrink.

A shadow "KV memory" (slot -> token) is written as tables append, and copied when a table
reports a copy-on-write pair. After every step the audit must pass, and every table must
read back exactly its own tokens through its block ids: sharing and copy-on-write never let
one sequence see another's writes.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from chatcore.cache import (
    BlockPool,
    BlockTable,
    CacheError,
    NoFreeBlocks,
    SequenceOwner,
    audit,
    cache_salt,
    longest_prefix,
)

BLOCK_SIZE = 4
SALT = cache_salt("stateful", BLOCK_SIZE, "float32")
STEPS = {"count": 0, "copies": 0, "exhausted": 0, "evictions": 0}
MIN_STEPS = 2000
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=9)  # a tiny alphabet makes prefixes collide


class CacheMachine(RuleBasedStateMachine):
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(24, BLOCK_SIZE, low_watermark=0.1, high_watermark=0.2, debug=True,
                              eviction=self.eviction)
        self.memory: dict[int, int] = {}
        self.tables: list[tuple[BlockTable, list[int]]] = []
        self.released: list[BlockTable] = []

    def _write(self, table: BlockTable, tokens: list[int], new: list[int]) -> None:
        try:
            slots, copies = table.append_slots(len(new))
        except NoFreeBlocks:
            STEPS["exhausted"] += 1
            raise
        STEPS["copies"] += len(copies)
        for src, dst in copies:
            for off in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + off in self.memory:
                    self.memory[dst * BLOCK_SIZE + off] = self.memory[src * BLOCK_SIZE + off]
        for slot, tok in zip(slots, new, strict=True):
            self.memory[slot] = tok
        tokens.extend(new)
        table.commit(tokens, len(tokens), SALT)

    @rule(prompt=tokens_st)
    def new_sequence(self, prompt: list[int]) -> None:
        ids, hashes = longest_prefix(self.pool.find, prompt, BLOCK_SIZE, SALT)
        table = BlockTable.from_prefix(self.pool, ids, hashes, owner=SequenceOwner(f"t{len(self.tables)}", 0))
        tokens = list(prompt[: table.num_tokens])
        try:
            self._write(table, tokens, list(prompt[table.num_tokens:]))
        except NoFreeBlocks:
            table.release()
            return
        self.tables.append((table, tokens))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new=tokens_st)
    def append(self, data: st.DataObject, new: list[int]) -> None:
        table, tokens = data.draw(st.sampled_from(self.tables))
        before = (list(table.block_ids), table.num_tokens)
        try:
            self._write(table, tokens, new)
        except NoFreeBlocks:
            assert (table.block_ids, table.num_tokens) == before

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        table, tokens = data.draw(st.sampled_from(self.tables))
        self.tables.append((table.fork(owner=SequenceOwner(f"t{len(self.tables)}", 0)), list(tokens)))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new=tokens_st, write_child=st.booleans())
    def fork_and_write(self, data: st.DataObject, new: list[int], write_child: bool) -> None:
        """n > 1 sampling: fork, then one side writes into the shared partial block."""
        table, tokens = data.draw(st.sampled_from(self.tables))
        child = (table.fork(owner=SequenceOwner(f"t{len(self.tables)}", 0)), list(tokens))
        self.tables.append(child)
        target = child if write_child else (table, tokens)
        try:
            self._write(target[0], target[1], new)
        except NoFreeBlocks:
            pass

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.tables) - 1))
        table, _ = self.tables.pop(index)
        table.release()
        self.released.append(table)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def misuse_released(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.released))
        op = data.draw(st.sampled_from(["release", "append", "fork", "commit"]))
        with pytest.raises(CacheError, match="use after release"):
            if op == "release":
                table.release()
            elif op == "append":
                table.append_slots(1)
            elif op == "fork":
                table.fork(SequenceOwner("released", 0))
            else:
                table.commit([0] * BLOCK_SIZE, BLOCK_SIZE, SALT)

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        idle = [b.id for b in self.pool.blocks if b.ref == 0]
        if idle:
            with pytest.raises(CacheError):
                self.pool.dec_ref(data.draw(st.sampled_from(idle)))

    @rule(prompt=tokens_st)
    def lookup(self, prompt: list[int]) -> None:
        ids, _ = longest_prefix(self.pool.find, prompt, BLOCK_SIZE, SALT)
        for i, block_id in enumerate(ids):
            expected = prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            assert [self.memory[block_id * BLOCK_SIZE + off] for off in range(BLOCK_SIZE)] == expected

    @rule(count=st.integers(1, 4))
    def evict(self, count: int) -> None:
        self.pool.evict_cached(count)

    @rule(count=st.integers(1, 4))
    def grow(self, count: int) -> None:
        self.pool.grow(count)

    @rule(count=st.integers(1, 6))
    def shrink(self, count: int) -> None:
        total = self.pool.num_blocks
        removed = self.pool.shrink(count)
        assert self.pool.num_blocks == total - removed
        for slot in [s for s in self.memory if s // BLOCK_SIZE >= self.pool.num_blocks]:
            del self.memory[slot]

    @invariant()
    def consistent(self) -> None:
        STEPS["count"] += 1
        report = audit(self.pool)
        assert report.ok, report.format()
        for table, tokens in self.tables:
            assert table.num_tokens == len(tokens)
            assert [self.memory[table.slot(p)] for p in range(len(tokens))] == tokens

    def teardown(self) -> None:
        STEPS["evictions"] += self.pool.evictions
        for table, _ in self.tables:
            table.release()
        report = audit(self.pool)
        assert report.ok and report.used == 0, report.format()


class CostCacheMachine(CacheMachine):
    eviction = "cost"


class SessionCacheMachine(CacheMachine):
    """Conversations claim their tables' chains (and are deleted) between the other operations."""

    eviction = "session"

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), group=st.sampled_from(["a", "b", "c"]))
    def claim(self, data: st.DataObject, group: str) -> None:
        table, _ = data.draw(st.sampled_from(self.tables))
        self.pool.claim(group, table.block_ids)

    @rule(group=st.sampled_from(["a", "b", "c"]))
    def drop(self, group: str) -> None:
        self.pool.drop_group(group)


@pytest.mark.parametrize("machine", [CacheMachine, CostCacheMachine, SessionCacheMachine],
                         ids=["lru", "cost", "session"])
def test_random_interleavings_keep_every_invariant(machine: type[CacheMachine]) -> None:
    STEPS.update(count=0, copies=0, exhausted=0, evictions=0)
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=100, stateful_step_count=50, deadline=None, derandomize=True),
    )
    assert STEPS["count"] >= MIN_STEPS, STEPS
    # The run must have exercised the interesting paths, or it proves little.
    assert STEPS["copies"] > 0 and STEPS["exhausted"] > 0 and STEPS["evictions"] > 0, STEPS
    print(f"stateful cache test: {STEPS}")
