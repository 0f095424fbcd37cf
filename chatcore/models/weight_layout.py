"""Where the CPU stores a linear layer's weight, in the layout its GEMM reads fastest.

float32: `nn.Linear` computes `x @ W.T` with `W` of shape [out, in]. On the CPU, with `W`
row-major, a float32 GEMM over a decode step's few rows reads the weights at under half the
memory bandwidth; with `W.T` contiguous (`W` a transposed view of it) the same call reads them at
about the full bandwidth, because each row of the product walks the weights in storage order.
Measured on the 2-core Xeon (AVX-512, no bf16), 2 threads, the body's 210 linears of
SmolLM2-135M: 16 rows 78.6 -> 36.8 ms, 32 rows 91 -> 48 ms, 64 rows 78 -> 74 ms, 512 rows
390 -> 388 ms; the tied LM head at 16 rows 20.8 -> 10.3 ms; the products were bitwise equal.
The shape, the values and the module code stay as they are: only the storage order changes.
float16 weights run 14x slower in that order, so they stay as loaded.

Int8 linears (`weights=int8`, `int8_weights.py`) are quantized before these passes, which skip
them (their weights are torchao tensors, whose int8 values the int8 kernel reads as they are).

bfloat16: `F.linear` hands the weight to oneDNN, which re-lays it out into its blocked format on
every call. Packing it once (`mkldnn._reorder_linear_weight`) and calling the packed GEMM gives
the same bits and skips that work: 150 576x1536 linears, 2 threads, 1.3-1.6x faster at 1 to 512
rows on a Xeon with AMX and on an AMD EPYC with avx512_bf16; the LM head 1.5-2x at 1 to 64 rows.
Up to `cpu_linear.MAX_ROWS` rows (a decode step of a few chats) the C few-row linear is faster
still (kernels/cpu_linear.py): where the CPU has AVX512-BF16, and where a second copy of the
linears' weights takes at most `FEW_ROWS_MEMORY_SHARE` of the machine's memory, each packed
linear also keeps its weight in that kernel's layout. Its outputs may differ from oneDNN's in the
last bit (another summation order), so a sequence's logits can depend on how many rows its step
had; greedy float32 output, which does not use either, stays exact.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from chatcore.kernels import cpu_linear
from chatcore.models.int8_weights import is_plain

PACK_ROWS_HINT = 64  # the row count oneDNN tunes the packed layout for; it serves every count
FEW_ROWS_MEMORY_SHARE = 1 / 16  # the most of the machine's memory the few-row kernel's copies may take
_CHECK_ROWS = (1, 5, 64)


def store_linears_transposed(model: Any) -> int:
    """Re-store every float32 `nn.Linear` weight of a CPU model column-major; returns how many moved.

    A weight tied to another module (the LM head and the embedding) is one parameter: it moves
    once, and both modules see the new storage.
    """
    moved = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if not is_plain(weight) or weight.device.type != "cpu" or weight.dtype != torch.float32 \
                or not weight.is_contiguous():
            continue  # an int8 linear's weight (a torchao tensor) is laid out by torchao
        weight.data = weight.data.t().contiguous().t()
        moved += 1
    return moved


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward multiplies by `packed`, its weight in oneDNN's layout.

    `weight` keeps its shape and dtype for whoever reads them. A weight no other module shares
    gives up its values (a zero-stride stand-in of the same shape): the packed copy is the only
    one, so the model's memory does not double. A shared weight (an LM head tied to the
    embedding) keeps its values for the other module.
    """

    packed: torch.Tensor
    few_rows: torch.Tensor | None  # the weight in kernels/cpu_linear.py's layout, for up to MAX_ROWS rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and x.numel() <= cpu_linear.MAX_ROWS * self.in_features:
            return cpu_linear.linear(x, self.few_rows, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_bfloat16_linears(model: Any) -> int:
    """Pack every bfloat16 `nn.Linear` of a CPU model for oneDNN; returns how many were packed.

    Nothing is packed where oneDNN has no bfloat16 GEMM, or where the packed product differs
    from `F.linear`'s in any bit on a probe (greedy output must not depend on the layout).
    """
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and is_plain(m.weight)
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16]
    if not linears or not _packed_gemm_matches(linears[0].weight):
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    few_rows = _few_rows_fit(linears)
    for module in linears:
        weight = module.weight
        module.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        module.few_rows = cpu_linear.lay_out(weight) if few_rows else None
        module.__class__ = PackedLinear
        if owners[id(weight)] == 1:
            weight.data = torch.zeros((), dtype=weight.dtype).expand(weight.shape)
    return len(linears)


def _few_rows_fit(linears: list[torch.nn.Linear]) -> bool:
    """Whether the few-row kernel runs here and a second copy of these weights fits its memory share."""
    copy_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return cpu_linear.available() and copy_bytes <= memory * FEW_ROWS_MEMORY_SHARE


def _packed_gemm_matches(weight: torch.Tensor) -> bool:
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        for rows in _CHECK_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
            if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                               F.linear(x, weight)):
                return False
    return True
