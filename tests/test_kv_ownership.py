"""One owner for every KV table: `KVCacheManager._release` is the only code that releases one.

Checked on the source: a call `x.release()` with no arguments anywhere in chatcore, the linked
`kernels/` and `bench/` included (the block tables' own method), sits in
`chatcore/engine/kv_manager.py`'s `_release`, or is another object's `release`, or a benchmark's
bare table, named here with its reason (and every such name is still in use). And the sessions layer holds no table: it names neither
`BlockTable` nor a table's methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.shipped_sources import ROOT, relative, shipped_files

# Zero-argument `release()` calls outside the manager: (module, enclosing function) -> why.
# The benchmarks' ones measure the block bookkeeping alone: each builds bare `BlockTable`s over a
# bare `BlockPool` of its own, with no engine and so no manager to route through.
BARE_POOL = "bench: a bare BlockTable over the benchmark's own bare BlockPool, no engine (bookkeeping alone)"
OTHER_RELEASES = {
    ("chatcore/sessions/leases.py", "stop"): "LeaseKeeper.release: this replica's session leases, in the database",
    ("chatcore/bench/replay.py", "pool_hits"): BARE_POOL + ": each trace request's table, once committed",
    ("chatcore/bench/memory.py", "extend"): BARE_POOL + ": a new session's table the pool cannot extend",
    ("chatcore/bench/memory.py", "drop"): BARE_POOL + ": a session leaving the memory replay",
    ("chatcore/bench/hitrate.py", "replay"): BARE_POOL + ": each turn's table, once committed (or refused)",
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
    named = set()
    for path in shipped_files():
        rel = relative(path)
        if rel.startswith("chatcore/cache/"):  # the table's own module: what release does
            continue
        for func, line in _release_calls(path):
            if (rel, func) in OTHER_RELEASES:
                named.add((rel, func))
            else:
                calls[f"{rel}:{line}"] = func
    assert named == set(OTHER_RELEASES)  # the bench's (through the link) included: none is stale
    assert calls == {f"chatcore/engine/kv_manager.py:{_line_of_release()}": "_release"}, calls


def _line_of_release() -> int:
    path = ROOT / "engine" / "kv_manager.py"
    return next(line for func, line in _release_calls(path) if func == "_release")


def test_the_sessions_hold_no_table() -> None:
    for path in shipped_files(ROOT / "sessions"):
        source = path.read_text(encoding="utf-8")
        assert "BlockTable" not in source and ".append_slots(" not in source and ".fork(" not in source, path
