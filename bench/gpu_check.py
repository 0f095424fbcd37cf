"""`make gpu-check`: every check that needs a CUDA GPU, in one call of at most 7 minutes, into one JSON report.

    bash bench/gpu_check.sh [--out FILE]        (what `make gpu-check` runs; see docs/kernels.md)
    python -m chatcore.bench.gpu_check --rehearse --out FILE     (the CPU dress rehearsal, toy sizes)

Stages (bench/gpu_stages.py), each in a child process with a time limit, in this order: the model (random
weights of the default model's shape when its weights are absent), the engine's greedy fp32 output against
transformers, the engine at default settings with 64 and 256 chats, transformers' static batched `generate`
eager, a profile of decode steps at 64 chats, the Triton decode kernel against copy bandwidth, the CUDA kernel
tests (pytest without plugins or the suite's conftest, which imports the server stack), and transformers'
static cache with its compiled decode. The report (`summary` first) is rewritten after every stage.

Without a CUDA device (and without --rehearse) it prints one line and exits 0. Otherwise it exits 1 when fp32
output is not exact, an audit finds a leaked block, or a kernel test fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from chatcore.bench.gpu_plan import TOY_SHAPE, Plan, full_plan, rehearsal_plan
from chatcore.bench.gpu_runner import Outcome, run_child, stage_result

ROOT = Path(__file__).resolve().parent.parent
STAGED = ROOT / ".gpu"  # what `make gpu-prepare` stages (bench/gpu_prepare.py)
DEFAULT_BUDGET_S = 390  # of the 7 minutes; the rest is the wheels' install and the start
SUMMARY_KEYS = ("device", "commit", "fp32_exact", "engine_64_defaults_tok_s", "engine_256_defaults_tok_s",
                "hf_static_compiled_64_tok_s", "hf_eager_64_tok_s", "gpu_busy_share_64", "launches_per_decode_step",
                "kernel_copy_bw_fraction", "ttft_p50_64_s", "prefill_tok_s_64", "launches_per_prefill_step_64")
KERNEL_TESTS = "tests/test_kernels_triton.py"


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int  # on an H200; the first probe's stages took a third to a half of this


# Most telling first; the compile, the likeliest to overrun, last.
STAGES = (Stage("model", 90), Stage("fidelity_fp32", 90), Stage("engine", 120), Stage("hf_eager", 75),
          Stage("profile", 60), Stage("kernel", 45), Stage("kernel_tests", 90), Stage("hf_compiled", 150))
REHEARSAL_LIMIT_S = 150  # per stage, on a busy 2-core machine


def _log(message: str) -> None:
    print(f"gpu-check: {message}", flush=True)


def commit() -> str | None:
    """The commit `make gpu-prepare` recorded when it is staged (a lent machine's copy of the working tree
    may carry a .git of another commit), else the checkout's (`-dirty` with uncommitted changes)."""
    staged = STAGED / "commit"
    if staged.is_file():
        return f"{staged.read_text().strip()} (staged)"
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def _default_model_dir() -> Path:
    from chatcore.config import Settings
    from chatcore.models.fetch import default_model_dir

    return default_model_dir(Settings().cache_dir)


def _model_source(arg: Path | None) -> Path:
    """The folder of config and tokenizer files: --model-src, else what gpu-prepare staged, else the default
    model's converted folder."""
    for candidate in (arg, STAGED / "model", _default_model_dir()):
        if candidate is not None and (candidate / "config.json").is_file():
            return candidate
    raise SystemExit("gpu-check: no model config found: run `make gpu-prepare` (or pass --model-src)")


def _random_model_dir(work: Path, source: Path, shape: dict[str, int]) -> Path:
    """Where the random model of `source`'s config at `shape` is kept between runs (named by both)."""
    key = hashlib.sha256((source / "config.json").read_bytes() + json.dumps(shape, sort_keys=True).encode())
    return work / f"random-{key.hexdigest()[:12]}"


