"""The consistency check of the block pool against every live block table, and the leak report.

It runs in O(blocks + table entries), cheap enough to follow every engine step in debug mode.
Checked:
* each block is exactly one of free, cached-free (ref 0, hashed, indexed) and in use (ref > 0);
* each block's ref equals the number of table entries that map it;
* the prefix index and the blocks' hashes agree, and free blocks carry no hash;
* the pool's per-hash count of hashed children (the cost policy's leaf test) is exact;
* each table maps ceil(num_tokens / block_size) distinct blocks, and hashes only full ones;
* free + cached + used == total, and the sum of refs == the sum of table lengths.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from chatcore.cache.errors import CacheError
from chatcore.cache.owners import TableOwner
from chatcore.cache.pool import BlockPool


@dataclass(slots=True)
class TableView:
    owner: TableOwner
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class AuditReport:
    total: int
    free: int
    cached: int
    used: int
    sum_refs: int
    sum_table_lens: int
    tables: list[TableView]
    refs: dict[int, int]
    alloc_sites: dict[int, str]
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def raise_if_bad(self) -> None:
        if self.violations:
            raise CacheError("cache audit failed:\n  " + "\n  ".join(self.violations))

    def leak_report(self) -> dict[str, object]:
        return {
            "allocated_blocks": self.used,
            "sum_refs": self.sum_refs,
            "sum_table_lens": self.sum_table_lens,
            "live_tables": len(self.tables),
            "alloc_sites": dict(Counter(self.alloc_sites.values())),
        }

    def format(self) -> str:
        lines = [
            f"blocks: total={self.total} free={self.free} cached={self.cached} used={self.used}",
            f"sum of refs={self.sum_refs}  sum of table lengths={self.sum_table_lens}",
        ]
        for table in sorted(self.tables, key=lambda t: str(t.owner)):
            cells = " ".join(f"{b}(ref {self.refs.get(b, 0)})" for b in table.block_ids)
            lines.append(f"table of {table.owner}: tokens={table.num_tokens} blocks=[{cells}]")
        lines.append("audit: " + ("ok" if self.ok else f"{len(self.violations)} violation(s)"))
        lines.extend(f"  ! {v}" for v in self.violations)
        return "\n".join(lines)


def audit(pool: BlockPool) -> AuditReport:
    tables = pool.tables
    violations: list[str] = []
    mapped = _check_tables(pool, violations)
    free_ids, lru_ids = set(pool.free_ids()), set(pool.lru_ids())
    _check_blocks(pool, mapped, free_ids, lru_ids, violations)
    _check_index(pool, mapped, violations)
    used = sum(1 for b in pool.blocks if b.ref > 0)
    sum_refs = sum(b.ref for b in pool.blocks)
    sum_lens = sum(len(t.block_ids) for t in tables)
    if len(free_ids) + len(lru_ids) + used != len(pool.blocks):
        violations.append(f"free {len(free_ids)} + cached {len(lru_ids)} + used {used} != total {len(pool.blocks)}")
    if sum_refs != sum_lens:
        violations.append(f"sum of refs {sum_refs} != sum of table lengths {sum_lens}")
    return AuditReport(
        total=len(pool.blocks),
        free=len(free_ids),
        cached=len(lru_ids),
        used=used,
        sum_refs=sum_refs,
        sum_table_lens=sum_lens,
        tables=[TableView(t.owner, list(t.block_ids), t.num_tokens) for t in tables],
        refs={b.id: b.ref for b in pool.blocks if b.ref > 0},
        alloc_sites={b.id: b.alloc_site for b in pool.blocks if b.alloc_site is not None},
        violations=violations,
    )


def _check_tables(pool: BlockPool, violations: list[str]) -> Counter[int]:
    """Each live table's shape; returns how many table entries map each block."""
    bs = pool.block_size
    mapped: Counter[int] = Counter()
    for table in pool.tables:
        name = f"the table of {table.owner}"
        mapped.update(table.block_ids)
        if table.released:
            violations.append(f"{name}: released but still attached")
        if len(table.block_ids) != -(-table.num_tokens // bs):
            violations.append(f"{name}: {len(table.block_ids)} blocks for {table.num_tokens} tokens")
        if len(set(table.block_ids)) != len(table.block_ids):
            violations.append(f"{name}: maps one block twice")
        if len(table.hashes) > table.num_tokens // bs:
            violations.append(f"{name}: {len(table.hashes)} hashes but only {table.num_tokens // bs} full blocks")
    return mapped


def _check_blocks(pool: BlockPool, mapped: Counter[int], free_ids: set[int], lru_ids: set[int],
                  violations: list[str]) -> None:
    """Each block's state, reference count and hash."""
    bs = pool.block_size
    index = dict(pool.index.items())
    for block in pool.blocks:
        bid = block.id
        states = [name for name, on in (("free", bid in free_ids), ("cached", bid in lru_ids),
                                        ("used", block.ref > 0)) if on]
        if len(states) != 1:
            violations.append(f"block {bid}: in states {states or ['none']} (ref {block.ref})")
        if block.ref < 0:
            violations.append(f"block {bid}: negative ref {block.ref}")
        if block.ref != mapped.get(bid, 0):
            violations.append(f"block {bid}: ref {block.ref} but {mapped.get(bid, 0)} table entries")
        if bid in free_ids and block.hash is not None:
            violations.append(f"block {bid}: free but still hashed")
        if bid in lru_ids and (block.hash is None or index.get(block.hash) != bid):
            violations.append(f"block {bid}: cached-free but not findable by its hash")
        if block.hash is not None and (block.token_ids is None or len(block.token_ids) != bs):
            violations.append(f"block {bid}: hashed without a full block of token ids")


def _check_index(pool: BlockPool, mapped: Counter[int], violations: list[str]) -> None:
    """The prefix index, the children counts and the forecast's claims agree with the blocks."""
    for block_hash, bid in pool.index.items():
        if not 0 <= bid < len(pool.blocks) or pool.blocks[bid].hash != block_hash:
            violations.append(f"index entry {block_hash.hex()[:12]} points at block {bid} with another hash")
    children = Counter(b.parent_hash for b in pool.blocks if b.hash is not None and b.parent_hash is not None)
    if dict(children) != pool.children_counts():
        violations.append("the pool's counts of hashed children disagree with the blocks' parent hashes")
    for bid, group in pool.forecast.owned().items():
        if not 0 <= bid < len(pool.blocks) or pool.blocks[bid].hash is None:
            violations.append(f"conversation {group} claims block {bid}, which holds no hashed content")
    for bid in mapped:
        if not 0 <= bid < len(pool.blocks):
            violations.append(f"a table maps unknown block {bid}")
