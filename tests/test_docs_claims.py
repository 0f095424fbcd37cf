"""What the docs say of the code, checked on the source.

- The code carries no dated measurement: a figure measured on one day on one machine lives in
  docs/measurements.md, under a heading the code names (`docs/measurements.md, "Heading"`), so a
  docstring never goes stale with a machine or a version.
- A row of docs/architecture.md's module table whose "may call" column says "nothing of chatcore"
  (optionally "outside `unit`", or after naming units in backticks) is true of every module it names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.shipped_sources import REPO, ROOT, shipped_files

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
REFERENCE = re.compile(r'docs/measurements\.md,\s+"([^"]+)"')
CODE_SUFFIXES = (".py", ".c", ".h", ".js")


def code_files() -> list[Path]:
    """The sources of chatcore/ (its links to kernels/ and bench/ followed), the C kernels and web/."""
    return [*shipped_files(), *sorted((REPO / "kernels").glob("*.[ch]")),
            *sorted(p for p in (REPO / "web").rglob("*") if p.suffix in CODE_SUFFIXES)]


def test_the_code_carries_no_dated_measurement() -> None:
    files = code_files()
    assert len(files) > 100
    dated = [f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}"
             for path in files for text in [path.read_text(encoding="utf-8")] for m in DATE.finditer(text)]
    assert dated == [], "move these measurements to docs/measurements.md"


def test_every_measurement_the_code_names_is_in_the_docs() -> None:
    headings = set(re.findall(r"^## (.+)$", (REPO / "docs" / "measurements.md").read_text(encoding="utf-8"), re.M))
    named = {(path.relative_to(REPO).as_posix(), name) for path in code_files()
             for name in REFERENCE.findall(re.sub(r"\s+", " ", path.read_text(encoding="utf-8")))}
    assert len(named) >= 10
    assert sorted((path, name) for path, name in named if name not in headings) == []


def table_claims() -> list[tuple[list[str], set[str]]]:
    """(the modules a row names, as paths under chatcore/, the units it allows) for each row of the
    module table whose "may call" column says "nothing of chatcore" or "nothing else"."""
    rows = []
    for line in (REPO / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.search(r"nothing (of chatcore|else)", cells[2]):
            continue
        names = re.findall(r"`([\w/]+\.py)`", cells[0])
        folder = names[0].rpartition("/")[0] if "/" in names[0] else ""
        paths = [name if "/" in name or not folder else f"{folder}/{name}" for name in names]
        rows.append((paths, set(re.findall(r"`(\w+)`", cells[2]))))
    return rows


def chatcore_units(path: Path) -> set[str]:
    """The units of chatcore (`outcomes`, `engine`, ...) that the module at `path` imports."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        units |= {name.split(".")[1] for name in names if name.startswith("chatcore.")}
    return units


def test_rows_that_say_nothing_of_chatcore_are_true() -> None:
    claims = table_claims()
    assert len(claims) >= 3  # the small top-level modules, the log filters, chatcore chat
    wrong = []
    for paths, allowed in claims:
        for relative in paths:
            path = ROOT / relative
            assert path.is_file(), relative
            own = relative.split("/")[0] if "/" in relative else path.stem
            extra = chatcore_units(path) - allowed - {own}
            wrong += [f"{relative} imports chatcore.{unit}" for unit in sorted(extra)]
    assert wrong == []
