"""What the engine thread does for each command (`chatcore/engine/commands.py`), between two steps.

The table maps each command type to its handler; a type not in it is refused, so the door admits
the closed set and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from chatcore.cache import audit
from chatcore.engine.block_map import block_map
from chatcore.engine.commands import (
    Abort,
    AddRequest,
    Audit,
    BlockMap,
    CachedPrefix,
    Command,
    DropSession,
    NumBlocks,
    PinnedBlocks,
    Prefetch,
    ReadBlocks,
    ResetPrefixCache,
    Resize,
    Stats,
    Unpin,
)
from chatcore.engine.core import EngineCore
from chatcore.engine.outputs import RequestOutput

R = TypeVar("R")


class CommandHandlers:
    def __init__(self, core: EngineCore, dispatch: Callable[[RequestOutput], None]) -> None:
        """`dispatch`: delivers an output to its request's stream (an abort's final output)."""
        self._core = core
        self._dispatch = dispatch
        kv = core.kv_cache
        pool = core.pool
        self._table: dict[type[Command[Any]], Callable[[Any], Any]] = {
            AddRequest: lambda c: core.add(c.request, c.prefix),
            Abort: self._abort,
            Unpin: lambda c: kv.unpin(c.session_id),
            DropSession: lambda c: kv.drop(c.session_id),
            PinnedBlocks: lambda c: kv.pinned_blocks(c.session_id),
            CachedPrefix: self._cached_prefix,
            Prefetch: lambda c: kv.prefetch(c.session_id, c.tokens, c.salt, c.device_blocks, c.tensors),
            ReadBlocks: lambda c: kv.read(c.hashes),
            BlockMap: lambda c: block_map(pool, c.session_of_request),
            Stats: lambda c: pool.stats(),
            Audit: lambda c: audit(pool),
            NumBlocks: lambda c: pool.num_blocks,
            Resize: lambda c: core.resize(c.num_blocks),
            ResetPrefixCache: lambda c: pool.evict_cached(),
        }

    def handle(self, command: Command[R]) -> R:
        handler = self._table.get(type(command))
        if handler is None:
            raise TypeError(f"not an engine command: {type(command).__name__}")
        result: R = handler(command)
        return result

    def _abort(self, command: Abort) -> RequestOutput | None:
        out = self._core.abort(command.request_id)
        if out is not None:
            self._dispatch(out)
        return out

    def _cached_prefix(self, command: CachedPrefix) -> int:
        kv = self._core.kv_cache
        if command.session_id is not None and command.session_id in kv.pinned_sessions:
            return command.max_blocks
        return kv.cached_prefix(command.tokens, command.salt, command.max_blocks)
