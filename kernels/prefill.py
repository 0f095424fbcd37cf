"""Prefill attention over the paged KV cache: each chunk of new tokens attends to its sequence's
cached tokens and to itself, causally. chatcore/models/paged_attention.py calls `prefill_attention`
for the prefill part of a step's packed row; decode tokens go through `chatcore.kernels.dispatch`.

Torch code, on every device: SDPA (its fused kernels) by default. On the CPU, a chunk that
continues cached tokens (a new turn on a long history) may take `_continuation_attention`
(bf16, fp16) or `_cascade_attention` (float32) instead, as `_chunk_attention` says.

The caches may hold a narrower dtype than the queries (`kv_dtype`): what a chunk gathers is
converted to the query's dtype, so the math runs in the model's dtype (a no-op when they match).
Like the rest of kernels/, imported as `chatcore.kernels.prefill` only.
"""

from __future__ import annotations

import math
import threading
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["CASCADE_MIN_WORK", "CONTINUATION_MAX_SCORES", "HALF_CONTINUATION_GEMMS", "PrefillChunks",
           "prefill_attention"]

CONTINUATION_MAX_SCORES = 1 << 23  # heads x chunk x context: 32 MB of fp32 scores
CASCADE_MIN_WORK = 200_000  # cached x chunk tokens from which `_cascade_attention` pays (CPU, float32)
HALF_CONTINUATION_GEMMS = not torch.cpu._is_amx_tile_supported()  # see `_chunk_attention`


