"""Offline replay of the sessions suite's trace at one cache size: which prompt tokens each policy
would have found cached. No model; the token ids are the ones the server would see.

A trace is a list of `Request`s in arrival order. Each request's prompt is its session's canonical
history (previous prompt, generated ids, end-of-turn tokens) plus the new user turn, so prompts are
prefix-stable as on the server. Its *computed* tokens are the prompt and all generated ids but
the last (whose KV the engine never computes); only their full blocks are cached.

A hit is the longest run of leading full prompt blocks that is cached, at most
(len(prompt) - 1) // block_size blocks (`longest_prefix`, as the scheduler looks up). Policies:
* `lru`, `cost`, `session`: the real `BlockPool` with that eviction policy. Each request, as
  chatcore's hit-rate suite does: find the prefix, build a table on it, reserve the rest of the
  request's slots, commit the computed tokens, claim the chain for its session (what the server
  does after each turn; only `session` uses claims), release. The pool's clock is the request
  index, so a session's rhythm is its place in the round robin.
* `belady`: the offline optimum over block hashes. A request computes (and caches) its computed
  full blocks; a block is *used* when a request's lookup reads it. When the cache is full, the
  cached block (not one of the current request's) whose next use lies furthest in the future is
  evicted, ties deepest first. The capacity counts hashed
  blocks only (the pool also holds a request's partial tail block: at most one block of slack).
* `one_slot`: a server with one KV cache per slot, serving requests one at a time: it keeps only
  the last request's computed tokens, and reuses their longest common prefix with the new prompt,
  token by token (at most len(prompt) - 1).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chatcore.bench.bookkeeping import Bookkeeping
from chatcore.cache import BlockPool, cache_salt
from chatcore.cache.pool import POLICIES
from chatcore.cache.prefix import chain_hashes

SALT = cache_salt("bench-sessions-replay", 0, "none")
POOL_POLICIES = tuple(p for p in ("lru", "cost", "session") if p in POLICIES)


@dataclass(frozen=True)
class Request:
    session: int
    turn: int
    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    end_of_turn: tuple[int, ...]

    @property
    def computed(self) -> int:
        return len(self.prompt) + len(self.generated) - 1

    @property
    def history(self) -> tuple[int, ...]:
        """The session's canonical history after this turn."""
        return self.prompt + self.generated + self.end_of_turn


def lookup_blocks(request: Request, block_size: int) -> int:
    return (len(request.prompt) - 1) // block_size


def pool_hits(trace: Sequence[Request], num_blocks: int, block_size: int, policy: str,
              depth_cost: float = 0.0) -> list[int]:
    """Hit tokens per request through a real `BlockPool` of `num_blocks` with `policy`."""
    now = [0.0]
    pool = BlockPool(num_blocks, block_size, low_watermark=0.0, high_watermark=0.0, eviction=policy,
                     clock=lambda: now[0], depth_cost=depth_cost)
    books = Bookkeeping(pool)
    hits = []
    for index, request in enumerate(trace):
        now[0] = float(index)
        req, found = books.open(str(index), list(request.prompt), SALT)  # looks up `lookup_blocks`
        hits.append(found * block_size)
        books.extend(req, list(request.history), request.computed)
        pool.claim(str(request.session), books.block_ids(req))
        books.close(req)
    return hits


def belady_hits(trace: Sequence[Request], capacity: int, block_size: int) -> list[int]:
    """Hit tokens per request under Belady's policy with room for `capacity` full blocks."""
    chains = [chain_hashes(r.history[: r.computed], block_size, SALT) for r in trace]
    if max((len(c) for c in chains), default=0) > capacity:
        raise ValueError("a request has more full blocks than the cache holds")
    uses: dict[bytes, list[int]] = {}  # the requests whose lookup reads each block
    for index, (request, chain) in enumerate(zip(trace, chains, strict=True)):
        for block in chain[: lookup_blocks(request, block_size)]:
            uses.setdefault(block, []).append(index)
    never = len(trace)
    cached: set[bytes] = set()
    next_use: dict[bytes, int] = {}
    heap: list[tuple[int, int, bytes]] = []  # (-next use, -depth, hash): furthest, then deepest, first
    hits = []
    for index, (request, chain) in enumerate(zip(trace, chains, strict=True)):
        found = 0
        for block in chain[: lookup_blocks(request, block_size)]:
            if block not in cached:
                break
            found += 1
        hits.append(found * block_size)
        current = set(chain)
        for depth, block in enumerate(chain):
            if block not in cached:
                if len(cached) >= capacity:
                    _evict_furthest(heap, cached, next_use, current)
                cached.add(block)
            at = uses.get(block, [])
            position = bisect.bisect_right(at, index)
            next_use[block] = at[position] if position < len(at) else never
            heapq.heappush(heap, (-next_use[block], -depth, block))
    return hits


def _evict_furthest(heap: list[tuple[int, int, bytes]], cached: set[bytes], next_use: dict[bytes, int],
                    current: set[bytes]) -> None:
    """Drop the cached block outside `current` used furthest in the future (stale heap entries skipped)."""
    kept = []
    while heap:
        entry = heapq.heappop(heap)
        block = entry[2]
        if block not in cached or next_use[block] != -entry[0]:
            continue
        if block in current:
            kept.append(entry)
            continue
        cached.discard(block)
        break
    else:
        raise ValueError("nothing evictable: the current request fills the cache")
    for entry in kept:
        heapq.heappush(heap, entry)


def one_slot_hits(trace: Sequence[Request]) -> list[int]:
    """Hit tokens per request when only the previous request's computed tokens are kept."""
    previous: tuple[int, ...] = ()
    hits = []
    for request in trace:
        limit = min(len(request.prompt) - 1, len(previous))
        common = 0
        while common < limit and request.prompt[common] == previous[common]:
            common += 1
        hits.append(common)
        previous = request.history[: request.computed]
    return hits


def replay(trace: Sequence[Request], num_blocks: int, block_size: int, depth_cost: float = 0.0) -> dict[str, Any]:
    """Every policy at `num_blocks`: the token hit rate over the trace and over each turn, and its
    share of Belady's."""
    hits = {policy: pool_hits(trace, num_blocks, block_size, policy, depth_cost) for policy in POOL_POLICIES}
    hits["belady"] = belady_hits(trace, num_blocks, block_size)
    hits["one_slot"] = one_slot_hits(trace)
    prompt_tokens = [len(r.prompt) for r in trace]
    turns = sorted({r.turn for r in trace})
    policies: dict[str, Any] = {}
    for policy, per_request in hits.items():
        by_turn = []
        for turn in turns:
            picked = [i for i, r in enumerate(trace) if r.turn == turn]
            by_turn.append(sum(per_request[i] for i in picked) / sum(prompt_tokens[i] for i in picked))
        policies[policy] = {"hit_tokens": sum(per_request), "hit_rate": sum(per_request) / sum(prompt_tokens),
                            "hit_rate_by_turn": by_turn}
    best = policies["belady"]["hit_rate"]
    for result in policies.values():
        result["of_belady"] = result["hit_rate"] / best if best else float("nan")
    return {"cache_blocks": num_blocks, "prompt_tokens": sum(prompt_tokens), "policies": policies}
