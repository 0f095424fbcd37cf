"""One tiny `chatcore bench --suite all --quick` run (CHATCORE_BENCH_TINY=1), shared by the tests of
tests/test_bench.py: the run starts real servers and costs about two minutes, so the suite makes
it once. Its users stay in that one file: `make test` runs pytest-xdist with `--dist loadfile`,
and a session fixture is made once per worker that needs it. (A pytest plugin of tests/conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class BenchRun:
    out: Path
    proc: subprocess.CompletedProcess[str]

    @property
    def results(self) -> dict[str, Any]:
        return json.loads((self.out / "results.json").read_text())


@pytest.fixture(scope="session")
def bench_all_quick_tiny(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> BenchRun:
    out = tmp_path_factory.mktemp("bench-all")
    env = {**os.environ, "CHATCORE_BENCH_TINY": "1", "TOKENIZERS_PARALLELISM": "false"}
    # The installed console script, from outside the checkout: `bench` must be part of the install.
    script = Path(sys.executable).with_name("chatcore")
    proc = subprocess.run([str(script), "bench", "--suite", "all", "--quick", "--no-fail", "--out", str(out)],
                          cwd=out, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return BenchRun(out, proc)
