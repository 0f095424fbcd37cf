"""Compiled grammars kept for reuse, bounded by the memory they really hold.

xgrammar's own cache counts far less than its entries hold (docs/measurements.md, "Grammar sizes"), so it
is disabled and this cache bounds what the grammars hold instead.

Invariants:
- an entry's size is `entry_bytes`: the grammar's `memory_size_bytes` (xgrammar's count of the grammar
  and its token-mask tables) times `SIZE_FACTOR`, plus `ENTRY_BYTES`. Measured against the RSS a held
  grammar adds (gc and malloc_trim after), over schema shapes from one 8-character field to 32 KB enums,
  it is 1.1-1.3x the RSS of large grammars and at least 1.4x that of small ones: an over-estimate;
- the sizes of the grammars this cache knows alive (kept, or evicted while a request still holds them)
  stay within `limit_bytes` as far as evicting kept ones can make them: each `put` evicts the least
  recently used until they do; a grammar that alone exceeds the limit is not kept. An evicted grammar a
  request holds is counted until its last reference goes (its memory goes then, not at eviction), and
  is found by `get` until then: a schema is never held twice;
- after an eviction glibc's `malloc_trim` returns the freed pages of every arena (each compile runs on a
  fresh thread and allocates in an arena of its own, where glibc keeps what a grammar frees);
- thread-safe: compile threads put, the event loop and the engine thread drop the requests that hold
  grammars (the weakref callbacks take the same lock, reentrant: an eviction's runs inside `put`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import xgrammar

SIZE_FACTOR = 1.5
ENTRY_BYTES = 256 << 10  # per grammar: what small grammars hold beyond xgrammar's count (measured up to ~190 KiB)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None elsewhere."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


MALLOC_TRIM = _malloc_trim()


def entry_bytes(compiled: xgrammar.CompiledGrammar) -> int:
    """The memory `compiled` is taken to hold (see the module's invariants)."""
    return int(compiled.memory_size_bytes * SIZE_FACTOR) + ENTRY_BYTES


class GrammarCache:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._lock = threading.RLock()
        self._kept: OrderedDict[Hashable, xgrammar.CompiledGrammar] = OrderedDict()  # least recently used first
        self._alive: dict[int, int] = {}  # id(grammar) -> its entry_bytes, for every grammar put and not yet freed
        self._alive_bytes = 0
        self._by_key: weakref.WeakValueDictionary[Hashable, xgrammar.CompiledGrammar] = weakref.WeakValueDictionary()

    def get(self, key: Hashable) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            compiled = self._kept.get(key)
            if compiled is not None:
                self._kept.move_to_end(key)
                return compiled
            return self._by_key.get(key)  # evicted, and still held by a request

    def put(self, key: Hashable, compiled: xgrammar.CompiledGrammar) -> xgrammar.CompiledGrammar:
        """Keep `compiled` under `key` (unless it cannot fit) and evict to the limit; returns the grammar
        to use: the one already alive under `key` if another thread put it first."""
        size = entry_bytes(compiled)
        evicted = False
        with self._lock:
            existing = self.get(key)
            if existing is not None:
                return existing
            self._by_key[key] = compiled
            self._track(compiled, size)
            if size <= self.limit_bytes:
                self._kept[key] = compiled
            while self._alive_bytes > self.limit_bytes and self._kept:
                # Dropped at once: if this was its last reference, its callback (on this thread, the lock is
                # reentrant) takes its size off before the next check; if a request holds it, it still counts.
                self._kept.popitem(last=False)
                evicted = True
        if evicted and MALLOC_TRIM is not None:
            MALLOC_TRIM(0)  # glibc keeps freed pages in each thread's arena; give them back (0.4 ms measured)
        return compiled

    def _track(self, compiled: xgrammar.CompiledGrammar, size: int) -> None:
        ident = id(compiled)
        self._alive[ident] = size
        self._alive_bytes += size
        weakref.finalize(compiled, self._freed, ident)

    def _freed(self, ident: int) -> None:
        with self._lock:
            self._alive_bytes -= self._alive.pop(ident)

    @property
    def size_bytes(self) -> int:
        """The sizes of the grammars alive that this cache put: kept, or evicted and still held."""
        with self._lock:
            return self._alive_bytes
