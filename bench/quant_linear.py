"""Linears on quantized weights at SmolLM2-135M's shapes: GB/s of weight bytes against copy bandwidth.

    python -m chatcore.bench.quant_linear [--quick]

Times, at 1, 4 and 512 rows of float32 and bfloat16 activations, on 2 threads:
- `kernels/cpu_quant.py` on Q4_1 blocks (the default model's layers) on every C path this CPU
  runs (few rows), and its many-row product (the weight dequantized, then torch's GEMM) with the
  dequantization's own share; Q8_0 (the LM head's type) at the head's shape;
- torch's group-wise int4 kernel (`aten._weight_int4pack_mm_for_cpu`, groups of 32, asymmetric:
  Q4_1's shape), called bare and through torchao's CPU int4 weight (`Int4OpaqueTensor`).
Few-row products read rotating copies of the weight, `STREAM_BYTES` in all, so the bytes come
from memory, not from the cache. GB/s = bytes of the weight (quants, scales, mins) / the fastest call's time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from chatcore.bench.common import cpu_flags
from chatcore.kernels import cpu_quant

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "LM head 49152x576": (49152, 576)}  # (out, in)
ROWS = (1, 4, 512)
STREAM_BYTES = 256 << 20  # > the L3 a VM here reports (300 MiB is shared): most reads come from memory
COPY_BYTES = 512 << 20


def _best_seconds(calls: Sequence[Callable[[], object]], reps: int) -> float:
    """The fastest call's seconds, cycling through `calls` (each a different copy of the weight): on
    a shared machine a median times the other processes (a descheduled OpenMP thread stalls a call
    for a whole time slice); the fastest call of many is the kernel's own time."""
    for call in calls[:2]:
        call()
    samples = []
    for rep in range(reps):
        start = time.perf_counter()
        calls[rep % len(calls)]()
        samples.append(time.perf_counter() - start)
    return min(samples)


def copy_bandwidth(reps: int, nbytes: int = COPY_BYTES) -> float:
    """Bytes per second of a `nbytes` CPU copy_, counting the read and the write."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    return 2 * nbytes / _best_seconds([lambda: target.copy_(source)], reps)


def random_blocks(qtype: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """GGUF bytes [out, in / 32 * block_bytes] of random quants and finite fp16 scales (and mins)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = out_features * in_features // cpu_quant.BLOCK
    raw = torch.randint(0, 256, (blocks, cpu_quant.block_bytes(qtype)), dtype=torch.uint8, generator=generator)
    scales = (torch.randn(blocks, 2, generator=generator) * 0.02).half().view(torch.uint8)
    raw[:, :4 if qtype == "Q4_1" else 2] = scales[:, :4 if qtype == "Q4_1" else 2]
    return raw.view(out_features, -1)


