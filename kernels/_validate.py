"""Argument checks shared by the Triton and reference paths of the public entry points.

Only metadata is inspected (shapes, dtypes, devices): nothing here reads tensor data, so the
checks never synchronise with a GPU. Data-dependent preconditions (context lengths within
the block table's capacity, block ids in range) are the caller's responsibility.
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    _require(value_cache.shape == key_cache.shape, "value_cache must have key_cache's shape")
    _require(value_cache.dtype == key_cache.dtype, "value_cache must have key_cache's dtype")
    _require(value_cache.device == key_cache.device, "key_cache and value_cache must share a device")
    _require(key_cache.dtype in _FLOAT_DTYPES, f"unsupported cache dtype {key_cache.dtype}")


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_caches(key_cache, value_cache)
    _require(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim]")
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    _require(query.dtype in _FLOAT_DTYPES, f"unsupported query dtype {query.dtype}")
    _require(head_dim == key_cache.shape[3], "query and the caches must share head_dim")
    _require(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
    _require(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        "block_tables must be [num_seqs, max_blocks_per_seq]",
    )
    _require(block_tables.dtype == torch.int32, "block_tables must be int32")
    _require(tuple(context_lens.shape) == (num_seqs,), "context_lens must be [num_seqs]")
    _require(context_lens.dtype == torch.int32, "context_lens must be int32")
    devices = {t.device for t in (query, key_cache, block_tables, context_lens)}
    _require(len(devices) == 1, "all tensors must be on one device")
    if out is not None:
        _require(
            out.shape == query.shape and out.dtype == query.dtype and out.device == query.device,
            "out must have the query's shape, dtype and device",
        )


def check_store(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_caches(key_cache, value_cache)
    _require(key.dim() == 3, "key must be [num_tokens, num_kv_heads, head_dim]")
    _require(value.shape == key.shape, "value must have key's shape")
    _require(tuple(key.shape[1:]) == tuple(key_cache.shape[2:]), "key and the caches disagree on heads/head_dim")
    _require(tuple(slot_mapping.shape) == (key.shape[0],), "slot_mapping must be [num_tokens]")
    _require(slot_mapping.dtype == torch.int64, "slot_mapping must be int64")
    devices = {t.device for t in (key, value, key_cache, slot_mapping)}
    _require(len(devices) == 1, "all tensors must be on one device")


def check_copy(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    check_caches(key_cache, value_cache)
    _require(src.dim() == 1 and dst.shape == src.shape, "src and dst must be [n] with the same n")
    _require(src.dtype == torch.int64 and dst.dtype == torch.int64, "src and dst must be int64")
    devices = {t.device for t in (key_cache, src, dst)}
    _require(len(devices) == 1, "all tensors must be on one device")


def check_unified(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None) -> None:
    check_caches(key_cache, value_cache)
    _require(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim]")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _require(query.dtype in _FLOAT_DTYPES, f"unsupported query dtype {query.dtype}")
    _require(query.shape[2] == key_cache.shape[3], "query and the caches must share head_dim")
    _require(query.shape[1] % key_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads")
    _require(num_seqs >= 0 and seq_lens.dtype == torch.int32, "seq_lens must be int32 [num_seqs]")
    _require(tuple(cu_seqlens_q.shape) == (num_seqs + 1,) and cu_seqlens_q.dtype == torch.int32,
             "cu_seqlens_q must be int32 [num_seqs + 1]")
    _require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32,
             "block_tables must be int32 [num_seqs, max_blocks_per_seq]")
    devices = {t.device for t in (query, key_cache, block_tables, cu_seqlens_q, seq_lens)}
    _require(len(devices) == 1, "all tensors must be on one device")
    if out is not None:
        _require(out.shape == query.shape and out.dtype == query.dtype and out.device == query.device,
                 "out must have the query's shape, dtype and device")
