"""Content hashes of full blocks, and the hash-to-block index.

A block's hash chains its parent's hash, its token ids and a salt made of the extra keys
(model fingerprint, block size, dtype, cache scope). BLAKE2b makes it deterministic across
processes and restarts; Python's `hash()` is never used. Only full blocks are hashed.

The index maps a hash to one block id. A hit is trusted only after the stored token ids of
that block are compared with the query's: a hash collision can never serve wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from hashlib import blake2b

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)


def cache_salt(model_fingerprint: str, block_size: int, dtype: str, scope: str = "global") -> bytes:
    """The extra keys every block hash depends on, folded into one digest."""
    text = f"model={model_fingerprint}\0block={block_size}\0dtype={dtype}\0scope={scope}"
    return blake2b(text.encode(), digest_size=HASH_BYTES).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    h = blake2b(digest_size=HASH_BYTES)
    h.update(parent)
    h.update(salt)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: bytes, start: int = 0,
                 parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, from block index `start`, chained from `parent`."""
    out: list[bytes] = []
    for first in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[first:first + block_size], salt)
        out.append(parent)
    return out


class PrefixIndex:
    """hash -> block id for every hashed block (in use or cached-free)."""

    def __init__(self) -> None:
        self._map: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get(self, block_hash: bytes) -> int | None:
        return self._map.get(block_hash)

    def add(self, block_hash: bytes, block_id: int) -> bool:
        """Index a block; False if another block already holds this content."""
        if block_hash in self._map:
            return False
        self._map[block_hash] = block_id
        return True

    def remove(self, block_hash: bytes, block_id: int) -> None:
        if self._map.get(block_hash) == block_id:
            del self._map[block_hash]

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._map.items())


Finder = Callable[[bytes, Sequence[int]], "int | None"]


def longest_prefix(find: Finder, token_ids: Sequence[int], block_size: int, salt: bytes,
                   max_blocks: int | None = None) -> tuple[list[int], list[bytes]]:
    """The longest run of leading full blocks of `token_ids` that `find` has cached.

    Returns the block ids and their chained hashes. Stops at the first miss: a block is only
    reusable if its whole prefix is.
    """
    limit = len(token_ids) // block_size
    if max_blocks is not None:
        limit = min(limit, max_blocks)
    block_ids: list[int] = []
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for i in range(limit):
        block_tokens = token_ids[i * block_size:(i + 1) * block_size]
        parent = hash_block(parent, block_tokens, salt)
        found = find(parent, block_tokens)
        if found is None:
            break
        block_ids.append(found)
        hashes.append(parent)
    return block_ids, hashes
