"""Importing anything the wheel ships needs no development-only package.

The development-only packages are pyproject's `dev` extra less everything the runtime
dependencies install (their requirements followed, extras included: transformers brings PyYAML).
A fresh interpreter imports every module under chatcore/, the linked `kernels/` and `bench/`
included, and none of those packages may then be loaded: a wheel installed without `[dev]`
imports the same modules.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from tests.shipped_sources import REPO, relative, shipped_files


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _installed_by(requirements: list[str]) -> set[str]:
    """Every distribution `requirements` install, their own requirements followed."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _name(req.name)
        extras = sorted(req.extras)
        if (name, tuple(extras)) in seen:
            continue
        seen.add((name, tuple(extras)))
        try:
            needs = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(r), e) for r in needs for e in ["", *extras]]
    return {name for name, _ in seen}


def dev_only_imports() -> set[str]:
    """The top-level import names of the `dev` extra's packages that no runtime dependency installs."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    dev = {_name(Requirement(r).name) for r in project["optional-dependencies"]["dev"]}
    only = dev - _installed_by(project["dependencies"])
    return {top for top, dists in metadata.packages_distributions().items()
            if any(_name(d) in only for d in dists)}


def _modules() -> list[str]:
    return [relative(p).removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in shipped_files()]


def test_the_shipped_modules_import_no_dev_package() -> None:
    dev_only = dev_only_imports()
    assert {"matplotlib", "pytest", "hypothesis"} <= dev_only  # the check knows what it forbids
    assert "yaml" not in dev_only  # a runtime dependency's (transformers') own requirement
    modules = _modules()
    assert {"chatcore.bench.plots", "chatcore.kernels.dispatch", "chatcore.server.app"} <= set(modules)
    script = ("import importlib, json, sys\n"
              f"for m in {modules!r}: importlib.import_module(m)\n"
              "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert loaded & dev_only == set()


def test_bench_says_plots_need_matplotlib_and_writes_the_rest(tmp_path: Path) -> None:
    """Where matplotlib does not import, `chatcore bench` says so once, draws nothing and still writes
    results.json and table.md (the hit-rate suite: no server)."""
    script = ("import sys\nsys.modules['matplotlib'] = None  # `import matplotlib` raises ImportError\n"
              "from chatcore.cli import main\n"
              f"sys.exit(main(['bench', '--suite', 'hitrate', '--quick', '--no-fail', '--out', {str(tmp_path)!r}]))")
    env = {**os.environ, "CHATCORE_BENCH_TINY": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("plots need matplotlib") == 1, done.stdout[-3000:]
    suite = json.loads((tmp_path / "results.json").read_text())["suites"]["hitrate"]
    assert suite["targets"] and suite["plots"] == []
    assert (tmp_path / "table.md").read_text().startswith("Measured on")
    assert list(tmp_path.glob("*.png")) == []
