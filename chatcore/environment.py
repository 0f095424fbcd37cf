"""The installed packages against what chatcore needs, checked before a command runs.

Two references:
- chatcore's own requirements (pyproject.toml's ranges, read from the installed metadata): a
  package missing or outside its range stops every command with one line per package, naming it,
  the version installed and the range needed; never the traceback of a failed import later.
- the lock (requirements.lock at the checkout's root), which `make setup` installs and CI tests
  with: from a checkout, a package at another version than the lock's is one warning line per
  package, naming both versions. A wheel installed elsewhere has no lock and is not compared.

A lock line is `name==version` with an optional environment marker; torch's is its public
version, which a CPU or a CUDA build (`2.13.0+cpu`, `2.13.0+cu128`) satisfies (PEP 440).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from chatcore.models.fetch import GGUF_PACKAGE
from chatcore.resources import CHECKOUT

DISTRIBUTION = "chatcore"
LOCK_NAME = "requirements.lock"
BENCH_PEER = "llama-cpp-python"  # `make bench-peers` installs it into the venv, off the lock (Makefile)
# Requirements whose absence no command notices: only the GPU path (and Triton's interpreter) imports
# triton, so a CPU machine serves without it. A version out of range is still reported.
MAY_BE_ABSENT = frozenset({"triton"})


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def requirement_problems(requirements: Iterable[str] | None = None) -> list[str]:
    """One line per requirement of chatcore (not its extras') that the environment does not meet."""
    if requirements is None:
        try:
            requirements = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:  # run from a checkout that was never installed
            return []
    problems = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        installed = _installed(req.name)
        needed = f"{req.name}{req.specifier}" if req.specifier else req.name
        if installed is None and canonicalize_name(req.name) not in MAY_BE_ABSENT:
            problems.append(f"{req.name} is not installed; chatcore needs {needed}")
        elif installed is not None and not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req.name} {installed} is installed; chatcore needs {needed}")
    return problems


def read_lock(path: Path) -> list[Pin]:
    """The lock's pins that apply to this interpreter and platform."""
    pins = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        (spec,) = req.specifier
        if spec.operator != "==":
            raise ValueError(f"{path.name}: {line!r} is not an exact pin")
        pins.append(Pin(canonicalize_name(req.name), spec.version))
    return pins


def lock_differences(pins: list[Pin]) -> list[str]:
    """One line per locked package that is missing or at another version."""
    out = []
    for pin in pins:
        installed = _installed(pin.name)
        if installed is None:
            out.append(f"{pin.name} is not installed; {LOCK_NAME} pins {pin.version}")
        elif not SpecifierSet(f"=={pin.version}").contains(installed, prereleases=True):
            out.append(f"{pin.name} {installed} is installed; {LOCK_NAME} pins {pin.version}")
    return out


def unlocked_packages(pins: list[Pin]) -> list[str]:
    """Installed distributions that the lock does not name, less chatcore, the default model's package
    (`chatcore model fetch` installs it without its dependencies), the benchmarks' peer (`make
    bench-peers` builds it into the same venv) and those that a locked package's or the peer's
    installed build requires (a CUDA build of torch brings its nvidia-* libraries)."""
    locked = {pin.name for pin in pins}
    allowed = locked | {DISTRIBUTION, canonicalize_name(Requirement(GGUF_PACKAGE).name), BENCH_PEER}
    names = set()
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        names.add(name)
        if name in locked or name == BENCH_PEER:
            allowed |= {canonicalize_name(req.name) for req in map(Requirement, dist.requires or [])
                        if req.marker is None or req.marker.evaluate({"extra": ""})}
    return sorted(names - allowed)


def checkout_lock() -> Path | None:
    """The lock beside the code when chatcore runs from a checkout (an editable install), else None."""
    path = CHECKOUT / LOCK_NAME
    return path if path.is_file() and (CHECKOUT / "pyproject.toml").is_file() else None


def check_at_start() -> bool:
    """Print what is wrong with the environment to stderr; False when a requirement is unmet."""
    problems = requirement_problems()
    for line in problems:
        print(f"chatcore: {line}", file=sys.stderr)
    lock = checkout_lock()
    if lock is not None:
        for line in lock_differences(read_lock(lock)):
            print(f"chatcore: warning: {line} (`make setup` installs the lock)", file=sys.stderr)
    return not problems


def main(argv: list[str] | None = None) -> int:
    """`python -m chatcore.environment --lock FILE`: exit 1 unless the venv is exactly the lock."""
    parser = argparse.ArgumentParser(prog="python -m chatcore.environment")
    parser.add_argument("--lock", type=Path, required=True)
    args = parser.parse_args(argv)
    pins = read_lock(args.lock)
    lines = requirement_problems() + lock_differences(pins)
    lines += [f"{name} is installed; {LOCK_NAME} does not name it" for name in unlocked_packages(pins)]
    for line in lines:
        print(f"chatcore: {line}", file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
