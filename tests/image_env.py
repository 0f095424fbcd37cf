"""A Python that sees only some of this venv's distributions, as a lent GPU machine's image would.

A new venv (no pip, no system site-packages) whose site-packages holds links to the files of the named
distributions and of everything they require, transitively (their extras' requirements not). Any other
package of this venv fails to import there, as it would on the machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(roots: Iterable[str]) -> set[str]:
    """The canonical names of `roots` and of all they require in this environment."""
    seen: set[str] = set()
    todo = [canonicalize_name(name) for name in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The names directly in site-packages that `dist` installed (packages, modules, its .dist-info)."""
    entries = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] != ".." and not re.fullmatch(r"__pycache__|.*\.pth", parts[0]):
            entries.add(parts[0])
    return entries


def image_python(folder: Path, roots: Iterable[str]) -> Path:
    """Make the venv in `folder`; returns its python."""
    base_python = sys._base_executable  # type: ignore[attr-defined]  # the interpreter this venv was made from
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = Path(purelib)
    wanted = closure(roots)
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in wanted:
            continue
        base = Path(str(dist.locate_file("")))
        for entry in _top_level_entries(dist):
            if (base / entry).exists() and not (site / entry).exists():
                (site / entry).symlink_to(base / entry)
    return python
