"""Paged attention for transformers models, registered through `AttentionInterface`.

One forward pass covers a whole engine step: every scheduled sequence's new tokens are packed
into one row, decode tokens (one per sequence) first, then prefill chunks. The model's own
modules do the projections and RoPE (from our `position_ids`); this function receives the
rotated keys and values of the packed row, writes them into their cache slots, and attends:

* decode tokens through `kernels.paged_decode_attention` over their block tables;
* prefill chunks with a causal attention over their gathered blocks (cached prefix + chunk).
  On the CPU, a lone chunk that continues cached tokens (a new turn on a long history) takes
  `_continuation_attention` instead, when its scores fit `CONTINUATION_MAX_SCORES`.

The KV tensors may be stored in a narrower dtype than the model's (`kv_dtype`): writes are cast
to the storage dtype, and every read converts what it gathered back to the model's dtype, so the
attention math always runs in the model's dtype. With `kv_dtype=auto` the dtypes are equal and
the conversions are no-ops (`Tensor.to` returns the tensor itself): no copy is added.

The step's metadata (`StepMeta`) travels as the `chatcore_step` keyword argument, which
transformers passes through to this function unchanged. The name is not registered as a mask
function, so transformers skips building any mask.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import kernels
from chatcore.kv.tensors import KVTensors

ATTENTION_NAME = "chatcore_paged"
CONTINUATION_MAX_SCORES = 1 << 23  # heads x chunk x context: 32 MB of fp32 scores


@dataclass(slots=True)
class PrefillMeta:
    """Causal attention of P prefill chunks over their gathered blocks.

    `block_tables` [P, max_blocks] (padding clamped to a valid id), `mask` [P, 1, max_q, max_ctx]
    (True = attend), `scatter` maps each packed prefill token to its row in the padded
    [P * max_q] query layout, or None when P == 1 and no padding is needed.
    """

    block_tables: torch.Tensor
    mask: torch.Tensor | None
    scatter: torch.Tensor | None
    num_seqs: int
    max_q: int
    max_ctx: int
    start: int = 0  # P == 1: the chunk's first position (its cached tokens); else 0


@dataclass(slots=True)
class StepMeta:
    kv: KVTensors
    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefill: PrefillMeta | None


def _prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       meta: PrefillMeta, scaling: float) -> torch.Tensor:
    """q: [T_prefill, heads, D] packed. Returns [T_prefill, heads, D]."""
    if (meta.start and q.device.type == "cpu" and not q.requires_grad
            and q.shape[1] * meta.max_q * meta.max_ctx <= CONTINUATION_MAX_SCORES):
        return _continuation_attention(q, key_cache, value_cache, meta, scaling)
    num_seqs, max_q, max_ctx = meta.num_seqs, meta.max_q, meta.max_ctx
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = key_cache.shape[2]
    keys = key_cache[meta.block_tables].flatten(1, 2)[:, :max_ctx].to(q.dtype)  # [P, L, KVH, D]
    values = value_cache[meta.block_tables].flatten(1, 2)[:, :max_ctx].to(q.dtype)
    if meta.scatter is None:
        q_pad = q.unsqueeze(0)
    else:
        q_pad = q.new_zeros(num_seqs * max_q, heads, dim)
        q_pad[meta.scatter] = q
        q_pad = q_pad.view(num_seqs, max_q, heads, dim)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.mask,
        is_causal=meta.mask is None,
        scale=scaling,
        enable_gqa=heads != kv_heads,
    ).transpose(1, 2)  # [P, max_q, heads, D]
    if meta.scatter is None:
        return out[0]
    return out.reshape(num_seqs * max_q, heads, dim)[meta.scatter]


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


def _continuation_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            meta: PrefillMeta, scale: float) -> torch.Tensor:
    """One sequence's chunk of T tokens after `meta.start` cached ones. q: [T, heads, D].

    Each KV head's group of query heads is stacked into one [group * T, D] x [D, L] product,
    the softmax runs in fp32, and only the chunk's own T columns need the causal mask. For a
    ~120-token turn on a ~2,000-token history this is about 1.5x faster on this CPU than the
    flash kernel with a mask, which works through small tiles (docs/architecture.md).
    """
    tokens, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    start = meta.start
    length = start + tokens
    keys = key_cache[meta.block_tables[0]].flatten(0, 1)[:length].to(q.dtype)  # [L, KVH, D]
    values = value_cache[meta.block_tables[0]].flatten(0, 1)[:length].to(q.dtype)
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


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    chatcore_step: StepMeta | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    if chatcore_step is None:
        raise RuntimeError("chatcore_paged attention needs the step metadata (chatcore_step=...)")
    meta = chatcore_step
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key_cache, value_cache = meta.kv.layer(module.layer_idx)
    q = query[0].transpose(0, 1)  # [T, heads, D]
    k = key[0].transpose(0, 1).to(key_cache.dtype)
    v = value[0].transpose(0, 1).to(value_cache.dtype)
    kernels.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    nd = meta.num_decode
    parts: list[torch.Tensor] = []
    if nd:
        parts.append(kernels.paged_decode_attention(
            q[:nd].contiguous(), key_cache, value_cache, meta.decode_block_tables,
            meta.decode_context_lens, scale))
    if meta.prefill is not None:
        parts.append(_prefill_attention(q[nd:], key_cache, value_cache, meta.prefill, scale))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the attention function under `ATTENTION_NAME` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