def _copies(nbytes: int, rows: int, quick: bool) -> int:
    return 1 if rows >= 64 else max(1, min(4096, (STREAM_BYTES >> 2 if quick else STREAM_BYTES) // nbytes))


def _reps(copies: int, rows: int, out_features: int, quick: bool) -> int:
    if rows >= 64:
        return 3 if quick or out_features > 10_000 else 8
    return max(10, min(3 * copies, 100 if quick else 300))


def _row(kernel: str, qtype: str, shape: str, rows: int, dtype: torch.dtype, nbytes: int, seconds: float,
         copy_bw: float) -> dict:
    return {"kernel": kernel, "qtype": qtype, "shape": shape, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
            "us": seconds * 1e6, "weight_bytes": nbytes, "gbs": nbytes / seconds / 1e9,
            "of_copy": nbytes / seconds / copy_bw}


def int4pack_weight(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int4 weight packed for `_weight_int4pack_mm_for_cpu`, and its scales and zeros in `dtype`."""
    quants = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quants, 1)
    return packed, (torch.randn(in_features // 32, out_features, 2) * 0.02).to(dtype)


def time_int4pack(shape: str, rows: int, dtype: torch.dtype, copy_bw: float, quick: bool) -> dict:
    out_features, in_features = SHAPES[shape]
    packed, scales = int4pack_weight(out_features, in_features, dtype)
    nbytes = packed.nbytes + scales.nbytes
    weights = [(packed.clone(), scales.clone()) for _ in range(_copies(nbytes, rows, quick))]
    x = torch.randn(rows, in_features).to(dtype)
    calls = [lambda w=w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1]) for w in weights]
    seconds = _best_seconds(calls, _reps(len(weights), rows, out_features, quick))
    return _row("int4pack (aten)", "int4 g32", shape, rows, dtype, nbytes, seconds, copy_bw)


def time_torchao(shape: str, rows: int, dtype: torch.dtype, copy_bw: float, quick: bool) -> dict | None:
    """torchao 0.18's CPU int4 weight (`Int4OpaqueTensor`, which calls the aten kernel) through F.linear;
    None where this torchao lacks it."""
    try:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor
    except ImportError:
        return None
    out_features, in_features = SHAPES[shape]
    weight = Int4OpaqueTensor.from_hp(torch.randn(out_features, in_features).to(dtype) * 0.02, [1, 32])
    nbytes = weight.qdata.nbytes + weight.scale_and_zero.nbytes
    weights = [weight] + [Int4OpaqueTensor.from_hp(torch.randn(out_features, in_features).to(dtype) * 0.02, [1, 32])
                          for _ in range(min(_copies(nbytes, rows, quick), 64) - 1)]
    x = torch.randn(rows, in_features).to(dtype)
    calls = [lambda w=w: F.linear(x, w) for w in weights]
    seconds = _best_seconds(calls, _reps(len(weights), rows, out_features, quick))
    return _row("int4 torchao (Int4OpaqueTensor)", "int4 g32", shape, rows, dtype, nbytes, seconds, copy_bw)


def time_quant(shape: str, qtype: str, rows: int, dtype: torch.dtype, copy_bw: float, quick: bool) -> list[dict]:
    """cpu_quant on every C path this CPU runs (few rows), or its many-row product and the
    whole-weight alternative (many rows)."""
    out_features, in_features = SHAPES[shape]
    weight = cpu_quant.lay_out(random_blocks(qtype, out_features, in_features), qtype, out_features, in_features)
    weights = [weight] + [cpu_quant.QuantWeight(qtype, out_features, in_features, weight.data.clone())
                          for _ in range(_copies(weight.nbytes(), rows, quick) - 1)]
    x = torch.randn(rows, in_features).to(dtype)
    reps = _reps(len(weights), rows, out_features, quick)
    if rows <= cpu_quant.FEW_ROWS:
        variants = {f"cpu_quant {path}": lambda w, path=path: cpu_quant._linear(x, w, None, path)
                    for path in cpu_quant.supported_isas()}
    else:
        variants = {"cpu_quant dequantize + GEMM": lambda w: cpu_quant.linear(x, w),
                    "(dequantize only)": lambda w: cpu_quant.dequantize(w, dtype)}
    return [_row(name, qtype, shape, rows, dtype, weight.nbytes(),
                 _best_seconds([lambda w=w, v=variant: v(w) for w in weights], reps), copy_bw)
            for name, variant in variants.items()]


def _cases(quick: bool) -> list[tuple[str, str]]:
    cases = [(shape, "Q4_1") for shape in SHAPES] + [("LM head 49152x576", "Q8_0")]
    return cases[2:4] + cases[-1:] if quick else cases


def run(quick: bool = False, threads: int = 2) -> dict:
    """The measurements (module docstring), with the CPU's flags, the chosen path and copy bandwidth."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        copy_bw = copy_bandwidth(3 if quick else 10)
        rows: list[dict] = []
        for dtype in (torch.float32, torch.bfloat16):
            for shape, qtype in _cases(quick):
                for count in ROWS if not quick else ROWS[:2]:
                    rows += time_quant(shape, qtype, count, dtype, copy_bw, quick)
                    if qtype == "Q4_1" and (count < 64 or SHAPES[shape][0] < 10_000):  # int4pack: minutes there
                        rows += [time_int4pack(shape, count, dtype, copy_bw, quick)]
                        rows += [r for r in [time_torchao(shape, count, dtype, copy_bw, quick)] if r is not None]
        return {"cpu_flags": cpu_flags(), "isa": cpu_quant.isa(), "threads": threads,
                "copy_bandwidth_gbs": copy_bw / 1e9, "rows": rows}
    finally:
        torch.set_num_threads(saved)


def lines(result: dict) -> list[str]:
    """The result as text: the CPU's flags, the chosen path, copy bandwidth, then one line a measurement."""
    head = (f"quantized linears: CPU flags {', '.join(result['cpu_flags']) or 'none'}; cpu_quant.isa() = "
            f"{result['isa']}; {result['threads']} threads; copy bandwidth {result['copy_bandwidth_gbs']:.1f} GB/s")
    return [head] + [f"  {row['dtype']:8s} {row['shape']:18s} {row['qtype']:8s} {row['rows']:3d} rows  "
                     f"{row['kernel']:32s} {row['us']:10.1f} us {row['gbs']:6.1f} GB/s {row['of_copy']:6.2f} of copy"
                     for row in result["rows"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes, 1 and 4 rows, few repetitions")
    print("\n".join(lines(run(quick=parser.parse_args().quick))))


if __name__ == "__main__":
    main()
