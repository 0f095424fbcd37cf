"""Opt-in int8 weight-only linears (`weights=int8`): torchao quantizes, aten's CPU kernel multiplies.

**The values.** Each linear of the decoder layers (attention and MLP projections, 210 in SmolLM2)
becomes int8 with one symmetric scale per output row: torchao's `Int8WeightOnlyConfig` (its
`Int8Tensor`: `qdata`, `scale`), under torchao's AWQ (`torchao.prototype.awq`), which also gives each
linear a per-input-channel scale (`act_pre_scale`) chosen on calibration text so that the int8
product best reproduces the float32 one. Plain per-row int8 agreed with the float32 model on 95-96%
of greedy tokens (teacher-forced, 768 tokens of the fidelity prompts), below the 97% asked; with AWQ
97.3-97.7%, as close as bfloat16 weights come (97.7%); per-group scales (groups of 64) did as well,
but the kernel below takes one scale per row. The LM head keeps the model's dtype and layout (a tied
head stays tied to the embedding).

**Found once.** The search runs on a float32 copy of the weights (`find_int8`, 10-30 s on two cores,
minutes on a busy machine) and its result is kept in `CACHE_DIR/int8/` (`cache_file`: named by the
model's fingerprint, torchao's version, the search and the calibration text), so later loads, in
any dtype, take a second or two.

**The product.** torchao's own eager linear dequantizes the whole weight to the activations' dtype on
every call and leaves the fusion to `torch.compile`: it reads and writes 5 bytes a weight instead of
1. The engine runs eagerly, so `Int8Linear` hands the int8 values and scales to
`aten._weight_int8pack_mm`, the CPU kernel that reads the int8 weight once and accumulates in float32
(inductor lowers torchao's pattern to the same kernel). Its float32 path is scalar here (3.4 GB/s,
against 34 GB/s in bfloat16), so in a float32 model the scaled input is rounded to bfloat16 for it
and the product comes back as float32 (the timings: docs/measurements.md, "int8 linears").

Rows past `KERNEL_MAX_ROWS` (a prefill chunk, a large batch) take another path: the kernel works a
row at a time, so for them the weight is dequantized to the model's dtype for one GEMM (a copy per
call, 2-4 bytes a weight: transient, never kept). A cold 189-token prompt's first token took 324-440
ms with the kernel for every row, against 69-98 ms with full weights.

**Loading** (`loader.py`): quantizing runs first, on the weights as loaded; the layout passes of
`weight_layout.py` then skip every `Int8Linear` (its weight is a torchao tensor, not a plain one) and
still re-store or pack what stays in full precision. Int8 weights compute other KV than full ones:
the loaded model's fingerprint says which (`loader.weights_fingerprint`).

Where it cannot run it is refused in one line (`UnsupportedWeights`), never ignored: on a device
other than the CPU (the kernel is the CPU's), and without torchao installed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatcore.models.errors import ModelUnavailable

WEIGHTS = ("auto", "full", "gguf", "int8")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_ALIGNMENT = 64  # bytes: where aten._weight_int8pack_mm's int8 operand must start
# The kernel is a matrix-vector product per row: its time grows with the rows, and past about 32 a
# dequantized copy of the weight and one GEMM win (1536x576 in bfloat16, 2 threads: 1 row 0.037 ms
# against 0.35; 32 rows 0.40 against 0.45; 64 rows 0.67 against 0.64; 189 rows 2.65 against 0.76).
KERNEL_MAX_ROWS = 32


class UnsupportedWeights(ModelUnavailable):
    """`weights=int8` where it cannot run; the message says why, in one line."""


def check_weights(weights: str, device: torch.device) -> None:
    """Raise `UnsupportedWeights` when `weights` cannot run on `device` (before any weight is read)."""
    if weights in ("auto", "full"):  # auto falls back to full where a GGUF's blocks cannot serve
        return
    if weights not in WEIGHTS:
        raise UnsupportedWeights(f"weights={weights}: choose one of {', '.join(WEIGHTS)}")
    if weights == "gguf":
        if device.type != "cpu":
            raise UnsupportedWeights(f"weights=gguf runs on the CPU only (its kernels are the CPU's, "
                                     f"kernels/cpu_quant.c); device {device} was asked for: use weights=full there")
        return
    if device.type != "cpu":
        raise UnsupportedWeights(f"weights=int8 runs on the CPU only (its kernel, aten._weight_int8pack_mm, is the "
                                 f"CPU's here); device {device} was asked for: use weights=full there")
    if not torch.ops.aten._weight_int8pack_mm.default.has_kernel_for_dispatch_key("CPU"):
        raise UnsupportedWeights(f"weights=int8: this torch ({torch.__version__}) has no CPU kernel for "
                                 "aten._weight_int8pack_mm")
    _torchao()


class Int8Linear(torch.nn.Linear):
    """An `nn.Linear` whose weight is torchao's `Int8Tensor` (int8 `qdata` [out, in], one scale per
    row, and AWQ's per-input-channel `act_pre_scale`), multiplied by `aten._weight_int8pack_mm` in
    `kernel_dtype`: the input times `int8_pre_scale` (in the model's dtype), rounded to `kernel_dtype`,
    times the int8 values, times `int8_scales` (in `kernel_dtype`); more than `KERNEL_MAX_ROWS` rows
    multiply a dequantized copy instead. `weight` keeps the model's dtype and shape for whoever reads
    them."""

    int8_scales: torch.Tensor
    int8_pre_scale: torch.Tensor
    kernel_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) * self.int8_pre_scale
        if rows.shape[0] > KERNEL_MAX_ROWS:  # a prefill: the weight dequantized, one GEMM in the model's dtype
            weight = self.weight.qdata.to(x.dtype) * self.int8_scales.to(x.dtype)[:, None]
            y = torch.nn.functional.linear(rows, weight)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(self.kernel_dtype), self.weight.qdata, self.int8_scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


# Calibration text for AWQ: ordinary chats in the model's template (about 280 tokens). Nothing of
# the tests' prompts is here, so the fidelity test measures prompts the scales never saw.
CALIBRATION = (
    ({"role": "user", "content": "Can you explain how a bicycle's gears make climbing hills easier?"},
     {"role": "assistant", "content": "Sure. Lower gears turn the rear wheel less for each turn of the pedals, so "
      "each push needs less force, though you pedal more often. On a steep hill that trade is worth it: your legs "
      "stay in a comfortable range while the bike moves slowly but steadily upward."}),
    ({"role": "system", "content": "You are a concise assistant for a small library."},
     {"role": "user", "content": "What are your opening hours, and can I renew a book by phone?"},
     {"role": "assistant", "content": "We are open from 9 am to 6 pm on weekdays and from 10 am to 2 pm on "
      "Saturdays. Yes, you can renew up to three books by phone; have your card number ready."}),
    ({"role": "user", "content": "Write a short Python function that returns the largest number in a list."},
     {"role": "assistant", "content": "def largest(numbers):\n    if not numbers:\n        raise ValueError('empty "
      "list')\n    best = numbers[0]\n    for n in numbers[1:]:\n        if n > best:\n            best = n\n"
      "    return best"}),
)
AWQ_SCALE_OPTIONS = 10  # torchao's search grid for each linear's exponent (its default is 20: twice the time)


CACHE_FORMAT = 1  # bump when what is cached, or how it is found, changes


def cache_file(cache_dir: Path, fingerprint: str) -> Path:
    """Where the int8 weights of the model with `fingerprint` are kept once found: named by a digest of
    the fingerprint, torchao's version, the search grid, the calibration text and `CACHE_FORMAT`."""
    from importlib.metadata import version

    key = json.dumps([fingerprint, version("torchao"), AWQ_SCALE_OPTIONS, CALIBRATION, CACHE_FORMAT])
    return cache_dir / "int8" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def quantize_int8(model: Any, path: Path, tokenizer: Any, cache: Path | None = None) -> int:
    """Quantize the decoder layers' linears of `model` (on the CPU, any dtype) in place; returns how many.

    The int8 values and scales come from `cache` when it exists, else from `find_int8` (then written
    there, atomically); they replace the weights of `model`, whose dtype they take."""
    found = _read(cache) if cache is not None and cache.is_file() else None
    if found is None:
        found = find_int8(path, tokenizer)
        if cache is not None:
            _write(cache, found)
    for name, tensors in found.items():
        _install(model.get_submodule(name), *tensors)
    return len(found)


def find_int8(path: Path, tokenizer: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per decoder linear (by module name): its int8 values [out, in], row scales [out, 1] and AWQ's
    input scales [in] (the activations are multiplied by them), all float32 but the int8 values.

    torchao's AWQ (`torchao.prototype.awq`) over `Int8WeightOnlyConfig`, run on a float32 copy of the
    weights loaded from `path` (with SDPA attention) over `CALIBRATION`: per linear, the input scale,
    among `AWQ_SCALE_OPTIONS` powers of the inputs' mean magnitudes, whose int8 weight best reproduces
    the float32 output. About 10-30 s on two cores, hence the cache."""
    from transformers import AutoModelForCausalLM

    torchao = _torchao()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    head = reference.get_output_embeddings()
    names = {name for name, m in reference.named_modules() if type(m) is torch.nn.Linear and m is not head}
    base = torchao.Int8WeightOnlyConfig(set_inductor_config=False)  # no global inductor settings
    torchao.quantize_(reference, torchao.AWQConfig(base, step="prepare", scale_search_space_size=AWQ_SCALE_OPTIONS),
                      filter_fn=lambda _module, name: name in names)
    with torch.inference_mode():
        for chat in CALIBRATION:
            ids = tokenizer.apply_chat_template(list(chat), tokenize=True, return_dict=False)
            reference(torch.tensor([list(ids)]))
    torchao.quantize_(reference, torchao.AWQConfig(base, step="convert", scale_search_space_size=AWQ_SCALE_OPTIONS),
                      filter_fn=lambda module, _name: isinstance(module, torchao.AWQObservedLinear))
    found = {}
    for name in sorted(names):
        weight = reference.get_submodule(name).weight
        if not hasattr(weight, "qdata") or weight.act_pre_scale is None:
            raise UnsupportedWeights(f"weights=int8: torchao left {name} as {type(weight).__name__}")
        found[name] = (weight.qdata, weight.scale.float(), weight.act_pre_scale.reshape(-1).float())
    return found


def _read(cache: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        flat = load_file(cache)
    except (OSError, SafetensorError):
        return None  # unreadable: found again, and rewritten
    names = sorted({key.rsplit(".", 1)[0] for key in flat})
    return {name: (flat[f"{name}.qdata"], flat[f"{name}.scale"], flat[f"{name}.pre_scale"]) for name in names}


def _write(cache: Path, found: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    flat = {f"{name}.{part}": tensor.contiguous() for name, tensors in found.items()
            for part, tensor in zip(("qdata", "scale", "pre_scale"), tensors, strict=True)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    save_file(flat, staging)
    os.replace(staging, cache)  # whole or absent: a reader never sees half a file


def _install(module: torch.nn.Module, qdata: torch.Tensor, scale: torch.Tensor, pre_scale: torch.Tensor) -> None:
    """Make `module` (an `nn.Linear` of the served model) an `Int8Linear` over these int8 values."""
    if type(module) is not torch.nn.Linear or tuple(qdata.shape) != tuple(module.weight.shape):
        raise UnsupportedWeights(f"weights=int8: cannot quantize {type(module).__name__} {tuple(module.weight.shape)} "
                                 f"with int8 values of shape {tuple(qdata.shape)}")
    if qdata.data_ptr() % KERNEL_ALIGNMENT:
        # The kernel reads the int8 values with aligned loads: at a safetensors file's offsets (8-byte
        # aligned) it faulted. A copy comes from torch's allocator, which aligns to 64 bytes.
        qdata = qdata.clone()
    dtype = module.weight.dtype
    weight = _torchao().Int8Tensor(qdata, scale, [1, qdata.shape[1]], dtype, act_pre_scale=pre_scale)
    kernel = dtype if dtype in _KERNEL_DTYPES else torch.bfloat16
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.__class__ = Int8Linear
    module.kernel_dtype = kernel
    module.int8_scales = scale.reshape(-1).to(kernel).contiguous()
    module.int8_pre_scale = pre_scale.to(dtype).contiguous()


def is_plain(weight: torch.Tensor) -> bool:
    """Whether `weight` is a plain tensor (or parameter), not a tensor subclass such as torchao's."""
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class _Torchao:
    quantize_: Any
    Int8WeightOnlyConfig: Any
    AWQConfig: Any
    AWQObservedLinear: Any
    Int8Tensor: Any


def _torchao() -> _Torchao:
    """torchao's API, imported on first use (its import-time warnings: `chatcore/import_noise.py`)."""
    try:
        from torchao.prototype.awq import AWQConfig
        from torchao.prototype.awq.core import AWQObservedLinear
        from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise UnsupportedWeights(f"weights=int8 needs torchao (pip install 'torchao>=0.18'): {exc}") from None
    return _Torchao(quantize_, Int8WeightOnlyConfig, AWQConfig, AWQObservedLinear, Int8Tensor)
