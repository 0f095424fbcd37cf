"""One stage of the GPU check in a child process, under a time limit.

The child gets a new process session and writes its output to a log file, not a pipe: at the limit the
whole group is killed (a stage's own children too, such as torch.compile's workers or pytest), and no
grandchild holding a pipe open can keep the parent waiting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TAIL_CHARS = 3000


@dataclass
class Outcome:
    rc: int | None  # None: killed at the limit
    seconds: float
    log: str  # the output's tail

    @property
    def timed_out(self) -> bool:
        return self.rc is None


def run_child(argv: list[str], limit_s: float, log_path: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Outcome:
    started = time.perf_counter()
    with log_path.open("wb") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 cwd=cwd, start_new_session=True)
        try:
            rc: int | None = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    return Outcome(rc, time.perf_counter() - started, log_path.read_text(errors="replace")[-TAIL_CHARS:])


def stage_result(outcome: Outcome, result_path: Path, limit_s: float) -> dict[str, Any]:
    """A stage's report entry: what it wrote, or the error and its output's tail."""
    entry: dict[str, Any] = {"seconds": round(outcome.seconds, 1), "limit_s": round(limit_s)}
    if outcome.timed_out:
        return entry | {"error": f"timed out after {limit_s:.0f} s", "tail": outcome.log}
    if outcome.rc != 0 or not result_path.is_file():
        return entry | {"error": f"exit {outcome.rc}", "tail": outcome.log}
    return entry | json.loads(result_path.read_text())
