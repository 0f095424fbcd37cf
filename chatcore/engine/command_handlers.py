"""What the engine thread does for each command (`chatcore/engine/commands.py`), between two steps.

The table maps each command type to its handler; a type not in it is refused, so the door admits
the closed set and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

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
        self._table: dict[type[Command[Any]], Callable[[Any], Any]] = {
            AddRequest: lambda c: core.add(c.request, c.prefix),
            Abort: self._abort,
            Unpin: lambda c: kv.pins.unpin(c.session_id),
            DropSession: lambda c: kv.pins.drop(c.session_id),
            PinnedBlocks: lambda c: kv.pins.blocks(c.session_id),
            CachedPrefix: self._cached_prefix,
            Prefetch: lambda c: kv.disk.prefetch(c.session_id, c.tokens, c.salt, c.device_blocks, c.tensors),
            ReadBlocks: lambda c: kv.disk.read(c.hashes),
            BlockMap: lambda c: kv.block_map(c.session_of_request),
            Stats: lambda c: kv.stats(),
            Audit: lambda c: kv.audit(),
            NumBlocks: lambda c: kv.num_blocks,
            Resize: lambda c: kv.resize(c.num_blocks),
            ResetPrefixCache: lambda c: kv.reset_prefix_cache(),
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
        return kv.disk.cached_prefix(command.tokens, command.salt, command.max_blocks)
