"""One owner for every KV table: `KVCacheManager._release` is the only code that releases one.

Checked on the source: a call `x.release()` with no arguments anywhere in chatcore (the block
tables' own method) sits in `chatcore/engine/kv_manager.py`'s `_release`, or is another object's
`release` named here with its reason. And the sessions layer holds no table: it names neither
`BlockTable` nor a table's methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

import chatcore

ROOT = Path(chatcore.__file__).parent
# Zero-argument `release()` calls that are not a table's: (module, enclosing function) -> why.
OTHER_RELEASES = {
    ("chatcore/sessions/leases.py", "stop"): "LeaseKeeper.release: this replica's session leases, in the database",
}


def _release_calls(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each `x.release()` call without arguments."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "release" and not node.args and not node.keywords:
                found.append((func.name, node.lineno))
    return sorted(set(found))


def test_a_table_is_released_in_one_place() -> None:
    calls = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        if rel.startswith("chatcore/cache/"):  # the table's own module: what release does
            continue
        for func, line in _release_calls(path):
            if (rel, func) not in OTHER_RELEASES:
                calls[f"{rel}:{line}"] = func
    assert calls == {f"chatcore/engine/kv_manager.py:{_line_of_release()}": "_release"}, calls


def _line_of_release() -> int:
    path = ROOT / "engine" / "kv_manager.py"
    return next(line for func, line in _release_calls(path) if func == "_release")


def test_the_sessions_hold_no_table() -> None:
    for path in sorted((ROOT / "sessions").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert "BlockTable" not in source and ".append_slots(" not in source and ".fork(" not in source, path
