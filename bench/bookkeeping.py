"""Turns' tables over a benchmark's own bare `BlockPool`, through the KV cache manager.

The offline replays (hitrate, memory, the sessions replay) measure the block bookkeeping alone: no
model, no KV tensors. They still hold their tables the engine's way, through a `KVCacheManager`
(without KV tensors), which owns them: a turn looks up its prompt's longest cached prefix as admission
does (`open`), reserves the slots of its history and hashes its computed full blocks (`extend`), and
gives its table back (`close`).
"""

from __future__ import annotations

from chatcore.cache import BlockPool, NoFreeBlocks
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.request import Request, SamplingParams

PARAMS = SamplingParams()


class Bookkeeping:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.kv_cache = KVCacheManager(pool, None, hot_window_s=0.0)
        self._slots: dict[str, int] = {}  # token slots each open request holds

    def open(self, request_id: str, prompt: list[int], salt: bytes) -> tuple[Request, int]:
        """A request over `prompt` holding the pool's longest cached prefix of it (at most
        (len(prompt) - 1) // block_size blocks, as admission looks up); returns it and the blocks found."""
        req = Request(request_id, list(prompt), PARAMS, salt=salt)
        found = self.kv_cache.get_computed_blocks(req, req.seqs)
        self.kv_cache.admit(req)
        self._slots[request_id] = found * self.pool.block_size
        return req, found

    def extend(self, req: Request, tokens: list[int], computed: int) -> None:
        """The request's history becomes `tokens` (it only grows): their slots reserved, and the full
        blocks of the first `computed` hashed. Raises `NoFreeBlocks`, with nothing changed, when the
        pool cannot serve the slots."""
        seq = req.seqs[0]
        held = self._slots[req.request_id]
        if self.kv_cache.allocate_slots(req, seq, len(tokens) - held) is None:
            raise NoFreeBlocks(f"{req.request_id} needs slots for {len(tokens) - held} tokens; "
                               f"{self.pool.num_available} blocks available")
        self._slots[req.request_id] = len(tokens)
        seq.tokens = list(tokens)
        seq.num_computed = computed
        self.kv_cache.cache_blocks(req, seq)

    def block_ids(self, req: Request) -> tuple[int, ...]:
        return self.kv_cache.block_ids(req, req.seqs[0])

    def hashed_block_ids(self, req: Request) -> tuple[int, ...]:
        """The request's blocks whose content is hashed (findable by a later lookup)."""
        return self.kv_cache.hashed_block_ids(req, req.seqs[0])

    def close(self, req: Request) -> None:
        """Give the request's table back (its hashed blocks stay findable as cached-free)."""
        self.kv_cache.free(req)
        del self._slots[req.request_id]
