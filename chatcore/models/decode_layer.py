"""A decoder layer's few-row bfloat16 step as a handful of C calls: one to four chats decoding on the CPU.

Through transformers' modules one row of a Llama decoder layer is ~45 torch ops around seven
linears: for SmolLM2-135M ~1,300 dispatches of several microseconds each per token, while its
weights stream in ~11 ms. `use_few_row_layers` gives each decoder layer of the Llama family
(`LAYERS`) a forward that, for a step of at most `cpu_linear.MAX_ROWS` bfloat16 rows carrying
chatcore's step metadata, runs the layer as nine C calls around the paged attention:

    RMSNorm -> q|k|v (one linear over the three weights side by side) -> RoPE on q and k in place
    -> attention (`paged_attention.attend`) -> o_proj + residual -> RMSNorm -> gate|up (one
    linear) -> SiLU(gate) * up -> down_proj + residual

Every other step (more rows, or no step metadata, as in the load-time probe) runs the modules'
forward. Each C step rounds where torch rounds (kernels/cpu_pointwise.py), so the layer computes
what the modules compute with the few-row linear, but for the last bit of RMSNorm's sum and of
`expf`; the pointwise kernels are checked against the modules themselves at load, so a module
whose code changes is not replaced.

Invariant: a fused weight is its modules' few-row copies (kernels/cpu_linear.py's layout)
concatenated, and those copies are dropped: q, k, v, gate and up then multiply by oneDNN's packed
copy alone, as every step of more rows does, and the model's memory does not grow.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from chatcore.kernels import cpu_linear, cpu_pointwise
from chatcore.models import paged_attention
from chatcore.models.weight_layout import PackedLinear

LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
TOLERANCE = 2.0 ** -7  # relative: one step of bfloat16's 8-bit significand
_PROBE_ROWS = 3


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """One layer's concatenated few-row weights and the shapes its C step needs."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    scale: float


class FewRowLayer(torch.nn.Module):
    """The mixin `use_few_row_layers` puts in front of a decoder layer's class."""

    chatcore_fused: FusedLayer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        step = kwargs.get("chatcore_step")
        if step is None or hidden_states.dtype != torch.bfloat16 \
                or hidden_states.numel() > cpu_linear.MAX_ROWS * hidden_states.shape[-1]:
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[no-any-return]
        cos, sin = kwargs["position_embeddings"]
        return self._few_rows(hidden_states, cos, sin, step)

    def _few_rows(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  step: paged_attention.StepMeta) -> torch.Tensor:
        fused = self.chatcore_fused
        attention, mlp = self.self_attn, self.mlp
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        rows = x.shape[0]
        q_size, kv_size = fused.heads * fused.head_dim, fused.kv_heads * fused.head_dim
        h = cpu_pointwise.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.variance_epsilon)
        qkv = cpu_linear.linear(h, fused.qkv, q_size + 2 * kv_size, fused.qkv_bias)
        cpu_pointwise.rope_(qkv, cos.reshape(rows, -1), sin.reshape(rows, -1), fused.heads + fused.kv_heads,
                            fused.head_dim)
        out = paged_attention.attend(
            attention.layer_idx,
            qkv[:, :q_size].view(rows, fused.heads, fused.head_dim),
            qkv[:, q_size:q_size + kv_size].view(rows, fused.kv_heads, fused.head_dim),
            qkv[:, q_size + kv_size:].view(rows, fused.kv_heads, fused.head_dim),
            fused.scale, step)
        o_proj = attention.o_proj
        x = cpu_linear.linear(out.reshape(rows, q_size), o_proj.few_rows, o_proj.out_features, o_proj.bias,
                              residual=x)
        norm = self.post_attention_layernorm
        gate_up = cpu_linear.linear(cpu_pointwise.rms_norm(x, norm.weight, norm.variance_epsilon), fused.gate_up,
                                    2 * fused.intermediate, fused.gate_up_bias)
        down = mlp.down_proj
        x = cpu_linear.linear(cpu_pointwise.silu_mul(gate_up), down.few_rows, down.out_features, down.bias,
                              residual=x)
        return x.view(hidden_states.shape)


@functools.cache
def _few_row_class(base: type) -> type:
    return type(f"FewRow{base.__name__}", (FewRowLayer, base), {})


