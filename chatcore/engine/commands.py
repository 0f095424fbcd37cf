"""The engine's commands: the closed set of typed messages that cross its door (like vLLM's
`EngineCoreRequestType` and its utility calls).

Callers outside the engine send these through `InferenceEngine.send` (requests go in through
`generate`, which sends `AddRequest`); the engine thread handles each between two steps
(`chatcore/engine/command_handlers.py`) and the result comes back on the caller's event loop. No
caller code runs on the engine thread. Each command names its result type: `Command[R]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from chatcore.cache import AuditReport
from chatcore.cache.pool import PoolStats
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request

R = TypeVar("R")


class Command(Generic[R]):
    """A message to the engine thread whose handler returns an `R`."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class SessionPrefix:
    """Where a session turn's prompt prefix may come from, sent with its request (`AddRequest`).

    `use_pin`: the session's pin holds a prefix of this prompt (its window did not move).
    `disk_tier`: a disk tier may hold the full blocks the pool lacks; the add then declines
    (`PrefixOnDisk`) so that the caller reads them first. `prefetched`: the chain places the
    session's prefetch installed. `disk`: the blocks read back, as (first block index, tensors).
    """

    session_id: str
    use_pin: bool = True
    disk_tier: bool = False
    prefetched: range = range(0)
    disk: tuple[int, list[torch.Tensor]] | None = None


@dataclass(frozen=True, slots=True)
class AddRequest(Command[int | None]):
    """Queue a request (its prefix prepared first when `prefix` is given). The result is None when it
    was added, or the count of full prompt blocks the pool holds when it declines (see `SessionPrefix`)."""

    request: Request
    prefix: SessionPrefix | None = None


@dataclass(frozen=True, slots=True)
class Abort(Command[RequestOutput | None]):
    """End a request in any state; the result is its final `RequestOutput`, or None if it was unknown."""

    request_id: str


@dataclass(frozen=True, slots=True)
class _SessionCommand:
    session_id: str


@dataclass(frozen=True, slots=True)
class Unpin(_SessionCommand, Command[bool]):
    """Release a session's pinned chain (its full blocks stay cached-free); whether it had one."""


@dataclass(frozen=True, slots=True)
class DropSession(_SessionCommand, Command[None]):
    """A deleted session: release its pin and forget it in the eviction forecast."""


@dataclass(frozen=True, slots=True)
class PinnedBlocks(_SessionCommand, Command[int]):
    """How many blocks the session's pin holds (0 when it has none)."""


@dataclass(frozen=True, slots=True)
class CachedPrefix(Command[int]):
    """How many of the first `max_blocks` full blocks of `tokens` the pool holds; all of them for a
    pinned session."""

    tokens: list[int]
    salt: bytes
    max_blocks: int
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Prefetch(Command[range]):
    """Install a session's full blocks read back from the disk tier (from block `device_blocks` on)
    as cached-free blocks the session claims; the result is the installed places in its chain."""

    session_id: str
    tokens: list[int]
    salt: bytes
    device_blocks: int
    tensors: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReadBlocks(Command[list[tuple[bytes, torch.Tensor]]]):
    """The KV of the blocks the pool still holds under these hashes (for the disk tier)."""

    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class BlockMap(Command[dict[str, Any]]):
    """The audit and which sessions map which blocks; `session_of_request` names running requests' sessions."""

    session_of_request: dict[str, str]


@dataclass(frozen=True, slots=True)
class Stats(Command[PoolStats]):
    """The pool's blocks by state."""


@dataclass(frozen=True, slots=True)
class Audit(Command[AuditReport]):
    """The cache's invariant check over every live table."""


@dataclass(frozen=True, slots=True)
class NumBlocks(Command[int]):
    """The pool's size now."""


@dataclass(frozen=True, slots=True)
class Resize(Command[int]):
    """Grow or shrink the pool and its tensors together; the result is the new size."""

    num_blocks: int


@dataclass(frozen=True, slots=True)
class ResetPrefixCache(Command[int]):
    """Evict every cached-free block (vLLM's `reset_prefix_cache`); the result is how many went."""
