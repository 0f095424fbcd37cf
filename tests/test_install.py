"""The install: the venv is the lock, and a package at the wrong version is one line at start, not a traceback.

A wrong version is staged without touching the venv: a folder put first on PYTHONPATH holds a
`.dist-info` of the package at another version, which `importlib.metadata` then finds first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from chatcore.environment import lock_differences, read_lock, requirement_problems

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"


def _run(args: list[str], pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _fake_install(folder: Path, name: str, version: str) -> Path:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def test_the_venv_is_exactly_the_lock() -> None:
    done = _run(["-m", "chatcore.environment", "--lock", str(LOCK)])
    assert done.returncode == 0, done.stderr


def test_the_lock_pins_every_package_to_one_version() -> None:
    pins = read_lock(LOCK)
    names = [pin.name for pin in pins]
    assert len(names) == len(set(names))
    assert {"torch", "transformers", "kernels", "litestar", "sqlalchemy", "alembic", "pip-tools"} <= set(names)
    assert next(pin.version for pin in pins if pin.name == "torch").count("+") == 0  # a CPU or a CUDA build


def test_a_package_off_the_lock_is_named_with_both_versions(tmp_path: Path) -> None:
    done = _run(["-m", "chatcore.environment", "--lock", str(LOCK)], _fake_install(tmp_path, "idna", "0.1"))
    pinned = next(pin.version for pin in read_lock(LOCK) if pin.name == "idna")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"chatcore: idna 0.1 is installed; requirements.lock pins {pinned}"]


def test_the_bench_peer_and_what_it_requires_are_allowed_off_the_lock(tmp_path: Path) -> None:
    """`make bench-peers` builds llama-cpp-python into the venv with its requirements: not named; any
    other package off the lock still is."""
    for name, requires in (("llama-cpp-python", "diskcache>=5"), ("diskcache-like", ""), ("diskcache", "")):
        _fake_install(tmp_path, name, "9.9")
        if requires:
            metadata = tmp_path / f"{name.replace('-', '_')}-9.9.dist-info" / "METADATA"
            metadata.write_text(metadata.read_text() + f"Requires-Dist: {requires}\n")
    done = _run(["-m", "chatcore.environment", "--lock", str(LOCK)], tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["chatcore: diskcache-like is installed; requirements.lock does not name it"]


def test_a_command_warns_in_one_line_when_a_package_is_off_the_lock(tmp_path: Path) -> None:
    done = _run(["-m", "chatcore.cli", "config", "show"], _fake_install(tmp_path, "idna", "0.1"))
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("chatcore: warning: idna 0.1 is installed; requirements.lock pins ")


def test_a_conflicting_requirement_stops_the_command_in_one_line(tmp_path: Path) -> None:
    done = _run(["-m", "chatcore.cli", "serve"], _fake_install(tmp_path, "msgspec", "0.1"))
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0].startswith("chatcore: msgspec 0.1 is installed; chatcore needs msgspec>=")
    assert "Traceback" not in done.stderr


def test_requirement_and_lock_checks_name_what_is_missing(tmp_path: Path) -> None:
    assert requirement_problems(["no-such-package-xyz>=1", "pytest>=1", "triton>=99; sys_platform == 'nowhere'"]) \
        == ["no-such-package-xyz is not installed; chatcore needs no-such-package-xyz>=1"]
    lock = tmp_path / "requirements.lock"
    lock.write_text("pytest==0.0.1\n    # via -r\nno-such-package-xyz==1.0\n")
    assert lock_differences(read_lock(lock)) == [
        f"pytest {__import__('pytest').__version__} is installed; requirements.lock pins 0.0.1",
        "no-such-package-xyz is not installed; requirements.lock pins 1.0"]
