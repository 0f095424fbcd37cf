"""Paged attention for transformers models, registered through `AttentionInterface`.

One forward pass covers a whole engine step: every scheduled sequence's new tokens are packed
into one row, decode tokens (one per sequence) first, then prefill chunks. The model's own
modules do the projections and RoPE (from our `position_ids`); this function receives the
rotated keys and values of the packed row, writes them into their cache slots, and attends:

* on the Triton route (CUDA, or the CPU under `TRITON_INTERPRET=1`; `StepMeta.unified`), every row, decode
  and prefill alike, through one `kernels.unified_attention` launch (kernels/unified_attention.py);
* otherwise decode tokens through `kernels.paged_decode_attention` over their block tables, and
  prefill chunks one by one, each with a causal attention over its gathered blocks (cached
  prefix + chunk), through `chatcore.kernels.prefill` (kernels/prefill.py), which also holds
  the CPU's faster paths for a chunk that continues cached tokens.

The KV tensors may be stored in a narrower dtype than the model's (`kv_dtype`): writes are cast
to the storage dtype, and every read converts what it gathered back to the model's dtype, so the
attention math always runs in the model's dtype. With `kv_dtype=auto` the dtypes are equal and
the conversions are no-ops (`Tensor.to` returns the tensor itself): no copy is added.

The step's metadata (`StepMeta`) travels as the `chatcore_step` keyword argument, which
transformers passes through to this function unchanged. The name is not registered as a mask
function, so transformers skips building any mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from chatcore.kernels import dispatch as kernels
from chatcore.kernels import prefill
from chatcore.kv.tensors import KVTensors
from chatcore.models.errors import UnsupportedModel
from chatcore.models.support import AttentionProbe

ATTENTION_NAME = "chatcore_paged"


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
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)  # kernels/prefill.py's


@dataclass(frozen=True, slots=True)
class UnifiedMeta:
    """The Triton route's step: each of the step's entries (decode rows first, then chunks) is one sequence of
    `kernels.unified_attention`. `block_tables` int32 [S, width] (padding holds block 0), `cu_seqlens_q` int32
    [S + 1] (the packed row's offsets), `seq_lens` int32 [S] (each entry's context, its new tokens included)."""

    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(slots=True)
class StepMeta:
    """`decode_max_context`: the longest decode context, when the host knows it (no kernel then reads
    it back); `route`: the kernels the step's layers call, chosen by its first layer (`attend`)."""

    kv: KVTensors
    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefill: PrefillMeta | None
    decode_max_context: int | None = None
    route: kernels.AttentionRoute | None = None
    unified: UnifiedMeta | None = None


def unified_route(device: torch.device) -> bool:
    """Whether a step on `device` attends through `StepMeta.unified` (the Triton route: CUDA, or the CPU under
    `TRITON_INTERPRET=1`, decided per step as the kernels decide per call)."""
    return kernels.uses_triton(device)


def check_route(device: torch.device, head_dim: int, block_size: int, dtype: torch.dtype,
                kv_dtype: torch.dtype) -> None:
    """At load, on the Triton route: refuse, with `UnsupportedModel` and one line naming the supported values,
    a head_dim, block size or dtype its attention kernel cannot serve, rather than fail at the first request."""
    if not kernels.uses_triton(device):
        return
    from chatcore.kernels.unified_attention import check_supported

    try:
        check_supported(head_dim, block_size, dtype, kv_dtype)
    except ValueError as refused:
        raise UnsupportedModel(str(refused)) from None


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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 scale, chatcore_step)
    return out.unsqueeze(0), None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           meta: StepMeta) -> torch.Tensor:
    """Layer `layer`'s attention of the step's packed rows: `q` [T, heads, D], the rotated `k` and `v`
    [T, kv_heads, D] (views of any strides); writes k and v into their slots, returns [T, heads, D]."""
    key_cache, value_cache = meta.kv.layer(layer)
    k, v = k.to(key_cache.dtype), v.to(value_cache.dtype)
    if meta.unified is not None:  # the Triton route: one store and one attention launch for every row
        kernels.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        u = meta.unified
        return kernels.unified_attention(q, key_cache, value_cache, u.block_tables, u.cu_seqlens_q, u.seq_lens, scale)
    nd = meta.num_decode
    query = q[:nd].contiguous()
    if meta.route is None:
        meta.route = kernels.route(query, k, v, key_cache, value_cache, meta.slot_mapping, meta.decode_block_tables,
                                   meta.decode_context_lens, meta.decode_max_context)
    meta.route.store(k, v, key_cache, value_cache, meta.slot_mapping)
    parts: list[torch.Tensor] = []
    if nd:
        parts.append(meta.route.decode(query, key_cache, value_cache, meta.decode_block_tables,
                                       meta.decode_context_lens, scale))
    if meta.prefill is not None:
        parts.append(prefill.prefill_attention(q[nd:], key_cache, value_cache, meta.prefill, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def register() -> str:
    """Register the attention function under `ATTENTION_NAME` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