class PrefillChunks(Protocol):
    """A step's prefill chunks, packed one after another in the query row (the engine's
    `PrefillMeta`): each chunk's block table, first position and length, and the step's
    cache of `_shifted_causal_mask`s."""

    block_tables: torch.Tensor  # [P, max_blocks]
    starts: tuple[int, ...]  # the tokens cached before each chunk
    q_lens: tuple[int, ...]
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor]


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: PrefillChunks, scaling: float) -> torch.Tensor:
    """q: [T_prefill, heads, D] packed. Returns [T_prefill, heads, D].

    One attention call per chunk, each over its own gathered blocks. Padding the chunks to one
    shape with a mask computed up to 3x more attention than the chunks need (a 420-token prompt
    beside a 92-token one: 9.7 ms against 3.3 ms per layer, docs/benchmarks.md)."""
    outs = []
    offset = 0
    for row, (start, tokens) in enumerate(zip(meta.starts, meta.q_lens, strict=True)):
        outs.append(_chunk_attention(q[offset: offset + tokens], key_cache, value_cache, meta.block_tables[row],
                                     start, scaling, meta.masks))
        offset += tokens
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _chunk_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                     start: int, scale: float,
                     masks: dict[tuple[int, int, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """One chunk of T tokens after `start` cached ones, over its sequence's blocks `table`.

    A chunk that starts its sequence is plain causal attention (SDPA's fused kernels, no mask).
    One that continues cached tokens needs the causal mask shifted by `start`: SDPA with that
    mask, except on the CPU, where measurement chose by dtype and CPU (docs/measurements.md,
    "Continuation attention"). In bf16 on an AMD EPYC with avx512_bf16 and no AMX,
    `_continuation_attention`'s GEMMs beat SDPA's masked flash kernel; on a Xeon with AMX tiles SDPA
    beat them in bf16 and float16, so half precision takes SDPA there (`HALF_CONTINUATION_GEMMS`). In
    float32 the GEMMs ran slower than SDPA at every size tried, and `_cascade_attention` beat SDPA
    from `CASCADE_MIN_WORK` (docs/architecture.md).
    """
    tokens, heads, _ = q.shape
    length = start + tokens
    blocks = table[: -(-length // key_cache.shape[1])]
    # index_select copies whole blocks; indexing (`cache[blocks]`) ran slower (docs/measurements.md).
    keys = key_cache.index_select(0, blocks).flatten(0, 1)[:length].to(q.dtype)  # [L, KVH, D]
    values = value_cache.index_select(0, blocks).flatten(0, 1)[:length].to(q.dtype)
    if start and q.device.type == "cpu":
        if q.dtype != torch.float32:
            if HALF_CONTINUATION_GEMMS and not q.requires_grad and heads * tokens * length <= CONTINUATION_MAX_SCORES:
                return _continuation_attention(q, keys, values, start, scale)
        elif start * tokens >= CASCADE_MIN_WORK:
            return _cascade_attention(q, keys, values, start, scale)
    mask = _shifted_causal_mask(tokens, start, q.dtype, q.device, masks) if start else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=heads != key_cache.shape[2],
    )
    return out[0].transpose(0, 1)


def _shifted_causal_mask(tokens: int, start: int, dtype: torch.dtype, device: torch.device,
                         built: dict[tuple[int, int, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """[1, 1, T, start + T], additive: 0 where query i may attend (keys up to start + i), -inf
    after. SDPA turns a boolean mask into this same tensor in the query's dtype on every call;
    built once per step and chunk in `built` (the step's `PrefillMeta.masks`), every layer shares
    it (30 layers of a 100-token turn spent ~5 ms building and converting masks)."""
    key = (start, tokens, dtype)
    mask = built.get(key)
    if mask is None:
        positions = torch.arange(tokens, device=device) + start
        future = torch.arange(start + tokens, device=device).unsqueeze(0) > positions.unsqueeze(1)
        mask = torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))
        mask = built[key] = mask.view(1, 1, tokens, start + tokens)
    return mask


def _cascade_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                       scale: float) -> torch.Tensor:
    """A chunk continuing `start` cached tokens as two problems, one unmasked and one causal,
    merged by their log-sum-exps. q: [T, heads, D]; keys, values: [start + T, KVH, D].

    Every query sees every cached token, so the cached part needs no mask: each KV head's group
    of query heads is stacked into one [group x T] problem for the CPU flash kernel. The chunk's
    own T tokens are plain causal attention. Merging the two softmaxes by their log-sum-exps is
    exact up to rounding. It beats the masked SDPA call from `CASCADE_MIN_WORK`; below it the extra
    call and the merge cost what they save (docs/measurements.md, "Cascade attention").
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    k = keys.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    v = values.transpose(0, 1).unsqueeze(0)
    by_head = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]; head h reads KV head h // group
    past, past_lse = flash(by_head.reshape(1, kv_heads, group * tokens, dim), k[:, :, :start], v[:, :, :start],
                           scale=scale)
    own, own_lse = flash(by_head, k[:, :, start:].repeat_interleave(group, dim=1),
                         v[:, :, start:].repeat_interleave(group, dim=1), is_causal=True, scale=scale)
    past_lse = past_lse.reshape(1, heads, tokens)
    top = torch.maximum(past_lse, own_lse)
    past_w = torch.exp(past_lse - top).unsqueeze(-1)
    own_w = torch.exp(own_lse - top).unsqueeze(-1)
    out = (past.reshape(1, heads, tokens, dim).float() * past_w + own.float() * own_w) / (past_w + own_w)
    return out.to(q.dtype)[0].transpose(0, 1)


class _Scratch(threading.local):
    """Score buffers reused across layers and steps. A fresh multi-MB tensor per layer costs more
    in page faults than the attention math (malloc returns large blocks to the OS on free).
    Buffers only grow, to at most `CONTINUATION_MAX_SCORES` elements each (80 MB in all for a
    bf16 model); one set per inference mode, since inference tensors cannot be written outside
    it. Results never alias them, and they are not used when autograd could save them."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, bool], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype, torch.is_inference_mode_enabled())
        numel = math.prod(shape)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device="cpu")
        return buffer[:numel].view(shape)


_scratch = _Scratch()


def _continuation_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                            scale: float) -> torch.Tensor:
    """A chunk of T tokens after `start` cached ones. q: [T, heads, D]; keys, values: [start + T, KVH, D].

    Each KV head's group of query heads is stacked into one [group * T, D] x [D, L] product,
    the softmax runs in fp32, and only the chunk's own T columns need the causal mask. In bf16,
    for a ~120-token turn on a ~2,000-token history, this was about 1.5x faster than the flash
    kernel with a mask, which works through small tiles (docs/architecture.md).
    """
    tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    length = start + tokens
    rows = (q * scale).reshape(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * tokens, dim)
    shape = (kv_heads, group * tokens, length)
    scores = torch.bmm(rows, keys.permute(1, 2, 0), out=_scratch.take("scores", shape, q.dtype))
    if q.dtype != torch.float32:
        scores = _scratch.take("scores32", shape, torch.float32).copy_(scores)
    future = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).triu_(1)
    scores.view(kv_heads, group, tokens, length)[..., start:].masked_fill_(future, float("-inf"))
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=_scratch.take("probs", shape, torch.float32))
    if q.dtype != torch.float32:
        probs = _scratch.take("scores", shape, q.dtype).copy_(probs)
    out = torch.bmm(probs, values.transpose(0, 1))  # [KVH, group * T, D]
    return out.view(kv_heads, group, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, heads, dim)
