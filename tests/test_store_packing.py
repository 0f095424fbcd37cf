"""Packing of token ids (little-endian uint32) and 16-byte block hashes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatcore.store.packing import HASH_SIZE, pack_hashes, pack_ids, unpack_hashes, unpack_ids


def test_ids_are_little_endian_uint32() -> None:
    assert pack_ids([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert pack_ids([]) == b""
    assert unpack_ids(b"") == []


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300))
def test_ids_round_trip(ids: list[int]) -> None:
    packed = pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert unpack_ids(packed) == ids


@given(st.lists(st.binary(min_size=HASH_SIZE, max_size=HASH_SIZE), max_size=50))
def test_hashes_round_trip(hashes: list[bytes]) -> None:
    packed = pack_hashes(hashes)
    assert len(packed) == HASH_SIZE * len(hashes)
    assert unpack_hashes(packed) == hashes


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_ids_outside_uint32_are_rejected(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        pack_ids(bad)


def test_truncated_data_is_rejected() -> None:
    with pytest.raises(ValueError):
        unpack_ids(b"\x00" * 5)
    with pytest.raises(ValueError):
        unpack_hashes(b"\x00" * (HASH_SIZE + 1))
    with pytest.raises(ValueError, match="block hash 1"):
        pack_hashes([b"\x00" * HASH_SIZE, b"\x00" * (HASH_SIZE - 1)])
