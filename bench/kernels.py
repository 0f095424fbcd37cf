"""Kernels: paged decode attention (the Triton kernel against the torch reference and dense SDPA),
and on the CPU the linears on GGUF's quantized blocks (bench/quant_linear.py).

    python -m chatcore.bench.kernels [--quick]
    chatcore bench --suite kernels [--quick]     (the quantized linears only, with the CPU's flags)

On CUDA it times the kernel (with its split heuristic and a sweep of fixed splits), the
reference and SDPA over already-gathered, contiguous K/V (what attention costs without
paging), and reports the kernel's achieved bandwidth (bytes of K/V read / time) as a fraction
of the device's copy bandwidth (a large device-to-device `copy_`). The goal is >= 0.7 for
batch 32, 4k context, fp16, block size 16.

On CPU the Triton kernel cannot run compiled, so only the reference (the engine's CPU path)
and dense SDPA are timed, plus the reference variants docs/kernels.md compares, on 2 threads,
and the quantized linears: GB/s of weight bytes at SmolLM2-135M's shapes against a 512 MiB copy,
per C path, and torch's own int4 kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from chatcore.bench import quant_linear
from chatcore.kernels import dispatch as kernels
from chatcore.kernels import reference

if TYPE_CHECKING:
    from chatcore.bench.common import Context


@dataclass(frozen=True)
class Config:
    num_seqs: int
    max_context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


@dataclass
class Case:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens, self.scale

    def kv_bytes(self) -> int:
        """Bytes of K and V the attention must read: every context token, once."""
        _, _, kv_heads, head_dim = self.key_cache.shape
        tokens = int(self.context_lens.sum())
        return 2 * tokens * kv_heads * head_dim * self.key_cache.element_size()


def make_case(cfg: Config, device: torch.device, *, ragged: bool, seed: int = 0) -> Case:
    """A shuffled block pool; contexts all max_context, or uniform in [max/4, max] when ragged."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    if ragged:
        lens = torch.randint(cfg.max_context // 4, cfg.max_context + 1, (cfg.num_seqs,), generator=gen)
        lens[0] = cfg.max_context
    else:
        lens = torch.full((cfg.num_seqs,), cfg.max_context)
    width = -(-cfg.max_context // cfg.block_size)
    num_blocks = cfg.num_seqs * width
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    return Case(
        query=torch.randn(cfg.num_seqs, cfg.num_heads, cfg.head_dim, generator=gen).to(device, dtype),
        key_cache=torch.randn(shape, generator=gen).to(device, dtype),
        value_cache=torch.randn(shape, generator=gen).to(device, dtype),
        block_tables=torch.randperm(num_blocks, generator=gen).view(cfg.num_seqs, width).to(device, torch.int32),
        context_lens=lens.to(device, torch.int32),
        scale=cfg.head_dim**-0.5,
    )


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call, after one warm-up call (which also compiles kernels)."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes per second of a large same-device copy_, counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, reps)


def gathered_dense(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query and contiguous K/V [S, KVH, L, D] with a padding mask: paging already undone."""
    query, key_cache, value_cache, table, lens, _ = case.args()
    num_seqs, num_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    span = table.shape[1] * block_size
    keys = key_cache[table.long()].view(num_seqs, span, kv_heads, head_dim).transpose(1, 2).contiguous()
    values = value_cache[table.long()].view(num_seqs, span, kv_heads, head_dim).transpose(1, 2).contiguous()
    mask = (torch.arange(span, device=query.device) < lens[:, None])[:, None, None, :]
    return query.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim), keys, values, mask


def dense_sdpa_seconds(case: Case, device: torch.device, reps: int) -> float:
    q, k, v, mask = gathered_dense(case)
    return timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale), device, reps)


# --- CPU reference variants (docs/kernels.md) ----------------------------------------------
# Each takes a Case and returns [S, H, D]. The first is what kernels.reference ships (SDPA
# with a boolean mask over K/V gathered into reused buffers); the others are the
# alternatives it was measured against, all gathering into fresh tensors.


def _gather(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Keys and values [S, L, KVH, D] gathered through the clamped table, and the valid mask."""
    query, key_cache, value_cache, table, lens, _ = case.args()
    block_size = key_cache.shape[1]
    num_blocks = -(-int(lens.max()) // block_size)
    span = num_blocks * block_size
    valid = torch.arange(span) < lens[:, None]
    table = table[:, :num_blocks].long().masked_fill(~valid[:, ::block_size], 0)
    shape = (query.shape[0], span, key_cache.shape[2], key_cache.shape[3])
    return key_cache[table].view(shape), value_cache[table].view(shape), valid, span


def variant_sdpa_bool_mask_fresh(case: Case) -> torch.Tensor:
    """The shipped reference, but gathering into freshly allocated tensors."""
    keys, values, valid, _ = _gather(case)
    s, h, d = case.query.shape
    kv_heads = keys.shape[2]
    out = F.scaled_dot_product_attention(
        case.query.view(s, kv_heads, h // kv_heads, d), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=case.scale,
    )
    return out.reshape(s, h, d)


def variant_einsum_fp32(case: Case) -> torch.Tensor:
    keys, values, valid, _ = _gather(case)
    s, h, d = case.query.shape
    kv_heads = keys.shape[2]
    q = case.query.float().view(s, kv_heads, h // kv_heads, d)
    scores = torch.einsum("skgd,slkd->skgl", q, keys.float()) * case.scale
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("skgl,slkd->skgd", probs, values.float()).reshape(s, h, d).to(case.query.dtype)


def variant_block_diagonal_bmm(case: Case) -> torch.Tensor:
    """GQA as two bmm's over K/V [S, L, KVH*D] (no transpose copy) against a block-diagonal query."""
    keys, values, valid, span = _gather(case)
    s, h, d = case.query.shape
    kv_heads = keys.shape[2]
    group = h // kv_heads
    heads = torch.arange(kv_heads)
    q_blocks = case.query.new_zeros(s, kv_heads, d, kv_heads, group)
    q_blocks[:, heads, :, heads, :] = case.query.view(s, kv_heads, group, d).permute(1, 0, 3, 2)
    scores = torch.bmm(keys.view(s, span, kv_heads * d), q_blocks.view(s, kv_heads * d, h)).float() * case.scale
    probs = scores.masked_fill(~valid[:, :, None], float("-inf")).softmax(1).to(values.dtype)
    out = torch.bmm(probs.transpose(1, 2), values.view(s, span, kv_heads * d)).view(s, kv_heads, group, kv_heads, d)
    return out[:, heads, :, heads, :].permute(1, 0, 2, 3).reshape(s, h, d)


def variant_sdpa_float_mask(case: Case) -> torch.Tensor:
    keys, values, valid, _ = _gather(case)
    s, h, d = case.query.shape
    kv_heads = keys.shape[2]
    bias = torch.zeros(valid.shape, dtype=case.query.dtype).masked_fill(~valid, float("-inf"))
    out = F.scaled_dot_product_attention(
        case.query.view(s, kv_heads, h // kv_heads, d), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=bias[:, None, None, :], scale=case.scale,
    )
    return out.reshape(s, h, d)


CPU_VARIANTS: dict[str, Callable[[Case], torch.Tensor]] = {
    "sdpa_bool_mask_reused (shipped)": lambda case: reference.paged_decode_attention(*case.args()),
    "sdpa_bool_mask_fresh": variant_sdpa_bool_mask_fresh,
    "sdpa_float_mask": variant_sdpa_float_mask,
    "block_diagonal_bmm": variant_block_diagonal_bmm,
    "einsum_fp32": variant_einsum_fp32,
}


def cpu_variants(cfg: Config, reps: int) -> list[dict]:
    case = make_case(cfg, torch.device("cpu"), ragged=True)
    exact = reference.paged_decode_attention(
        case.query.double(), case.key_cache.double(), case.value_cache.double(),
        case.block_tables, case.context_lens, case.scale,
    )
    rows = []
    for name, fn in CPU_VARIANTS.items():
        err = (fn(case).double() - exact).abs().max().item()
        seconds = timed(lambda fn=fn: fn(case), torch.device("cpu"), reps)
        rows.append({"config": asdict(cfg), "variant": name, "ms": seconds * 1e3, "max_abs_error_vs_fp64": err})
    return rows


# --- main comparison ----------------------------------------------------------------------


def decode_row(cfg: Config, device: torch.device, copy_bw: float, reps: int, splits: tuple[int, ...]) -> dict:
    case = make_case(cfg, device, ragged=False)
    row: dict = {"config": asdict(cfg), "kv_bytes": case.kv_bytes()}

    def record(name: str, seconds: float) -> None:
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_bw_fraction"] = case.kv_bytes() / seconds / copy_bw

    record("reference", timed(lambda: reference.paged_decode_attention(*case.args()), device, reps))
    record("dense_sdpa", dense_sdpa_seconds(case, device, reps))
    if device.type == "cuda":
        out = torch.empty_like(case.query)
        record("kernel", timed(lambda: kernels.paged_decode_attention(*case.args(), out=out), device, reps))
        for n in splits:
            record(f"kernel_splits{n}", timed(
                lambda n=n: kernels.paged_decode_attention(*case.args(), num_splits=n, out=out), device, reps))
    return row


def run(ctx: Context) -> dict:
    """`chatcore bench --suite kernels`: the quantized linears (bench/quant_linear.py) on the run's
    threads, each line logged, with the CPU's flags and the path `cpu_quant.isa()` chose; no targets."""
    result = quant_linear.run(quick=ctx.quick or ctx.tiny, threads=ctx.threads)
    for line in quant_linear.lines(result):
        ctx.log(line)
    return {"quant_linear": result, "targets": []}


def measure(quick: bool = False) -> dict:
    """Run the benchmark; returns the measurements (also what `python -m chatcore.bench.kernels` prints)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = 3 if quick else 10
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(2)
    try:
        copy_bw = copy_bandwidth(device, 64 << 20 if quick else (1 << 30 if device.type == "cuda" else 256 << 20), reps)
        model = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}  # the default model's attention
        if device.type == "cuda":
            configs = [Config(32, 4096, dtype="float16", block_size=16, **model)]
            if not quick:
                configs += [
                    Config(32, 4096, 32, 8, 128, 16, "float16"),
                    Config(64, 2048, dtype="bfloat16", block_size=16, **model),
                    Config(4, 16384, dtype="float16", block_size=16, **model),
                ]
            splits = (1, 2, 4, 8) if not quick else ()
        else:
            configs = [Config(16, 512, dtype="float32", block_size=16, **model)] if quick else [
                Config(64, 2048, dtype="float32", block_size=16, **model),
                Config(64, 2048, dtype="bfloat16", block_size=16, **model),
            ]
            splits = ()
        result: dict = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "paths": "triton kernel, reference, dense SDPA" if device.type == "cuda" else
                     "reference and dense SDPA only: without a GPU the Triton kernel runs only in the interpreter",
            "copy_bandwidth_gbs": copy_bw / 1e9,
            "decode": [decode_row(cfg, device, copy_bw, reps, splits) for cfg in configs],
        }
        if device.type == "cpu":
            variant_configs = [Config(16, 512, 9, 3, 64, 16, "float32")] if quick else [
                Config(64, 2048, 9, 3, 64, 16, "float32"),
                Config(64, 2048, 9, 3, 64, 16, "bfloat16"),
            ]
            result["cpu_reference_variants"] = [row for cfg in variant_configs for row in cpu_variants(cfg, reps)]
            result["quant_linear"] = quant_linear.run(quick=quick, threads=2)
        return result
    finally:
        torch.set_num_threads(threads)


def _print(result: dict) -> None:
    print(f"device: {result['device']} ({result['threads']} threads); timed: {result['paths']}")
    print(f"copy bandwidth: {result['copy_bandwidth_gbs']:.1f} GB/s")
    for row in result["decode"]:
        c = row["config"]
        print(f"\nbatch {c['num_seqs']}, context {c['max_context']}, heads {c['num_heads']}/{c['num_kv_heads']}x"
              f"{c['head_dim']}, {c['dtype']}, block {c['block_size']}: {row['kv_bytes'] / 1e6:.1f} MB of K/V")
        for key in sorted(k for k in row if k.endswith("_ms")):
            name = key[: -len("_ms")]
            print(f"  {name:18s} {row[key]:9.3f} ms   {row[name + '_bw_fraction']:6.1%} of copy bandwidth")
    if "cpu_reference_variants" in result:
        print("\nCPU reference variants (ragged contexts in [max/4, max]):")
        for row in result["cpu_reference_variants"]:
            c = row["config"]
            print(f"  S={c['num_seqs']} ctx<={c['max_context']} {c['dtype']:9s} {row['variant']:32s} "
                  f"{row['ms']:8.1f} ms  max err {row['max_abs_error_vs_fp64']:.1e}")
    if "quant_linear" in result:
        print("\n" + "\n".join(quant_linear.lines(result["quant_linear"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else "", end="")
    if not args.json:
        _print(result)


if __name__ == "__main__":
    main()
