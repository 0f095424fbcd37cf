"""The Python files the wheel ships: chatcore/, its links (`kernels`, `bench`) followed.

`chatcore/kernels` and `chatcore/bench` are links to the repository's `kernels/` and `bench/`
(docs/architecture.md, "One import name"); `Path.rglob` does not follow links, so a check on the
package that used it would skip both. Every source check walks the package through this module.
"""

from __future__ import annotations

import os
from pathlib import Path

import chatcore

ROOT = Path(chatcore.__file__).parent
REPO = ROOT.parent


def shipped_files(folder: Path = ROOT) -> list[Path]:
    """Every `*.py` under `folder` (by default chatcore/), links followed, as paths under it."""
    found = []
    for directory, subdirs, files in os.walk(folder, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        found += [Path(directory) / name for name in files if name.endswith(".py")]
    return sorted(found)


def relative(path: Path) -> str:
    """`chatcore/bench/replay.py`: the path as the package sees it (through the link)."""
    return path.relative_to(REPO).as_posix()
