"""Binary packing of token ids and block hashes for `session_chains` and `turns`.

Token ids are little-endian uint32, so a chain of N tokens takes 4*N bytes on
every platform and backend. Block hashes are fixed-size (`HASH_SIZE` bytes) and
simply concatenated.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

HASH_SIZE = 16


def pack_ids(ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32. Raises `ValueError` for ids outside [0, 2**32)."""
    try:
        return struct.pack(f"<{len(ids)}I", *ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def unpack_ids(data: bytes) -> list[int]:
    """Inverse of `pack_ids`. Raises `ValueError` when the length is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"packed token ids have {len(data)} bytes, not a multiple of 4")
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def pack_hashes(hashes: Sequence[bytes]) -> bytes:
    """Concatenate block hashes. Raises `ValueError` unless each is exactly `HASH_SIZE` bytes."""
    for i, digest in enumerate(hashes):
        if len(digest) != HASH_SIZE:
            raise ValueError(f"block hash {i} has {len(digest)} bytes, expected {HASH_SIZE}")
    return b"".join(hashes)


def unpack_hashes(data: bytes) -> list[bytes]:
    """Inverse of `pack_hashes`. Raises `ValueError` when the length is not a multiple of `HASH_SIZE`."""
    if len(data) % HASH_SIZE:
        raise ValueError(f"packed block hashes have {len(data)} bytes, not a multiple of {HASH_SIZE}")
    return [data[i : i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]
