"""A Llama-family decoder layer's bfloat16 CPU step as a handful of calls: fused projections and C pointwise steps.

Through transformers' modules a decoder layer is ~45 torch ops around seven linears. At a decode
step's few rows each op is a dispatch of several microseconds (for SmolLM2-135M ~1,300 a token,
against ~11 ms for its weights to stream); at many rows each is a pass over memory. For the Llama
family (`LAYERS`) in bfloat16 on the CPU, `fuse_layers` (called before the linears are packed,
weight_layout.py) gives each decoder layer:

* one linear for q, k and v (`self_attn.qkv_proj`) and one for gate and up (`mlp.gate_up_proj`),
  their weights side by side; q_proj, k_proj, v_proj, gate_proj and up_proj become `Projection`s,
  column ranges of the fused product, so the modules' own forward still computes the same thing;
* a forward that, for every step carrying chatcore's step metadata, runs

      RMSNorm -> q|k|v -> RoPE on q and k in place -> attention (`paged_attention.attend`)
      -> o_proj + residual -> RMSNorm -> gate|up -> SiLU(gate) * up -> down_proj + residual

  with the pointwise steps in C (kernels/cpu_pointwise.py) and, up to `cpu_linear.MAX_ROWS` rows,
  the residual added inside the few-row linear. Without the metadata (no step: nothing in the
  engine) the modules' forward runs.

Each C step rounds where torch rounds, so a layer computes what its modules compute but for the
last bit of RMSNorm's sum and of `expf` (and the linears' own summation orders, weight_layout.py);
the pointwise kernels are checked against the first layer's modules at load, so a module whose
code changes in another transformers is not replaced. float32 models, whose greedy output must
equal transformers', int8 linears and a GGUF's blocks (`gguf_weights.QuantLinear`) are left as they
are: GGUF blocks serve in float32 activations under `dtype=auto`, where this layer never runs, and
with bfloat16 asked for, each projection runs `cpu_quant.linear` through the modules' forward.

Invariant: each weight is held once. A fused linear owns the concatenated weight and the
originals are dropped; the packing pass then packs the fused linears like any other.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from chatcore.kernels import cpu_linear, cpu_pointwise
from chatcore.models import paged_attention
from chatcore.models.int8_weights import is_plain

LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
TOLERANCE = 2.0 ** -7  # relative: one step of bfloat16's 8-bit significand
_PROBE_ROWS = 3


class Projection(torch.nn.Module):
    """Columns [start, stop) of a fused linear's product: what one of the original projections computed."""

    def __init__(self, fused: torch.nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.fused = fused
        self.start, self.stop = start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.stop]


class FusedLayer(torch.nn.Module):
    """The mixin `fuse_layers` puts in front of a decoder layer's class."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        step = kwargs.get("chatcore_step")
        if step is None or hidden_states.dtype != torch.bfloat16:
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[no-any-return]
        cos, sin = kwargs["position_embeddings"]
        return self._fused(hidden_states, cos, sin, step)

    def _fused(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               step: paged_attention.StepMeta) -> torch.Tensor:
        attention, mlp = self.self_attn, self.mlp
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        rows = x.shape[0]
        heads, kv_heads = attention.q_proj.out_features // attention.head_dim, \
            attention.k_proj.out_features // attention.head_dim
        q_size, kv_size = attention.q_proj.out_features, attention.k_proj.out_features
        norm = self.input_layernorm
        qkv = attention.qkv_proj(cpu_pointwise.rms_norm(x, norm.weight, norm.variance_epsilon))
        cpu_pointwise.rope_(qkv, cos.reshape(rows, -1), sin.reshape(rows, -1), heads + kv_heads, attention.head_dim)
        out = paged_attention.attend(
            attention.layer_idx,
            qkv[:, :q_size].view(rows, heads, attention.head_dim),
            qkv[:, q_size:q_size + kv_size].view(rows, kv_heads, attention.head_dim),
            qkv[:, q_size + kv_size:].view(rows, kv_heads, attention.head_dim),
            attention.scaling, step)
        x = _plus_residual(attention.o_proj, out.reshape(rows, q_size), x)
        norm = self.post_attention_layernorm
        gate_up = mlp.gate_up_proj(cpu_pointwise.rms_norm(x, norm.weight, norm.variance_epsilon))
        x = _plus_residual(mlp.down_proj, cpu_pointwise.silu_mul(gate_up), x)
        return x.view(hidden_states.shape)


def _plus_residual(linear: torch.nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`, rounded as torch rounds: inside the few-row C linear where it serves."""
    few_rows = getattr(linear, "few_rows", None)
    if few_rows is not None and x.shape[0] <= cpu_linear.MAX_ROWS:
        return cpu_linear.linear(x, few_rows, linear.out_features, linear.bias, residual=residual)
    return linear(x).add_(residual)


@functools.cache
def _fused_class(base: type) -> type:
    return type(f"Fused{base.__name__}", (FusedLayer, base), {})


def fuse_layers(model: Any) -> int:
    """Fuse every decoder layer that qualifies; returns how many were. Call before packing the linears.

    A layer qualifies when its class is in `LAYERS`, its norms in `NORMS` with bfloat16 weights, its
    MLP's activation is SiLU, and its seven projections are plain bfloat16 CPU `nn.Linear`s. None is
    fused unless the pointwise kernels agree with the first such layer's modules on a probe.
    """
    layers = list(getattr(getattr(model, "model", None), "layers", None) or ())
    qualified = [layer for layer in layers if _qualifies(layer)]
    if not qualified or not cpu_pointwise.available() or not _pointwise_matches(qualified[0], model):
        return 0
    for layer in qualified:
        _fuse_projections(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        _fuse_projections(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        layer.__class__ = _fused_class(type(layer))
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
    if not all(type(linear) is torch.nn.Linear and is_plain(linear.weight) and linear.weight.device.type == "cpu"
               and linear.weight.dtype == torch.bfloat16 for linear in linears):
        return False
    head_dim = getattr(attention, "head_dim", 0)
    return 0 < head_dim <= cpu_pointwise.MAX_HEAD_DIM and head_dim % 2 == 0 \
        and attention.q_proj.out_features % head_dim == 0 and attention.k_proj.out_features % head_dim == 0 \
        and attention.v_proj.out_features == attention.k_proj.out_features


def _fuse_projections(parent: torch.nn.Module, name: str, parts: tuple[str, ...]) -> None:
    """One linear for `parts` of `parent`, their weights (and biases) side by side; each part becomes
    a `Projection` of it."""
    linears = [getattr(parent, part) for part in parts]
    with_bias = any(linear.bias is not None for linear in linears)
    fused = torch.nn.Linear(linears[0].in_features, sum(linear.out_features for linear in linears), bias=with_bias,
                            dtype=torch.bfloat16, device="cpu")
    with torch.no_grad():
        fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
        if with_bias:
            fused.bias.copy_(torch.cat([torch.zeros(linear.out_features, dtype=torch.bfloat16)
                                        if linear.bias is None else linear.bias for linear in linears]))
    fused.requires_grad_(False)
    setattr(parent, name, fused)
    start = 0
    for part, linear in zip(parts, linears):
        setattr(parent, part, Projection(fused, start, start + linear.out_features))
        start += linear.out_features


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
