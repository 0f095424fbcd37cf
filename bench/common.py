"""What every suite shares: sizes, the loaded models, timing, targets and machine facts."""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from chatcore.config import Settings

TINY_ENV = "CHATCORE_BENCH_TINY"
T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str, *, leave: bool = True) -> Iterator[T]:
    """`items` with a tqdm bar on stderr, shown on a terminal only (`disable=None`), so logs and CI output
    stay clean; lines logged meanwhile go through `tqdm.write` (`bench.cli._log`) and keep the bar whole."""
    return iter(tqdm(items, desc=desc, unit=unit, leave=leave, disable=None, file=sys.stderr, dynamic_ncols=True))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1); NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# A baseline whose repeats spread wider than this, (max - min) / median, makes a verdict inconclusive.
BASELINE_MOVED = 0.20


def baseline_spread(baseline_runs: list[float]) -> float | None:
    """How far a baseline moved between repeats: (max - min) / median of its per-repeat values
    (NaN ones left out). None with fewer than two values, or a median of 0."""
    measured = [v for v in baseline_runs if not math.isnan(v)]
    if len(measured) < 2 or statistics.median(measured) == 0:
        return None
    return (max(measured) - min(measured)) / abs(statistics.median(measured))


def baseline_note(baseline_runs: list[float]) -> str:
    """What a target's detail says about its baseline's repeats: how far it moved, or that it was
    measured once (a single repeat checks nothing) or not at all."""
    measured = [v for v in baseline_runs if not math.isnan(v)]
    if not measured:
        return "baseline not measured"
    if len(measured) == 1:
        return "baseline measured in one repeat only: whether it moved is not checked"
    spread = baseline_spread(measured)
    values = ", ".join(f"{v:.4g}" for v in measured)
    if spread is None:
        return f"baseline repeats {values}"
    moved = f", more than {BASELINE_MOVED:.0%}: inconclusive" if spread > BASELINE_MOVED else ""
    return f"baseline moved {spread:.0%} between {len(measured)} repeats ({values}){moved}"


def target(name: str, value: float, op: str, threshold: float, detail: str = "",
           runs: list[float] | None = None, baseline_runs: list[float] | None = None) -> dict[str, Any]:
    """A target, judged `value op threshold` (op one of '>=' and '<='): verdict met or missed.

    `runs` are the per-repeat values behind `value`. When some of them meet the threshold and
    others do not, the repeats spread wider than the margin to it and the verdict is
    `inconclusive`, which is never met (`met` False, and `chatcore bench` exits 1 as for a miss).

    `baseline_runs` are the per-repeat values of the figure `value` compares with (the baseline's
    tok/s, TTFT, ceiling...). When it moved by more than `BASELINE_MOVED` between repeats
    (`baseline_spread`), the comparison is not trusted: the verdict is `inconclusive` too. Given,
    the detail ends with `baseline_note` (its spread, or that it was measured once).
    """
    def holds(v: float) -> bool:
        return not math.isnan(v) and (v >= threshold if op == ">=" else v <= threshold)

    verdict = "met" if holds(value) else "missed"
    measured = [v for v in runs or [] if not math.isnan(v)]
    if len(measured) > 1 and len({holds(v) for v in measured}) > 1:
        verdict = "inconclusive"
    spread = baseline_spread(baseline_runs) if baseline_runs is not None else None
    if spread is not None and spread > BASELINE_MOVED:
        verdict = "inconclusive"
    if baseline_runs is not None:
        detail = f"{detail}; {baseline_note(baseline_runs)}" if detail else baseline_note(baseline_runs)
    return {"name": name, "value": value, "op": op, "threshold": threshold, "met": verdict == "met",
            "verdict": verdict, "runs": list(runs or []), "detail": detail,
            "baseline_runs": None if baseline_runs is None else list(baseline_runs), "baseline_spread": spread}


