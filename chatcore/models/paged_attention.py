"""Paged attention for transformers models, registered through `AttentionInterface`.

One forward pass covers a whole engine step: every scheduled sequence's new tokens are packed
into one row, decode tokens (one per sequence) first, then prefill chunks. The model's own
modules do the projections and RoPE (from our `position_ids`); this function receives the
rotated keys and values of the packed row, writes them into their cache slots, and attends:

* decode tokens through `kernels.paged_decode_attention` over their block tables;
* prefill chunks one by one, each with a causal attention over its gathered blocks (cached
  prefix + chunk). On the CPU, a chunk that continues cached tokens (a new turn on a long
  history) takes `_continuation_attention` instead, when its scores fit `CONTINUATION_MAX_SCORES`.

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
from chatcore.models.support import AttentionProbe

ATTENTION_NAME = "chatcore_paged"
CONTINUATION_MAX_SCORES = 1 << 23  # heads x chunk x context: 32 MB of fp32 scores


@dataclass(slots=True)
class PrefillMeta:
    """The step's prefill chunks, packed one after another in the query row.

    `block_tables` [P, max_blocks] (padding holds a valid id), and for each chunk its first
    position (`starts`: the tokens already cached before it) and its length (`q_lens`), as host
    integers: shapes, never read back from the device.
    """

    block_tables: torch.Tensor
    starts: tuple[int, ...]
    q_lens: tuple[int, ...]


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
    """q: [T_prefill, heads, D] packed. Returns [T_prefill, heads, D].

    One attention call per chunk, each over its own gathered blocks. Padding the chunks to one
    shape with a mask computed up to 3x more attention than the chunks need (a 420-token prompt
    beside a 92-token one: 9.7 ms against 3.3 ms per layer, docs/benchmarks.md)."""
    outs = []
    offset = 0
    for row, (start, tokens) in enumerate(zip(meta.starts, meta.q_lens, strict=True)):
        outs.append(_chunk_attention(q[offset: offset + tokens], key_cache, value_cache, meta.block_tables[row],
                                     start, scaling))
        offset += tokens
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _chunk_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                     start: int, scale: float) -> torch.Tensor:
    """One chunk of T tokens after `start` cached ones, over its sequence's blocks `table`.

    A chunk that starts its sequence is plain causal attention (SDPA's fused kernels, no mask).
    One that continues cached tokens needs the causal mask shifted by `start`; on the CPU it
    takes `_continuation_attention` when its scores fit `CONTINUATION_MAX_SCORES`.
    """
    tokens, heads, _ = q.shape
    length = start + tokens
    blocks = table[: -(-length // key_cache.shape[1])]
    if (start and q.device.type == "cpu" and not q.requires_grad
            and heads * tokens * length <= CONTINUATION_MAX_SCORES):
        return _continuation_attention(q, key_cache, value_cache, blocks, start, scale)
    keys = key_cache[blocks].flatten(0, 1)[:length].to(q.dtype)  # [L, KVH, D]
    values = value_cache[blocks].flatten(0, 1)[:length].to(q.dtype)
    mask = None
    if start:
        positions = torch.arange(tokens, device=q.device) + start
        mask = (torch.arange(length, device=q.device).unsqueeze(0) <= positions.unsqueeze(1)).view(1, 1, tokens, length)
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
                            blocks: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """One sequence's chunk of T tokens after `start` cached ones, over its `blocks`. q: [T, heads, D].

    Each KV head's group of query heads is stacked into one [group * T, D] x [D, L] product,
    the softmax runs in fp32, and only the chunk's own T columns need the causal mask. For a
    ~120-token turn on a ~2,000-token history this is about 1.5x faster on this CPU than the
    flash kernel with a mask, which works through small tiles (docs/architecture.md).
    """
    tokens, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    length = start + tokens
    keys = key_cache[blocks].flatten(0, 1)[:length].to(q.dtype)  # [L, KVH, D]
    values = value_cache[blocks].flatten(0, 1)[:length].to(q.dtype)
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
    chatcore_probe: AttentionProbe | None = None,
    **arguments: object,
) -> tuple[torch.Tensor, None]:
    """The layer's attention over the paged cache. The other `arguments` the model passes are
    ignored: at load, `support.check` refused every model that gives one that matters (a softcap,
    sinks), and capped the context at the smallest `sliding_window`, within which a window masks
    nothing. `chatcore_probe` is that load-time check's recorder."""
    if chatcore_probe is not None:
        return chatcore_probe.record(module, query, key, value, {"scaling": scaling, "dropout": dropout, **arguments})
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
