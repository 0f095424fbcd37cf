"""A GGUF model's own quantized blocks as its linears' weights (`weights=auto` on the CPU).

The model is built as for `weights=full` (transformers, from the converted folder or from the GGUF
itself); then each decoder linear and the LM head (tied to the embedding in the default model)
becomes a `QuantLinear` over `cpu_quant.lay_out` of its GGUF tensor's bytes, read from the file
memory-mapped (`gguf.GGUFReader`): Q4_0, Q4_1 and Q8_0 blocks (`cpu_quant.QTYPES`). The dequantized
copy transformers loaded for a replaced linear is dropped; the embedding keeps its dequantized table
(a token reads one row of it). Tensors of an unquantized type (F32, F16, BF16: norms, or a linear
stored unquantized) keep what transformers loaded.

**Rows.** GGUF stores a Llama q and k projection's rows permuted for its own RoPE (llama.cpp's
`convert_hf_to_gguf.py` interleaves each head's two halves); transformers' GGUF loader reverses it
on the dequantized rows (`LlamaTensorProcessor._reverse_permute_weights`), and `_unpermute` applies
the same row order to the raw block rows, which are independent of one another.

**Refused, in one line** (`UnsupportedGGUF`), before the model is served: a file GGUFReader cannot
parse (truncated, a corrupt header), or whose header's sizes its tensors or the memory do not bear out
(`gguf_check`); an architecture outside `ARCHITECTURES`; a linear's tensor in a
quantized type outside `cpu_quant.QTYPES` (say Q6_K); a tensor whose shape is not the linear's. Every
block is laid out before `load_model` returns, so a model is served whole or not at all.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatcore.kernels import cpu_quant
from chatcore.models.gguf_check import UnsupportedGGUF, architecture, check_declared, read_gguf

ARCHITECTURES = ("llama",)  # GGUF's `general.architecture` values whose blocks are served
_PERMUTED = {"llama": ("attn_q", "attn_k")}  # row-permuted projections, by GGUF architecture
UNQUANTIZED = frozenset({"F32", "F16", "BF16", "F64"})
FINGERPRINT_HEAD_BYTES = 1 << 20


class QuantLinear(torch.nn.Module):
    """A linear whose weight is GGUF blocks in `cpu_quant`'s layout: `cpu_quant.linear` computes it,
    in the input's dtype, accumulating in float32."""

    def __init__(self, quant: cpu_quant.QuantWeight, bias: torch.nn.Parameter | None) -> None:
        super().__init__()
        self.quant = quant
        self.in_features, self.out_features = quant.in_features, quant.out_features
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_quant.linear(x, self.quant, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.quant.qtype}"


def open_gguf(path: Path) -> Any:
    """The file's `GGUFReader` (memory-mapped), parsed whole, its architecture and its header's sizes
    checked (`gguf_check`)."""
    reader = read_gguf(path)
    arch = architecture(reader)
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUF(f"GGUF file {path}: architecture {arch} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    check_declared(reader, path)
    return reader


def check_quantization(reader: Any, path: Path) -> None:
    """Refuse a file with a linear's tensor in a quantized type `cpu_quant` does not serve."""
    for tensor in _linear_tensors(reader).values():
        qtype = tensor.tensor_type.name
        if qtype not in UNQUANTIZED and qtype not in cpu_quant.QTYPES:
            raise UnsupportedGGUF(f"GGUF file {path}: {tensor.name} is {qtype}, a quantization type not supported "
                                  f"(supported: {', '.join(sorted(cpu_quant.QTYPES))}; unquantized F32/F16/BF16)")


def _linear_tensors(reader: Any) -> dict[str, Any]:
    """The 2-D tensors by name, the embedding left out unless it is also the (tied) LM head."""
    tensors = {t.name: t for t in reader.tensors if len(t.shape) == 2}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return tensors


def gguf_fingerprint(path: Path) -> str:
    """A digest of the file's name, size and head (its header names every tensor, type and offset)."""
    digest = hashlib.sha256(path.name.encode())
    digest.update(path.stat().st_size.to_bytes(8, "little"))
    with path.open("rb") as fh:
        digest.update(fh.read(FINGERPRINT_HEAD_BYTES))
    return digest.hexdigest()[:32]


def install_blocks(model: Any, reader: Any, path: Path) -> int:
    """Replace `model`'s linears stored quantized in `reader` by `QuantLinear`s; returns how many.

    Every weight is laid out before any module is replaced: a refusal leaves `model` as it was."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = architecture(reader)
    ids = {name: key for key, name in MODEL_ARCH_NAMES.items()}
    names = get_tensor_name_map(ids[arch], model.config.num_hidden_layers)
    tensors = _linear_tensors(reader)
    replaced: dict[str, QuantLinear] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        stem = names.get_name(module_name)
        tensor = tensors.get(f"{stem}.weight") if stem else None
        if tensor is None and module is model.get_output_embeddings() and "output.weight" not in tensors:
            tensor = tensors.get("token_embd.weight")  # the LM head tied to the embedding
        if tensor is None or tensor.tensor_type.name in UNQUANTIZED:
            continue
        raw = _rows(tensor, module, path, _PERMUTED.get(arch, ()), model.config)
        quant = cpu_quant.lay_out(raw, tensor.tensor_type.name, module.out_features, module.in_features)
        replaced[module_name] = QuantLinear(quant, module.bias)
    for module_name, linear in replaced.items():
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
    return len(replaced)


def _rows(tensor: Any, module: torch.nn.Linear, path: Path, permuted: tuple[str, ...], config: Any) -> torch.Tensor:
    """The tensor's raw blocks as uint8 [out_features, bytes a row], in transformers' row order."""
    in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
    if (out_features, in_features) != (module.out_features, module.in_features):
        raise UnsupportedGGUF(f"GGUF file {path}: {tensor.name} is [{out_features}, {in_features}], its linear "
                              f"[{module.out_features}, {module.in_features}]")
    rows = np.asarray(tensor.data).reshape(out_features, -1)
    kind = tensor.name.split(".")[-2]
    if kind in permuted:
        heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
        rows = _unpermute(rows, heads)
    with warnings.catch_warnings():  # a read-only memory map: nothing writes to these bytes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' `_reverse_permute_weights` on whole rows: within each head, rows (2i, 2i+1) of
    GGUF's order are rows i and i + head_dim/2 of transformers'."""
    half = rows.shape[0] // heads // 2
    return np.ascontiguousarray(rows.reshape(heads, half, 2, -1).swapaxes(2, 1).reshape(rows.shape))