def reported(name: str, value: float, detail: str = "") -> dict[str, Any]:
    """A figure shown beside the targets without a verdict (`met` None): a sanity check, or a
    comparison with no threshold worth judging. It never fails a run."""
    return {"name": name, "value": value, "op": "report", "threshold": None, "met": None, "verdict": "reported",
            "detail": detail}


class CpuMonitor:
    """How busy the machine was, apart from this process tree, while a suite ran.

    Other engineers share this 2-core machine; a suite whose foreign load is high should be re-run.
    """

    def __init__(self) -> None:
        self.start_wall = time.monotonic()
        self.start_total = self._machine_busy()
        self.start_ours = self._ours()

    @staticmethod
    def _machine_busy() -> float:
        with open("/proc/stat") as fh:
            parts = fh.readline().split()[1:]
        values = [int(p) for p in parts]
        idle = values[3] + values[4]
        return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        try:
            import psutil
        except ImportError:  # pragma: no cover
            t = os.times()
            return t.user + t.system + t.children_user + t.children_system
        me = psutil.Process()
        total = sum(me.cpu_times()[:2])
        for child in me.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
        t = os.times()
        return total + t.children_user + t.children_system

    def report(self) -> dict[str, float]:
        wall = time.monotonic() - self.start_wall
        busy = self._machine_busy() - self.start_total
        ours = self._ours() - self.start_ours
        foreign = max(0.0, busy - ours)
        return {"wall_s": wall, "machine_busy_cores": busy / wall if wall else 0.0,
                "foreign_busy_cores": foreign / wall if wall else 0.0, "loadavg_1m": os.getloadavg()[0]}


def busy_processes(limit: int = 5) -> list[str]:
    """The busiest other processes right now (a snapshot for the log)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(0.5)
    me = os.getpid()
    rows = []
    for p in procs:
        try:
            if p.pid == me:
                continue
            pct = p.cpu_percent(None)
            if pct > 5:
                cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:100]
                rows.append((pct, f"{pct:.0f}% pid {p.pid}: {cmd}"))
        except psutil.Error:
            pass
    return [r for _, r in sorted(rows, reverse=True)[:limit]]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The CPU flags that choose chatcore's CPU kernels and dtype (AVX2, AVX-512F, AVX512-BF16, VNNI, AMX).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_flags() -> list[str]:
    """Which of `CPU_FLAGS` the CPU has: the first `flags` line of /proc/cpuinfo, word by word."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    words = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    return sorted(words & set(CPU_FLAGS))


def cpu_block(threads: int) -> dict[str, Any]:
    """The CPU a figure was measured on: its model name, which of `CPU_FLAGS` it has, its cores and
    the threads the run used."""
    return {"model": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "threads": threads}


