"""The repository holds only its own files (issue 52): no build or install artefact is tracked, no
tracked file is larger than 1 MB without a reason listed here, and no tracked source or document
points a reader at a path outside the repository (a developer's notes, the team's shared folder)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 1 << 20
# Files allowed past MAX_BYTES, each with its reason. Empty: nothing tracked needs it today.
LARGE_WITH_REASON: dict[str, str] = {}
ARTEFACT = re.compile(r"\.(whl|so|so\.\d+|dylib|dll|exe|o|a|pyc|egg|tar|tar\.gz|tgz|tar\.bz2|tar\.xz|zip|7z|rar|"
                      r"gguf|safetensors|pt|pth|ckpt|onnx|npy|npz)$")
# A path on the developers' machines that no user has: their notes, the shared folder, the work tree.
OUTSIDE = re.compile(r"/work/|\.\./shared\b|\bshared/anchors|\bnotes/\w+\.md")
# Reports a run wrote, which record where that run read its inputs: data, not references for a reader.
RECORDED_PATHS = re.compile(r"^docs/bench/.*\.json$")


def _tracked() -> list[str]:
    result = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if result.returncode:
        pytest.skip(f"not a git checkout: {result.stderr.decode().strip()}")
    return [name for name in result.stdout.decode().split("\0") if name]


def test_the_tracked_files_are_listed() -> None:
    tracked = _tracked()
    assert {"pyproject.toml", "README.md", "Makefile"} <= set(tracked)


def test_no_build_or_install_artefact_is_tracked() -> None:
    assert [name for name in _tracked() if ARTEFACT.search(name)] == []


def test_no_tracked_file_is_large_without_a_reason() -> None:
    large = {name: (ROOT / name).stat().st_size for name in _tracked()
             if (ROOT / name).is_file() and not (ROOT / name).is_symlink()}
    assert {name: size for name, size in large.items() if size > MAX_BYTES and name not in LARGE_WITH_REASON} == {}


def test_every_reference_stays_inside_the_repository() -> None:
    found = []
    for name in _tracked():
        path = ROOT / name
        if name.startswith("tests/") or RECORDED_PATHS.match(name) or path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), 1)
                  if OUTSIDE.search(line)]
    assert found == []


@pytest.mark.parametrize(("name", "artefact"), [("numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl", True),
                                                ("kernels/cpu_kernels-0123.so", True), ("dist/chatcore-0.1.0.tar.gz", True),
                                                ("kernels/cpu_quant.c", False), ("docs/bench/sessions.png", False)])
def test_the_artefact_rule_names_what_it_means(name: str, artefact: bool) -> None:
    assert bool(ARTEFACT.search(name)) is artefact