def make_plan(args: argparse.Namespace) -> Plan:
    work = args.work
    if args.rehearse:
        source = _model_source(args.model_src)
        return rehearsal_plan(_random_model_dir(work, source, TOY_SHAPE), source)
    if args.model is not None:
        return full_plan(args.model, args.model, random_weights=False)
    default = _default_model_dir()
    if (default / "model.safetensors").is_file() and args.model_src is None:
        return full_plan(default, default, random_weights=False)
    source = _model_source(args.model_src)
    return full_plan(_random_model_dir(work, source, {}), source, random_weights=True)


def _versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "pydantic", "xgrammar"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _python_stage(stage: Stage, plan_path: Path, scratch: Path, limit_s: float) -> dict[str, Any]:
    result_path = scratch / f"{stage.name}.json"
    argv = [sys.executable, "-m", "chatcore.bench.gpu_stages", stage.name, str(plan_path), str(result_path)]
    outcome = run_child(argv, limit_s, scratch / f"{stage.name}.log", cwd=ROOT)
    return stage_result(outcome, result_path, limit_s)


def _kernel_tests(plan: Plan, scratch: Path, limit_s: float) -> dict[str, Any]:
    """The kernel tests' CUDA cases, compiled: pytest with no plugins loaded and without the suite's conftest."""
    env = {**os.environ, "CHATCORE_DEVICE": plan.device, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("TRITON_INTERPRET", None)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-k", "cuda",
            KERNEL_TESTS]
    outcome: Outcome = run_child(argv, limit_s, scratch / "kernel_tests.log", env=env, cwd=ROOT)
    lines = [line for line in outcome.log.splitlines() if line.strip()]
    entry: dict[str, Any] = {"seconds": round(outcome.seconds, 1), "limit_s": round(limit_s), "rc": outcome.rc,
                             "passed": outcome.rc == 0, "summary": lines[-1] if lines else "",
                             "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]}
    if outcome.rc != 0:
        entry["error"] = "timed out" if outcome.timed_out else f"exit {outcome.rc}"
        entry["tail"] = outcome.log
    return entry


def _value(stages: dict[str, Any], name: str, *path: str | int) -> Any:
    """A stage's figure, or None where the stage failed, was skipped or has not run."""
    node: Any = stages.get(name)
    if node is None or "error" in node or "skipped" in node:
        return None
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def summary(report: dict[str, Any]) -> dict[str, Any]:
    stages = report["stages"]
    exact, prompts = _value(stages, "fidelity_fp32", "exact"), _value(stages, "fidelity_fp32", "prompts")
    return {
        "device": report["device"], "commit": report["commit"],
        "fp32_exact": f"{exact}/{prompts}" if exact is not None else None,
        "engine_64_defaults_tok_s": _value(stages, "engine", "runs", 0, "tok_s"),
        "engine_256_defaults_tok_s": _value(stages, "engine", "runs", 1, "tok_s"),
        "hf_static_compiled_64_tok_s": _value(stages, "hf_compiled", "tok_s"),
        "hf_eager_64_tok_s": _value(stages, "hf_eager", "tok_s"),
        "gpu_busy_share_64": _value(stages, "profile", "gpu_busy_share"),
        "launches_per_decode_step": _value(stages, "profile", "launches_per_decode_step"),
        "kernel_copy_bw_fraction": _value(stages, "kernel", "kernel_bw_fraction"),
        "ttft_p50_64_s": _value(stages, "engine", "runs", 0, "ttft_p50_s"),
        "prefill_tok_s_64": _value(stages, "engine", "runs", 0, "prefill_tok_s"),
        "launches_per_prefill_step_64": _value(stages, "profile", "launches_per_prefill_step"),
    }


def failures(stages: dict[str, Any]) -> list[str]:
    """What makes the check exit 1: fp32 output not exact (or not checked), a leaked block, a kernel test."""
    out = []
    fidelity = stages.get("fidelity_fp32", {})
    if "exact" not in fidelity:
        out.append(f"fp32 fidelity did not run: {fidelity.get('error') or fidelity.get('skipped') or 'not reached'}")
    elif fidelity["exact"] != fidelity["prompts"]:
        out.append(f"fp32 greedy output equals transformers' on {fidelity['exact']} of {fidelity['prompts']} prompts")
    for name, entry in stages.items():
        if entry.get("audit_ok") is False:
            out.append(f"{name}: the audit found a block still held or a broken invariant after the run")
    if stages.get("kernel_tests", {}).get("passed") is False:
        out.append(f"kernel tests: {stages['kernel_tests']['summary']}")
    return out


def write_report(path: Path, report: dict[str, Any]) -> None:
    """The report with `summary` first, `ok` and `failures` as of now, written whole (rename over the old)."""
    stages = report["stages"]
    report = {"summary": summary(report), "failures": failures(stages),
              "errors": {name: entry["error"] for name, entry in stages.items() if "error" in entry}} | report
    report["ok"] = not report["failures"]
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=1, default=str))
    partial.replace(path)


