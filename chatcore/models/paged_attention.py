"""Paged attention for transformers models, registered through `AttentionInterface`.

One forward pass covers a whole engine step: every scheduled sequence's new tokens are packed
into one row, decode tokens (one per sequence) first, then prefill chunks. The model's own
modules do the projections and RoPE (from our `position_ids`); this function receives the
rotated keys and values of the packed row, writes them into their cache slots, and attends:

* decode tokens through `kernels.paged_decode_attention` over their block tables;
* prefill chunks with a causal attention over their gathered blocks (cached prefix + chunk).

The step's metadata (`StepMeta`) travels as the `chatcore_step` keyword argument, which
transformers passes through to this function unchanged. The name is not registered as a mask
function, so transformers skips building any mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import kernels
from chatcore.kv.tensors import KVTensors

ATTENTION_NAME = "chatcore_paged"


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
    num_seqs, max_q, max_ctx = meta.num_seqs, meta.max_q, meta.max_ctx
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = key_cache.shape[2]
    keys = key_cache[meta.block_tables].flatten(1, 2)[:, :max_ctx]  # [P, L, KVH, D]
    values = value_cache[meta.block_tables].flatten(1, 2)[:, :max_ctx]
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