@dataclass
class Context:
    """Sizes and shared state for one `chatcore bench` run."""

    settings: Settings
    quick: bool
    tiny: bool
    out: Path
    threads: int
    log: Callable[[str], None] = print
    options: dict[str, Any] = field(default_factory=dict)  # suite parameters from the command line
    _loaded: Any = field(default=None, repr=False)
    _hf: Any = field(default=None, repr=False)

    @property
    def repeats(self) -> int:
        return 1 if (self.quick or self.tiny) else 3

    def each_repeat(self, items: Iterable[T]) -> Iterator[T]:
        """A suite's repeats, with a bar below the suites' bar (cleared when the suite is done)."""
        return progress(items, "  repeats", "repeat", leave=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.loaded.dtype

    @property
    def dtype_name(self) -> str:
        """The dtype chatcore runs in: the loaded model's (float32 activations over a GGUF's blocks)."""
        return str(self.loaded.dtype).removeprefix("torch.")

    @property
    def baseline_dtype(self) -> torch.dtype:
        """transformers' dtype for the baselines: the run's `dtype` setting as `auto` resolves it for
        full weights (bfloat16 where the CPU multiplies it natively), transformers' best path here."""
        from chatcore.models.device import resolve_device, resolve_dtype

        return resolve_dtype(self.settings.dtype, resolve_device(self.settings.device))

    def engine_settings(self, **overrides: Any) -> Settings:
        """The run's settings for an in-process engine. The queue bound (`max_queue_wait_s`, 30 s)
        is a server policy; a benchmark on a loaded machine must not fail requests with `busy`."""
        return self.settings.model_copy(update={"max_queue_wait_s": 600.0, **overrides})

    @property
    def loaded(self):
        """The model with chatcore's paged attention, loaded once per run."""
        if self._loaded is None:
            from chatcore.models.loader import load_model

            self._loaded = load_model(self.settings)
        return self._loaded

    @property
    def hf_model(self):
        """The model's full weights through plain transformers (SDPA attention) in `baseline_dtype`: the
        baselines' model."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(self.loaded.path, dtype=self.baseline_dtype,
                                                            attn_implementation="sdpa").to(self.loaded.device).eval()
        return self._hf

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def measured_on(self) -> dict[str, Any]:
        """What every figure of a suite was measured with: the CPU (`cpu_block`), the device, the weights
        setting and the dtype. Each suite's result carries it, so a suite kept from an earlier run
        still names its own CPU."""
        from chatcore.models.device import resolve_device

        return {"cpu": cpu_block(self.threads), "device": resolve_device(self.settings.device).type,
                "weights": self.settings.weights, "weights_served": self.loaded.weights, "dtype": self.dtype_name}

    def machine(self) -> dict[str, Any]:
        import transformers

        from chatcore.models.device import resolve_device

        device = resolve_device(self.settings.device)
        return {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "cpu_flags": cpu_flags(),
            "threads": self.threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "dtype": self.dtype_name,
            "weights": self.settings.weights,
            "weights_served": self.loaded.weights,
            "block_size": self.settings.block_size,
            "quick": self.quick,
            "tiny": self.tiny,
        }


def num_params(model: Any) -> int:
    """Parameters counted once (tied embeddings once): ~2 x this many FLOPs per token."""
    seen = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_flops(dtype: torch.dtype, m: int, k: int, n: int, reps: int = 20,
               device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of a torch matmul [m, k] x [k, n] on the device: the best of `reps` samples after a
    warm-up (a ceiling is what the hardware can do; this VM's rate drifts by +-20% over minutes)."""
    a = torch.randn(m, k).to(device, dtype)
    b = torch.randn(k, n).to(device, dtype)
    inner = max(1, int(2e8 // (2 * m * k * n)))  # ~0.2 GFLOP per sample
    for _ in range(3):
        torch.mm(a, b)
    samples = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return 2 * m * k * n / min(samples)


class GemmChain:
    """Every linear of a model as one `torch.mm`, and nothing else: the GEMMs a forward over `rows`
    tokens runs, in the model's dtype, on its device (issue 36's "same-shape GEMM chain").

    The shapes come from the model's own `nn.Linear` modules, so any architecture gives its own
    chain: for a Llama-like decoder, each layer's q, k, v, o, gate, up and down projections (q|k|v
    and gate|up as one linear each where chatcore/models/fused_layer.py fused them); then
    the LM head (`get_output_embeddings()`) once. Each linear gets a weight of its own (random:
    the values do not change a GEMM's time), distinct per layer, so the weights stream from memory
    as the model's do; no bias is added. The weight is stored [in, out] contiguous, the
    module's `W` [out, in] transposed and copied, so `torch.mm(x, w)` computes `x @ W.T`: the
    layout torch.mm reads fastest here, in bfloat16 and float32 (docs/measurements.md, "GEMM
    layout"; `chatcore/models/weight_layout.py`).
    """

    def __init__(self, model: Any, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> None:
        head = model.get_output_embeddings()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        self.device = device
        self.body = [torch.randn(m.in_features, m.out_features, dtype=dtype, device=device) for m in linears]
        self.head = torch.randn(head.in_features, head.out_features, dtype=dtype, device=device)
        self.dtype = dtype
        self._inputs: dict[int, dict[int, torch.Tensor]] = {}

    @property
    def linears(self) -> int:
        """How many GEMMs one pass runs (the LM head's included)."""
        return len(self.body) + 1

    def _x(self, rows: int, width: int) -> torch.Tensor:
        by_width = self._inputs.setdefault(rows, {})
        if width not in by_width:
            by_width[width] = torch.randn(rows, width, dtype=self.dtype, device=self.device)
        return by_width[width]

    def seconds(self, rows: int, head_rows: int, reps: int = 5) -> list[float]:
        """Each of `reps` passes' seconds, after one untimed: every body linear at `rows` rows, then
        the LM head at `head_rows` (the rows whose logits the step samples)."""
        inputs = [self._x(rows, w.shape[0]) for w in self.body]
        head_x = self._x(head_rows, self.head.shape[0])

        def chain() -> None:
            for x, w in zip(inputs, self.body, strict=True):
                torch.mm(x, w)
            torch.mm(head_x, self.head)

        chain()
        samples = []
        for _ in range(reps):
            _sync(self.device)
            t0 = time.perf_counter()
            chain()
            _sync(self.device)
            samples.append(time.perf_counter() - t0)
        return samples


def _leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind `tensor`: itself, or a tensor subclass's inner tensors (torchao's int8
    weight: its int8 values and scales), recursively."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [leaf for name in names if (inner := getattr(tensor, name)) is not None for leaf in _leaves(inner)]


def _add_storage(seen: dict[Any, int], tensor: torch.Tensor | None) -> None:
    for leaf in _leaves(tensor) if tensor is not None else []:
        if leaf.is_mkldnn:  # oneDNN's packed layout (an opaque tensor, no storage to look at)
            seen[("mkldnn", id(leaf))] = leaf.numel() * leaf.element_size()
            continue
        storage = leaf.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())


def weight_bytes(model: Any) -> dict[str, int]:
    """The bytes of the loaded weights, each storage counted once:

    * `read`: what one decode step reads for each sequence: every linear as the forward multiplies it
      at one row (a packed bfloat16 linear's copy in the few-row kernel's layout,
      `weight_layout.PackedLinear.few_rows`, where it has one, else its oneDNN copy, `packed`; int8
      values with their scales, `int8_weights.Int8Linear`; a GGUF linear's blocks in `cpu_quant`'s
      layout, `gguf_weights.QuantLinear`; else the weight), the norms and every
      other parameter and buffer, but not an input embedding table (a token reads one row of it)
      unless a linear reads the same storage (an LM head tied to it);
    * `held`: every storage the model holds (tensor subclasses by their inner tensors; stand-ins of
      packed weights by their few bytes), packed and few-row copies and int8 scales included."""
    read: dict[Any, int] = {}
    held: dict[Any, int] = {}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        few_rows, packed, *scales = [getattr(module, name, None)
                                     for name in ("few_rows", "packed", "int8_scales", "int8_pre_scale")]
        for tensor in [few_rows, packed, *scales]:
            _add_storage(held, tensor)
        quant = getattr(module, "quant", None)  # a GGUF linear's blocks (models/gguf_weights.QuantLinear)
        if quant is not None:
            _add_storage(read, quant.data)
            _add_storage(held, quant.data)
        if isinstance(module, torch.nn.Linear):
            int8 = hasattr(module, "int8_scales")
            inputs = [module.weight.qdata] if int8 else [] if hasattr(module, "packed") else [module.weight]
            copy = few_rows if few_rows is not None else packed  # the copy a one-row step multiplies
            for tensor in [*inputs, copy, *scales, module.bias]:
                _add_storage(read, tensor)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            _add_storage(held, tensor)
            if not isinstance(module, torch.nn.Linear) and id(tensor) not in embeddings:
                _add_storage(read, tensor)
    return {"read": sum(read.values()), "held": sum(held.values())}


def copy_bandwidth(nbytes: int, reps: int = 5, device: torch.device | None = None) -> float:
    """Bytes per second of the best of `reps` copies of an `nbytes` tensor into another, counting the
    bytes read and the bytes written (2 x nbytes a copy), at the run's torch threads."""
    device = device or torch.device("cpu")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best
