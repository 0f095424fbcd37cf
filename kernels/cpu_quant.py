"""GGUF's quantized blocks as a linear's weight: a pure-torch stand-in for the C kernel.

This file implements the interface agreed for `kernels/cpu_quant.py` (the quantized kernel's
module) with torch ops only: `linear` dequantizes the whole weight to float32 and calls
`F.linear` (correct, slow). The kernel's own module replaces this file; nothing else lives here.

Block encodings (GGUF's, little-endian, 32 weights a block):
  Q4_0: fp16 d, 16 bytes of nibbles; w = (q - 8) * d
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = q * d + m
  Q8_0: fp16 d, 32 int8; w = q * d
Nibbles: byte j holds weight j in its low half and weight j + 16 in its high half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QTYPES: frozenset[str] = frozenset(_BLOCK_BYTES)


def block_bytes(qtype: str) -> int:
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"quantization type {qtype} is not supported (supported: {', '.join(sorted(QTYPES))})")
    return _BLOCK_BYTES[qtype]


@dataclass(frozen=True)
class QuantWeight:
    """One linear's weight [out_features, in_features]; here `data` is the GGUF bytes as they are."""

    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor

    def nbytes(self) -> int:
        return int(self.data.numel() * self.data.element_size())


def lay_out(raw: torch.Tensor, qtype: str, out_features: int, in_features: int) -> QuantWeight:
    size = block_bytes(qtype)
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
    expected = (out_features, in_features // BLOCK * size)
    if raw.dtype != torch.uint8 or tuple(raw.shape) != expected:
        raise ValueError(f"{qtype} weight [{out_features}, {in_features}] needs uint8 bytes of shape {expected}, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return QuantWeight(qtype, out_features, in_features, raw.contiguous())


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale at byte `start` of each block, as float32 [..., 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    blocks = weight.data.view(weight.out_features, weight.in_features // BLOCK, block_bytes(weight.qtype))
    d = _half(blocks, 0)
    if weight.qtype == "Q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    elif weight.qtype == "Q4_0":
        values = (_nibbles(blocks[..., 2:]) - 8.0) * d
    else:
        values = _nibbles(blocks[..., 4:]) * d + _half(blocks, 2)
    return values.reshape(weight.out_features, weight.in_features).to(dtype)


def linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x.float(), dequantize(weight), None if bias is None else bias.float())
    return y.to(x.dtype)


def isa() -> str:
    return "reference"
