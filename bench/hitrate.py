"""Suite 3, hit rate: the trace replayed through the real block pool bookkeeping (no model).

Each turn, in arrival order: look up the prompt's longest cached prefix (`longest_prefix`
over `BlockPool.find`, at most (len-1)//block_size blocks, as the scheduler does), build a
table on it (held by the KV cache manager, as the engine's are: bench/bookkeeping.py), reserve slots for the rest of the prompt and the answer, commit the computed
tokens (the prompt and all of the answer but its last sampled token and the template's
newline, whose KV the engine never computes), then release the table. Sessions are not
pinned between turns (a warm session: its blocks are cached-free and compete in the LRU).

Token hit rate = hit tokens / prompt tokens. The oracle is an infinite cache's hit rate. The
working set is the most blocks the infinite cache ever holds (used + cached-free); the pool
is replayed at fractions of it.

Policies (each a pool class; only the choice of victim differs):
* lru: `BlockPool(eviction="lru")` (LRU of cached-free blocks; deepest first among blocks a
  table releases together, so chains are trimmed from their tails).
* pool_cost: `BlockPool(eviction="cost")`, the pool's own cost-aware policy: among the 16 least
  recently used cached-free blocks, a leaf (no cached child), then the one fewest conversations
  branched from, then the least recent. (chatcore's default is `session`, which bench/replay.py
  measures.)
* cost_aware: `CostAwarePool` (bench's proposal), GreedyDual over leaf blocks with cost = recompute tokens x the
  number of distinct sessions that used the block. With equal costs it is LRU over leaves.
* gd_flops: the same GreedyDual with cost = FLOPs to recompute the block at its depth. Shown
  because it is the obvious "cost" and it loses: it keeps the deep tails of long, finished
  sessions at the expense of recent ones (docs/benchmarks.md).
Also the FLOP-weighted hit rate (recompute FLOPs saved / FLOPs of all prompt blocks).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from chatcore.bench.common import Context, reported
from chatcore.bench.workload import Trace, TraceConfig, generate
from chatcore.bench.bookkeeping import Bookkeeping
from chatcore.cache import BlockPool, NoFreeBlocks, cache_salt


def block_cost(depth: int, block_size: int, attention_ratio: float) -> float:
    """Relative cost of recomputing block `depth` (positions depth*bs .. depth*bs + bs - 1).

    Recomputing a token at position p costs linear FLOPs (2 x parameters) plus attention FLOPs
    growing with p; `attention_ratio` is the attention FLOPs per position over the linear FLOPs
    per token, from the loaded model (`chatcore.engine.pool_sizing.depth_cost(loaded, 1)`)."""
    mid = depth * block_size + block_size / 2
    return block_size * (1 + attention_ratio * mid)


class CostAwarePool(BlockPool):
    """A `BlockPool` whose victim, when no free block is left, is the cheapest leaf to lose.

    GreedyDual over leaf blocks (blocks with no cached child): when a block is used, its
    priority becomes L + cost, and the victim is the leaf with the lowest priority (ties:
    least recently used, then deepest); L rises to each victim's priority (aging), so with
    equal costs this is exactly LRU restricted to leaves. The cost of losing a block is the
    recompute it would cause: its tokens times the number of distinct sessions that have used
    it (a shared system prompt is worth as much as all the sessions that start with it).

    The replay reports each committed chain with its session (`note_chain`), which gives every
    hashed block its parent, depth and users. Everything else is the pool's own code.
    """

    def __init__(self, num_blocks: int, block_size: int, **kwargs: Any) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        self.parent: dict[int, int | None] = {}
        self.depth: dict[int, int] = {}
        self.children: dict[int, int] = {}
        self.users: dict[int, set[object]] = {}
        self.priority: dict[int, float] = {}
        self.stamp: dict[int, int] = {}  # when each block was last used: ties go least recent first
        self.aging = 0.0
        self._heap: list[tuple[float, int, int, int]] = []
        self._tick = 0
        self.fallbacks = 0

    def cost(self, block_id: int) -> float:
        return float(len(self.users[block_id]))

    def note_chain(self, hashed: Sequence[int], owner: object) -> None:
        """The committed (`hashed`) blocks of a chain were just used by `owner` (a session)."""
        parent: int | None = None
        for depth, block_id in enumerate(hashed):
            if self.blocks[block_id].hash is None:  # a duplicate of content cached elsewhere
                parent = block_id
                continue
            if block_id not in self.depth:
                self.parent[block_id] = parent
                self.depth[block_id] = depth
                self.children.setdefault(block_id, 0)
                self.users[block_id] = set()
                if parent is not None and parent in self.children:
                    self.children[parent] += 1
            self.users[block_id].add(owner)
            self._tick += 1
            self.stamp[block_id] = self._tick
            self.priority[block_id] = self.aging + self.cost(block_id)
            parent = block_id

    def _push(self, block_id: int) -> None:
        if block_id in self.priority and self.children.get(block_id, 0) == 0 and block_id in self._lru:
            heapq.heappush(self._heap, (self.priority[block_id], self.stamp[block_id], -self.depth[block_id], block_id))

    def dec_ref(self, block_id: int) -> None:
        super().dec_ref(block_id)
        if self.blocks[block_id].ref == 0:
            self._push(block_id)

    def _take_free(self, after: int | None) -> int:
        if (after is not None and after + 1 in self._free) or self._free or not self._lru:
            return super()._take_free(after)
        while self._heap:
            prio, stamp, _, block_id = heapq.heappop(self._heap)
            if (block_id in self._lru and self.children.get(block_id, 0) == 0
                    and self.priority.get(block_id) == prio and self.stamp.get(block_id) == stamp):
                del self._lru[block_id]
                self.aging = prio
                self._evict(block_id)
                return block_id
        self.fallbacks += 1  # no indexed leaf: plain LRU order
        return super()._take_free(after)

    def _evict(self, block_id: int) -> None:
        super()._evict(block_id)
        parent = self.parent.pop(block_id, None)
        for table in (self.depth, self.children, self.users, self.priority, self.stamp):
            table.pop(block_id, None)
        if parent is not None and parent in self.children:
            self.children[parent] -= 1
            if self.children[parent] == 0:
                self._push(parent)


class FlopCostPool(CostAwarePool):
    """The same GreedyDual, with cost = FLOPs to recompute the block at its depth (attention grows
    with the position). Reported for comparison: on the trace it loses to LRU (see docs)."""

    def __init__(self, num_blocks: int, block_size: int, attention_ratio: float, **kwargs: Any) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        self.attention_ratio = attention_ratio

    def cost(self, block_id: int) -> float:
        return block_cost(self.depth[block_id], self.block_size, self.attention_ratio) / self.block_size


# lru and pool_cost are the pool's own policies (`eviction=`; chatcore's engine passes the same
# depth cost as pool_cost here); cost_aware and gd_flops are the GreedyDual variants above.
POLICIES = ("lru", "pool_cost", "cost_aware", "gd_flops")


def make_pool(policy: str, num_blocks: int, block_size: int, attention_ratio: float) -> BlockPool:
    kwargs: dict[str, Any] = {"low_watermark": 0.0, "high_watermark": 0.0}
    if policy == "lru":
        return BlockPool(num_blocks, block_size, eviction="lru", **kwargs)
    if policy == "pool_cost":
        return BlockPool(num_blocks, block_size, eviction="cost", depth_cost=attention_ratio * block_size, **kwargs)
    if policy == "gd_flops":
        return FlopCostPool(num_blocks, block_size, attention_ratio, **kwargs)
    if policy == "cost_aware":
        return CostAwarePool(num_blocks, block_size, **kwargs)
    raise ValueError(f"unknown policy {policy!r}")


def replay(trace: Trace, num_blocks: int, block_size: int, policy: str = "lru", *,
           attention_ratio: float) -> dict[str, Any]:
    """Replay every turn; returns hit and query tokens, FLOP-weighted savings and the peak footprint."""
    pool = make_pool(policy, num_blocks, block_size, attention_ratio)
    books = Bookkeeping(pool)
    salt = cache_salt("bench-trace", block_size, "bfloat16")
    hits = queries = 0
    saved_cost = total_cost = 0.0
    peak = 0
    for index, event in enumerate(trace.events()):
        prompt = trace.prompt(event.session, event.turn)
        answer = trace.sessions[event.session].turns[event.turn].answer
        req, found = books.open(str(index), prompt, salt)  # at most (len(prompt) - 1) // block_size blocks
        hits += found * block_size
        queries += len(prompt)
        blocks = len(prompt) // block_size
        saved_cost += sum(block_cost(d, block_size, attention_ratio) for d in range(found))
        total_cost += sum(block_cost(d, block_size, attention_ratio) for d in range(blocks))
        tokens = prompt + list(answer)
        try:
            books.extend(req, tokens, len(tokens) - 2)
        except NoFreeBlocks:
            books.close(req)
            raise
        if isinstance(pool, CostAwarePool):
            pool.note_chain(books.hashed_block_ids(req), event.session)
        peak = max(peak, pool.num_blocks - pool.num_free)
        books.close(req)
    return {"hit_tokens": hits, "query_tokens": queries, "hit_rate": hits / queries,
            "cost_weighted_hit_rate": saved_cost / total_cost if total_cost else 0.0,
            "peak_blocks": peak, "evictions": pool.evictions,
            "fallbacks": getattr(pool, "fallbacks", 0)}


def unbounded(trace: Trace, block_size: int) -> int:
    """A pool size that never evicts on this trace: every turn's blocks, all kept."""
    return sum(-(-(len(trace.prompt(e.session, e.turn)) + len(trace.sessions[e.session].turns[e.turn].answer))
                 // block_size) for e in trace.events()) + 1


def trace_config(ctx: Context) -> TraceConfig:
    if ctx.tiny:
        return TraceConfig(num_sessions=30)
    if ctx.quick:
        return TraceConfig(num_sessions=80)
    return TraceConfig(num_sessions=200)


def run(ctx: Context) -> dict[str, Any]:
    from chatcore.engine.pool_sizing import depth_cost

    trace = generate(trace_config(ctx))
    bs = ctx.settings.block_size
    ratio = depth_cost(ctx.loaded, 1)  # attention FLOPs per position / linear FLOPs per token
    oracle = replay(trace, unbounded(trace, bs), bs, attention_ratio=ratio)
    working_set = oracle["peak_blocks"]
    largest = max(len(trace.prompt(e.session, e.turn)) + len(trace.sessions[e.session].turns[e.turn].answer)
                  for e in trace.events())
    floor = -(-largest // bs) + 1
    fractions = [1.0, 0.5, 0.25, 0.125, 0.0625]
    rows = []
    for fraction in fractions:
        blocks = max(floor, round(fraction * working_set))
        row: dict[str, Any] = {"cache_fraction": fraction, "blocks": blocks}
        for policy in POLICIES:
            r = replay(trace, blocks, bs, policy, attention_ratio=ratio)
            r["of_oracle"] = r["hit_rate"] / oracle["hit_rate"]
            r["cost_of_oracle"] = r["cost_weighted_hit_rate"] / oracle["cost_weighted_hit_rate"]
            row[policy] = r
        rows.append(row)
        ctx.log(f"  cache {fraction:.1%} ({blocks} blocks), % of oracle: " +
                ", ".join(f"{p} {row[p]['of_oracle']:.2%}" for p in POLICIES))
    by = {r["cache_fraction"]: r for r in rows}
    # The block-size sweep on the same trace (DESIGN: choose the block size by replaying traffic).
    sweep = []
    for size in (8, 16, 32, 64):
        o = replay(trace, unbounded(trace, size), size, attention_ratio=ratio)
        r = replay(trace, max(-(-largest // size) + 1, round(0.25 * o["peak_blocks"])), size, attention_ratio=ratio)
        sweep.append({"block_size": size, "oracle_hit_rate": o["hit_rate"], "lru_25pct_hit_rate": r["hit_rate"],
                      "working_set_tokens": o["peak_blocks"] * size})
    return {
        "trace": trace.summary(), "block_size": bs, "working_set_blocks": working_set, "attention_ratio": ratio,
        "oracle_hit_rate": oracle["hit_rate"], "oracle_cost_weighted_hit_rate": oracle["cost_weighted_hit_rate"],
        "rows": rows, "block_size_sweep": sweep,
        "targets": [
            reported("cost-aware / LRU hit rate at 25% cache (the pool's `cost` policy)",
                     by[0.25]["pool_cost"]["hit_rate"] / by[0.25]["lru"]["hit_rate"],
                   f"pool cost {by[0.25]['pool_cost']['of_oracle']:.2%} vs LRU {by[0.25]['lru']['of_oracle']:.2%} "
                   f"of oracle; bench's GreedyDual (cost = tokens x sharers) "
                   f"{by[0.25]['cost_aware']['of_oracle']:.2%}"),
        ],
    }