def use_few_row_layers(model: Any) -> int:
    """Give every decoder layer that qualifies the few-row C step; returns how many got it.

    A layer qualifies when its class is in `LAYERS`, its norms in `NORMS`, its MLP's activation is
    SiLU, and all seven linears are packed bfloat16 with few-row copies (weight_layout.py) whose
    output sizes fill whole groups of the kernel's layout (so copies concatenate). None does unless
    the pointwise kernels agree with the first layer's modules on a probe.
    """
    layers = list(getattr(getattr(model, "model", None), "layers", None) or ())
    if not layers or not cpu_pointwise.available():
        return 0
    qualified = [layer for layer in layers if _qualifies(layer)]
    if not qualified or not _pointwise_matches(qualified[0], model):
        return 0
    for layer in qualified:
        layer.chatcore_fused = _fuse(layer)
        layer.__class__ = _few_row_class(type(layer))
    return len(qualified)


def _qualifies(layer: torch.nn.Module) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in LAYERS or attention is None or mlp is None:
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if any(type(norm).__name__ not in NORMS or norm.weight.dtype != torch.bfloat16 for norm in norms):
        return False
    if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
        return False
    linears = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(linear, PackedLinear) and linear.few_rows is not None for linear in linears):
        return False
    group = linears[0].few_rows.shape[2]
    head_dim = getattr(attention, "head_dim", 0)
    return all(linear.out_features % group == 0 for linear in linears[:3] + linears[4:6]) \
        and 0 < head_dim <= cpu_pointwise.MAX_HEAD_DIM and head_dim % 2 == 0 \
        and attention.q_proj.out_features % head_dim == 0 and attention.k_proj.out_features % head_dim == 0


def _fuse(layer: torch.nn.Module) -> FusedLayer:
    """The layer's concatenated few-row weights; the modules' own few-row copies are dropped."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up = (mlp.gate_proj, mlp.up_proj)
    fused = FusedLayer(
        qkv=torch.cat([linear.few_rows for linear in qkv]),
        qkv_bias=_biases(qkv),
        gate_up=torch.cat([linear.few_rows for linear in gate_up]),
        gate_up_bias=_biases(gate_up),
        heads=attention.q_proj.out_features // attention.head_dim,
        kv_heads=attention.k_proj.out_features // attention.head_dim,
        head_dim=attention.head_dim,
        intermediate=mlp.gate_proj.out_features,
        scale=float(attention.scaling),
    )
    for linear in (*qkv, *gate_up):
        linear.few_rows = None
    return fused


def _biases(linears: tuple[PackedLinear, ...]) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([torch.zeros(linear.out_features, dtype=torch.bfloat16) if linear.bias is None
                      else linear.bias.detach().to(torch.bfloat16) for linear in linears])


def _pointwise_matches(layer: torch.nn.Module, model: Any) -> bool:
    """Whether RMSNorm, RoPE and SiLU * up in C agree with this layer's modules on a random probe."""
    generator = torch.Generator().manual_seed(0)
    attention, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
    hidden = norm.weight.shape[0]
    with torch.inference_mode():
        x = torch.randn(1, _PROBE_ROWS, hidden, generator=generator).to(torch.bfloat16)
        if not _close(cpu_pointwise.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)):
            return False
        width = 2 * mlp.gate_proj.out_features
        gate_up = torch.randn(_PROBE_ROWS, width, generator=generator).to(torch.bfloat16)
        gate, up = gate_up.split(width // 2, dim=-1)
        if not _close(cpu_pointwise.silu_mul(gate_up), mlp.act_fn(gate) * up):
            return False
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        apply = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
        if rotary is None or apply is None:
            return False
        cos, sin = rotary(x, torch.arange(7, 7 + _PROBE_ROWS).unsqueeze(0))
        heads = 3
        q = torch.randn(1, heads, _PROBE_ROWS, attention.head_dim, generator=generator).to(torch.bfloat16)
        expected, _ = apply(q, q, cos, sin)
        rows = q[0].transpose(0, 1).reshape(_PROBE_ROWS, -1).contiguous()
        ours = cpu_pointwise.rope_(rows, cos[0].contiguous(), sin[0].contiguous(), heads, attention.head_dim)
        return _close(ours.view(_PROBE_ROWS, heads, -1).transpose(0, 1).unsqueeze(0), expected)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.shape == theirs.shape and torch.allclose(ours.float(), theirs.float(), rtol=TOLERANCE, atol=1e-6)
