"""Errors raised by the block bookkeeping. Each one leaves the pool's state unchanged."""


class CacheError(RuntimeError):
    """A misuse of the cache: double free, use after release, unknown block."""


class NoFreeBlocks(CacheError):
    """Every block is in use: nothing free and nothing cached-free left to evict."""
