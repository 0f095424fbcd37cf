"""The pool's blocks, for callers outside the engine: what they may do, on the engine thread only.

Sessions pin a finished turn's table, find how much of a history the pool still holds,
install blocks read back from the disk tier and hand blocks to the disk tier; operators read
the block map. Each method here is one such operation. None is thread-safe: call them from a
function run by `InferenceEngine.on_thread` (the engine thread, between two steps), where the
block pool, the tables and the KV tensors are never touched by a step at the same time.
"""

from __future__ import annotations

from typing import Any

import torch

from chatcore.cache import BlockTable, audit, longest_prefix
from chatcore.engine.core import EngineCore
from chatcore.engine.request import Request


class BlockOps:
    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @property
    def num_blocks(self) -> int:
        """The pool's size now (`EngineCore.resize` may change it)."""
        return self._core.pool.num_blocks

    def room(self) -> int:
        """Blocks an install may take now: those available above the low watermark."""
        pool = self._core.pool
        return pool.num_available - pool.low_watermark_blocks

    def expected_waits(self, groups: list[str]) -> dict[str, float]:
        """Of `groups`, those the pool's eviction forecast knows, with the time it expects until
        each is used again (`ReuseForecast.wait`)."""
        forecast = self._core.pool.forecast
        now = self._core.pool.clock()
        return {g: forecast.wait(g, now) for g in groups if g in forecast}

    def cached_prefix(self, tokens: list[int], salt: bytes, max_blocks: int) -> int:
        """How many of the first `max_blocks` full blocks of `tokens` the pool holds, from the start."""
        pool = self._core.pool
        return len(longest_prefix(pool.find, tokens, pool.block_size, salt, max_blocks)[0])

    def install(self, tokens: list[int], salt: bytes, max_blocks: int, device_blocks: int,
                tensors: list[torch.Tensor], owner: str) -> tuple[BlockTable, int]:
        """A table over the pool's longest prefix of `tokens`, extended by the blocks read from disk
        (which start at block `device_blocks`); returns it and the tokens written from disk. Stops
        short, rather than evict, when the pool is below its low watermark."""
        core = self._core
        bs = core.pool.block_size
        ids, found = longest_prefix(core.pool.find, tokens, bs, salt, max_blocks)
        skip = len(ids) - device_blocks
        usable = tensors[skip:] if skip >= 0 else []
        table = BlockTable.from_prefix(core.pool, ids, found, owner=owner)
        if not usable or not core.pool.can_admit(len(usable)):
            return table, 0
        try:
            table.append_slots(len(usable) * bs)
            for j, tensor in enumerate(usable):
                core.kv.write_block(table.block_ids[len(ids) + j], tensor)
            table.commit(tokens, (len(ids) + len(usable)) * bs, salt)
        except BaseException:
            table.release()  # a block file of the wrong shape, say: nothing may stay referenced
            raise
        return table, len(usable) * bs

    def claim(self, group: str, block_ids: list[int], *, use: bool = True) -> None:
        """`group` (a session) owns these blocks in the pool's eviction forecast (`BlockPool.claim`)."""
        self._core.pool.claim(group, block_ids, use=use)

    def drop_group(self, group: str) -> None:
        self._core.pool.drop_group(group)

    def read(self, hashes: list[bytes]) -> list[tuple[bytes, torch.Tensor]]:
        """The KV of the blocks the pool still holds under these hashes (for the disk tier)."""
        pool = self._core.pool
        out = []
        for block_hash in hashes:
            block_id = pool.index.get(block_hash)
            if block_id is not None and pool.blocks[block_id].hash == block_hash:
                out.append((block_hash, self._core.kv.read_block(block_id)))
        return out

    def discard(self, req: Request) -> None:
        """Release what a request built but never added holds (`EngineCore.discard`)."""
        self._core.discard(req)

    def block_map(self, session_of_request: dict[str, str]) -> dict[str, Any]:
        """The audit plus which sessions map which blocks: a pinned table names its session, a
        request's table the session `session_of_request` gives its request id."""
        pool = self._core.pool
        report = audit(pool)
        owners: dict[int, set[str]] = {}
        per_session: dict[str, dict[int, None]] = {}
        for table in pool.tables:
            owner = table.owner
            if owner.startswith("session:"):
                session = owner.removeprefix("session:")
            else:
                session = session_of_request.get(owner.split("/")[0], "")
            if session:
                for block_id in table.block_ids:
                    owners.setdefault(block_id, set()).add(session)
                per_session.setdefault(session, {}).update(dict.fromkeys(table.block_ids))
        blocks = []
        for block in pool.blocks:
            state = "used" if block.ref > 0 else "cached" if pool.is_cached(block.id) else "free"
            if state != "free":
                blocks.append({"id": block.id, "state": state, "ref": block.ref,
                               "sessions": sorted(owners.get(block.id, ()))})
        return {
            "block_size": pool.block_size,
            "audit": {"ok": report.ok, "violations": report.violations, "total": report.total,
                      "free": report.free, "cached": report.cached, "used": report.used,
                      "sum_refs": report.sum_refs, "sum_table_lens": report.sum_table_lens},
            "blocks": blocks,
            "sessions": [{"id": sid, "blocks": list(ids)} for sid, ids in per_session.items()],
        }
