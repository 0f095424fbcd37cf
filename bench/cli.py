"""`chatcore bench [--suite NAME|all] [--quick] [--out DIR]`: run the suites, write JSON, plots, a table.

Each suite measures its own baselines in the same run and reports ratios and targets.
Output in DIR (default bench/results):
* results.json: machine facts and the CPU (`cpu`: model name, flags, cores, threads), then per
  suite its measurements, targets, what they were measured on (`measured_on`: the CPU, device,
  weights and dtype) and how busy the machine was meanwhile (other processes on a shared machine
  disturb timings). Suites run
  now replace their entries; entries of suites not run now are kept if the mode matches.
* <suite>.png plots, and table.md (the Markdown table that README's Performance section shows).

`CHATCORE_BENCH_TINY=1` shrinks every size to a smoke test (the CI test uses it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from chatcore.config import Settings

SUITES = ["single", "throughput", "multiturn", "hitrate", "memory", "sharing", "resume", "server", "sessions", "grammar"]
# Run when named, not by `all`: kernels (measurements without targets); fairness (minutes of another
# tenant's hogs on a server of its own).
ON_REQUEST = ["kernels", "fairness"]
OPTIONS = ("sessions", "turns", "kv_cache_gb", "kv_disk_gb")  # suite parameters (the sessions suite's)


def _log(message: str) -> None:
    """A line on stdout; through tqdm, so a progress bar on the terminal is redrawn below it."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float):
        return None
    return str(value)


def _clean(value: Any) -> Any:
    """NaN and inf become null, so results.json is strict JSON."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def bench_command(args: argparse.Namespace, settings: Settings) -> int:
    from chatcore.bench.common import Context, busy_processes, progress

    tiny = os.environ.get("CHATCORE_BENCH_TINY", "") not in ("", "0")
    names = SUITES if args.suite == "all" else [s.strip() for s in args.suite.split(",")]
    unknown = [n for n in names if n not in SUITES + ON_REQUEST]
    if unknown:
        print(f"unknown suite(s): {', '.join(unknown)}; choose from {', '.join(SUITES + ON_REQUEST)} or all",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = settings.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    ctx = Context(settings=settings, quick=bool(args.quick), tiny=tiny, out=out, threads=threads, log=_log,
                  options={key: getattr(args, key, None) for key in OPTIONS})
    mode = {"quick": ctx.quick, "tiny": tiny, "dtype": ctx.dtype_name, "weights": settings.weights, "threads": threads,
            "block_size": settings.block_size}

    path = out / "results.json"
    suites = _kept_suites(path, mode)

    started = time.monotonic()
    busy = busy_processes()
    if busy:
        _log("other busy processes right now (timings may be disturbed): " + "; ".join(busy))
    failures = 0
    from chatcore.bench import plots

    if not plots.available():
        _log(plots.MISSING)
    for name in progress(names, "suites", "suite"):
        _log(f"[{name}] running{' (quick)' if ctx.quick else ''}{' (tiny)' if tiny else ''}")
        result, failed = _run_suite(name, ctx)
        suites[name] = result
        failures += failed
        _plot(name, result, out)
        _report_suite(name, result)
        _write(path, ctx, mode, suites, busy)

    from chatcore.bench.report import markdown_table

    (out / "table.md").write_text(markdown_table(json.loads(path.read_text())))
    _log(f"wrote {path}, {out / 'table.md'} and plots in {out} ({time.monotonic() - started:.0f} s)")
    return exit_code({name: suites[name] for name in names}, failures, fail_on_missed=not args.no_fail)


def _kept_suites(path: Path, mode: dict[str, Any]) -> dict[str, Any]:
    """The suites of an earlier results.json in `path` run in the same mode (kept unless run again now)."""
    previous: dict[str, Any] = {}
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            previous = {}
    return previous.get("suites", {}) if previous.get("mode") == mode else {}


def _run_suite(name: str, ctx: Any) -> tuple[dict[str, Any], bool]:
    """One suite's result, with the machine's load meanwhile, and whether it raised (its result is then
    the `error` and no targets)."""
    from chatcore.bench.common import CpuMonitor

    monitor = CpuMonitor()
    module = importlib.import_module(f"chatcore.bench.{name}")
    failed = False
    try:
        result = module.run(ctx)
    except Exception as exc:
        failed = True
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}", "targets": []}
    result["cpu"] = monitor.report()
    result["measured_on"] = ctx.measured_on()
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return result, failed


def _plot(name: str, result: dict[str, Any], out: Path) -> None:
    """`result["plots"]`: the PNGs drawn into `out` (none without matplotlib, or where drawing failed)."""
    from chatcore.bench import plots

    result["plots"] = []
    try:
        if plots.available():
            result["plots"] = plots.plot(name, result, out)
    except Exception:
        traceback.print_exc()


def _report_suite(name: str, result: dict[str, Any]) -> None:
    cpu = result["cpu"]
    _log(f"[{name}] done in {cpu['wall_s']:.1f} s; other processes used {cpu['foreign_busy_cores']:.2f} cores "
         f"meanwhile{' (DISTURBED: re-run this suite)' if cpu['foreign_busy_cores'] > 0.3 else ''}")
    for t in result.get("targets", []):
        _log(f"    {t['verdict'].upper():12} {t['name']}: {_fmt(t['value'])} ({t['detail']})")


def exit_code(suites: dict[str, Any], failures: int, *, fail_on_missed: bool) -> int:
    """1 when a suite failed to run, or (unless --no-fail) when a target of this run's suites was
    missed or inconclusive (results.json may also hold earlier runs of other suites: they do not count)."""
    missed = [f"{t['name']} ({t['verdict']})" for s in suites.values() for t in s.get("targets", [])
              if t["met"] is False]
    if missed:
        _log(f"{len(missed)} target(s) not met: {'; '.join(missed)}")
    return 1 if failures or (missed and fail_on_missed) else 0


def _write(path: Path, ctx: Any, mode: dict[str, Any], suites: dict[str, Any], busy: list[str]) -> None:
    targets = [{"suite": name, **t} for name in SUITES if name in suites for t in suites[name].get("targets", [])]
    from chatcore.bench.common import cpu_block

    data = {"mode": mode, "machine": ctx.machine(), "cpu": cpu_block(ctx.threads), "busy_at_start": busy,
            "targets": targets,
            "suites": {name: suites[name] for name in SUITES + ON_REQUEST if name in suites}}
    path.write_text(json.dumps(_clean(data), indent=1, default=_json_default))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