def run(plan: Plan, out: Path, budget_s: float, device: str) -> int:
    started = time.perf_counter()
    report: dict[str, Any] = {"device": device, "commit": commit(), "rehearsal": plan.rehearsal,
                              "versions": _versions(), "plan": json.loads(plan.to_json()), "stages": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        scratch = Path(tmp)
        plan_path = scratch / "plan.json"
        plan_path.write_text(plan.to_json())
        for stage in STAGES:
            left = budget_s - (time.perf_counter() - started)
            limit = min(REHEARSAL_LIMIT_S if plan.rehearsal else stage.limit_s, left)
            if limit < 15:
                report["stages"][stage.name] = {"skipped": f"out of time ({left:.0f} s of {budget_s:.0f} left)"}
            else:
                _log(f"{stage.name} (at most {limit:.0f} s)")
                report["stages"][stage.name] = (_kernel_tests(plan, scratch, limit) if stage.name == "kernel_tests"
                                                else _python_stage(stage, plan_path, scratch, limit))
            _log(f"  {_brief(report['stages'][stage.name])}")
            report["seconds"] = round(time.perf_counter() - started, 1)
            write_report(out, report)
    written = json.loads(out.read_text())
    _log(f"{'ok' if written['ok'] else 'FAILED'} in {report['seconds']:.0f} s; report: {out}")
    for line in written["failures"]:
        _log(f"  {line}")
    _log("summary: " + json.dumps(written["summary"], default=str))
    return 0 if written["ok"] else 1


def _brief(entry: dict[str, Any]) -> str:
    if "error" in entry or "skipped" in entry:
        return entry.get("error") or entry["skipped"]
    shown = {k: v for k, v in entry.items() if not isinstance(v, (dict, list)) and k != "tail"}
    return json.dumps(shown, default=str)[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu-check.json")
    parser.add_argument("--rehearse", action="store_true", help="the same stages at toy sizes on the CPU, fp32")
    parser.add_argument("--model", type=Path, help="a model folder with weights (default: the default model's "
                        "weights, else random weights of its shape)")
    parser.add_argument("--model-src", type=Path, help="config and tokenizer files for random weights "
                        "(default: .gpu/model, else the default model's folder)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "chatcore-gpu-check",
                        help="where random models are kept between runs")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all stages")
    args = parser.parse_args(argv)
    import torch

    if args.rehearse:
        device = "cpu (rehearsal)"
    elif not torch.cuda.is_available():
        print(f"gpu-check: skipped, no CUDA device (torch {torch.__version__} sees none)")
        return 0
    else:
        device = torch.cuda.get_device_name(0)
    plan = make_plan(args)
    _log(f"{device}; model {plan.model}{' (random weights)' if plan.random_weights else ''}")
    return run(plan, args.out.resolve(), args.budget, device)


if __name__ == "__main__":
    sys.exit(main())
