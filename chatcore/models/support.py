"""What the paged attention can serve, checked once at load by probing the model's own forward.

The paged path reproduces a layer exactly when the layer's attention is plain causal attention
over the rotated query, key and value that the model's modules hand to the `AttentionInterface`
function, with the `scaling` they pass: everything before that call (projections, RoPE, q/k
norms) and after it (output projection, final norm, logit scaling and softcapping in the
top-level forward) runs in the model's own modules. At load, one forward over a few tokens goes
through `AttentionProbe` instead of the paged function; it records each call, and `check` turns
what it saw into an `AttentionProfile` or refuses the model with one line (`UnsupportedModel`):

* unknown layout: a layer that never calls the attention function (ALiBi models such as Bloom,
  state-space layers), a call without an integer `layer_idx`, a layer called twice, a forward
  without `logits_to_keep`, or a forward that fails;
* query, key and value head sizes that differ (multi-head latent attention), key and value head
  counts that differ, or query heads that are not a multiple of the KV heads;
* an attention logit softcap (`softcap`, Gemma 2) or attention sinks (`s_aux`, gpt-oss): the
  paged kernels compute neither;
* any other argument the function is given with a value (not None or False) that it does not
  know, since it would ignore it.

A sliding window is served by capping the context at the smallest window any layer uses: a
query at position p sees keys after p - window, so with at most `window` tokens in a sequence
the window masks nothing and plain causal attention is exact (`AttentionProfile.max_context`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from chatcore.models.errors import UnsupportedModel

PROBE_TOKENS = 4
HARMLESS_ARGUMENTS = frozenset({"scaling", "dropout", "position_ids", "use_cache", "cache_position",
                                "output_attentions", "output_router_logits", "is_causal"})
REFUSED_ARGUMENTS = {
    "softcap": "an attention logit softcap",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}


@dataclass(frozen=True)
class AttentionCall:
    layer_idx: Any
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    arguments: dict[str, Any]


@dataclass
class AttentionProbe:
    """Passed as `chatcore_probe`: records each attention call and answers with plain causal SDPA."""

    calls: list[AttentionCall] = field(default_factory=list)

    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               arguments: dict[str, Any]) -> tuple[torch.Tensor, None]:
        self.calls.append(AttentionCall(getattr(module, "layer_idx", None), tuple(query.shape), tuple(key.shape),
                                        tuple(value.shape), dict(arguments)))
        heads, kv_heads = query.shape[1], key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=arguments.get("scaling"),
                                             enable_gqa=heads != kv_heads)
        return out.transpose(1, 2), None


@dataclass(frozen=True)
class AttentionProfile:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    sliding_window: int | None


def probe(model: Any) -> AttentionProbe:
    """One forward of `PROBE_TOKENS` tokens through the model's top-level forward, recorded."""
    recorder = AttentionProbe()
    parameter = next(model.parameters())
    ids = torch.arange(PROBE_TOKENS, device=parameter.device).unsqueeze(0) % model.config.vocab_size
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=ids.device).unsqueeze(0),
                  use_cache=False, logits_to_keep=torch.tensor([PROBE_TOKENS - 1], device=ids.device),
                  chatcore_probe=recorder)
    except Exception as exc:  # any failure means a layout we do not know
        _check_shapes(recorder.calls)  # the calls recorded before the failure may say why
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UnsupportedModel(f"its forward fails under the paged attention ({type(exc).__name__}: {first})") from exc
    return recorder


def check(model: Any, recorder: AttentionProbe, max_position_embeddings: int) -> AttentionProfile:
    """The profile the engine sizes its cache by, or `UnsupportedModel` naming the first problem."""
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        raise UnsupportedModel(f"unknown layout: {type(model).__name__}.forward takes no logits_to_keep")
    layers = model.config.num_hidden_layers
    seen = [c.layer_idx for c in recorder.calls]
    if not all(isinstance(i, int) for i in seen) or sorted(seen) != list(range(layers)):
        raise UnsupportedModel(f"unknown layout: {layers} layers, but the attention function was called for layers "
                               f"{seen} (attention outside AttentionInterface, or layers without an integer layer_idx)")
    _check_shapes(recorder.calls)
    windows = [_check_arguments(call) for call in recorder.calls]
    window = min((w for w in windows if w is not None), default=None)
    first = recorder.calls[0]
    return AttentionProfile(num_heads=first.query_shape[1], num_kv_heads=first.key_shape[1],
                            head_dim=first.query_shape[-1],
                            max_context=min(max_position_embeddings, window or max_position_embeddings),
                            sliding_window=window)


def _check_shapes(calls: list[AttentionCall]) -> None:
    for call in calls:
        q, k, v = call.query_shape, call.key_shape, call.value_shape
        if not q[-1] == k[-1] == v[-1]:
            raise UnsupportedModel(f"unknown layout: layer {call.layer_idx} has query/key/value head sizes "
                                   f"{q[-1]}/{k[-1]}/{v[-1]} (the paged cache needs one)")
        if k[1] != v[1] or q[1] % k[1]:
            raise UnsupportedModel(f"unknown layout: layer {call.layer_idx} has {q[1]} query heads for {k[1]} key "
                                   f"and {v[1]} value heads")
        if (q[1], q[-1], k[1]) != (calls[0].query_shape[1], calls[0].query_shape[-1], calls[0].key_shape[1]):
            raise UnsupportedModel(f"unknown layout: layer {call.layer_idx}'s heads differ from layer 0's")


def _check_arguments(call: AttentionCall) -> int | None:
    """The layer's sliding window (None: none); refuses what the paged path would ignore."""
    window = None
    for name, value in call.arguments.items():
        if value is None or value is False or name in HARMLESS_ARGUMENTS:
            continue
        if name in REFUSED_ARGUMENTS:
            raise UnsupportedModel(f"layer {call.layer_idx} uses {REFUSED_ARGUMENTS[name]} ({name}), "
                                   "which the paged attention does not implement")
        if name == "sliding_window" and isinstance(value, int):
            window = value
            continue
        raise UnsupportedModel(f"unknown layout: layer {call.layer_idx}'s attention is given {name}="
                               f"{_describe(value)}, which the paged attention would ignore")
    if call.arguments.get("dropout"):
        raise UnsupportedModel(f"layer {call.layer_idx} applies attention dropout in inference")
    if call.arguments.get("is_causal") is False:
        raise UnsupportedModel(f"layer {call.layer_idx}'s attention is not causal")
    return window


def _describe(value: object) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:60]
