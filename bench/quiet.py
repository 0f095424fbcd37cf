"""Run suites on a shared machine until each one ran undisturbed.

    python -m chatcore.bench.quiet [--suites a,b,...] [--out DIR] [--max-foreign 0.3] [--tries 4] [--wait 900] [-- extra args]

Before each try it waits (up to --wait seconds) for a 20-second window in which other
processes use less than --max-foreign cores, then runs `chatcore bench --suite NAME`, which
records in results.json how many cores other processes used meanwhile. A suite whose figure
is above the threshold is run again, up to --tries times; results.json keeps the last try.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from chatcore.bench.cli import SUITES
from chatcore.bench.common import CpuMonitor


def foreign_cores(window_s: float) -> float:
    monitor = CpuMonitor()
    time.sleep(window_s)
    return monitor.report()["foreign_busy_cores"]


def wait_quiet(max_foreign: float, wait_s: float, window_s: float = 20.0) -> float:
    deadline = time.monotonic() + wait_s
    while True:
        load = foreign_cores(window_s)
        if load < max_foreign or time.monotonic() > deadline:
            return load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default="all")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--max-foreign", type=float, default=0.3)
    parser.add_argument("--tries", type=int, default=4)
    parser.add_argument("--wait", type=float, default=900)
    parser.add_argument("extra", nargs="*", help="more `chatcore bench` arguments (after --)")
    args = parser.parse_args()
    suites = SUITES if args.suites == "all" else args.suites.split(",")
    status = 0
    for suite in suites:
        for attempt in range(1, args.tries + 1):
            before = wait_quiet(args.max_foreign, args.wait)
            print(f"[quiet] {suite}: try {attempt}, other processes used {before:.2f} cores just before", flush=True)
            rc = subprocess.call([sys.executable, "-m", "chatcore.cli", "bench", "--suite", suite, "--out", args.out,
                                  *args.extra])
            data = json.loads((Path(args.out) / "results.json").read_text())
            cpu = data["suites"].get(suite, {}).get("cpu", {})
            load = cpu.get("foreign_busy_cores", 99.0)
            print(f"[quiet] {suite}: rc {rc}, other processes used {load:.2f} cores during the run", flush=True)
            if rc == 0 and load <= args.max_foreign:
                break
        else:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
