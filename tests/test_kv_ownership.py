"""One owner for every KV table: the KV cache manager (`chatcore/engine/kv_manager.py`) keeps them all,
and `KVCacheManager._release` is the only code that releases one.

Checked on the source of everything the wheel ships (chatcore/, the linked `kernels/` and `bench/`
included), outside the manager and `chatcore/cache/` (which defines tables):
* a call `x.release()` with no arguments (the block tables' own method) is another object's
  `release`, named here with its reason (and every such name is still in use); in the manager it sits
  in `_release` alone;
* no module names `BlockTable`, reads or writes an attribute `.table`, passes a `table=` keyword, or
  calls a table's methods (`from_prefix`, `append_slots`, `blocks_needed`): callers name a request and
  a sequence, and the manager answers (`allocate_slots`, `block_ids`, `cache_blocks`, `fork`, `free`);
* the scheduler neither imports the block pool nor reads its capacity: it asks the manager.
The self-test at the end shows each check catches what it is for.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.shipped_sources import ROOT, relative, shipped_files

MANAGER = "chatcore/engine/kv_manager.py"
# Zero-argument `release()` calls outside the manager: (module, enclosing function) -> why.
OTHER_RELEASES = {
    ("chatcore/sessions/leases.py", "stop"): "LeaseKeeper.release: this replica's session leases, in the database",
}
TABLE_METHODS = {"from_prefix", "append_slots", "blocks_needed"}
POOL_CAPACITY = {"pool", "can_allocate", "low_watermark_blocks", "num_available"}  # the manager has its own `can_admit`


def _release_calls(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of each `x.release()` call without arguments."""
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "release" and not node.args and not node.keywords:
                found.append((func.name, node.lineno))
    return sorted(set(found))


def table_touches(source: str) -> list[str]:
    """Where `source` touches a block table itself: `BlockTable`, `.table`, `table=`, a table's methods."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name) and node.id == "BlockTable" \
                or isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] == "BlockTable":
            found.append(f"{line}: names BlockTable")
        elif isinstance(node, ast.Attribute) and node.attr == "table":
            found.append(f"{line}: .table")
        elif isinstance(node, ast.keyword) and node.arg == "table":
            found.append(f"{line}: table=")
        elif isinstance(node, ast.Attribute) and node.attr in TABLE_METHODS:
            found.append(f"{line}: .{node.attr}")
    return found


def _outside_the_owner() -> list[Path]:
    return [path for path in shipped_files()
            if not relative(path).startswith("chatcore/cache/") and relative(path) != MANAGER]


def test_a_table_is_released_in_one_place() -> None:
    calls = {}
    named = set()
    for path in _outside_the_owner():
        rel = relative(path)
        for func, line in _release_calls(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, func) in OTHER_RELEASES:
                named.add((rel, func))
            else:
                calls[f"{rel}:{line}"] = func
    assert named == set(OTHER_RELEASES)  # none is stale
    assert calls == {}, calls
    in_manager = _release_calls(ast.parse((ROOT / "engine" / "kv_manager.py").read_text(encoding="utf-8")))
    assert [func for func, _ in in_manager] == ["_release"], in_manager


def test_no_module_but_the_manager_touches_a_table() -> None:
    touches = {relative(path): table_touches(path.read_text(encoding="utf-8")) for path in _outside_the_owner()}
    assert {rel: found for rel, found in touches.items() if found} == {}
    # the walk reaches the linked folders, where the benchmarks' replays hold tables too
    assert {"chatcore/bench/replay.py", "chatcore/bench/memory.py", "chatcore/bench/hitrate.py"} <= set(touches)


def test_the_scheduler_asks_the_manager_for_capacity() -> None:
    tree = ast.parse((ROOT / "engine" / "scheduler.py").read_text(encoding="utf-8"))
    imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imports if m and m.startswith("chatcore.cache")}, imports
    reads = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & POOL_CAPACITY
    assert reads == set(), reads


def test_the_sessions_hold_no_table() -> None:
    for path in shipped_files(ROOT / "sessions"):
        source = path.read_text(encoding="utf-8")
        assert "BlockTable" not in source and ".append_slots(" not in source and ".fork(" not in source, path


def test_the_checks_catch_what_they_are_for() -> None:
    assert table_touches("from chatcore.cache import BlockTable") == ["1: names BlockTable"]
    assert table_touches("import chatcore.cache.table.BlockTable") == ["1: names BlockTable"]
    assert table_touches("seq.table.commit(t, n, s)") == ["1: .table"]
    assert table_touches("seq.table = None") == ["1: .table"]
    assert table_touches("TokenSequence(0, [], 0, table=t)") == ["1: table="]
    assert table_touches("t = T.from_prefix(p, [], [])\nt.append_slots(3)\nt.blocks_needed(1)") == \
        ["1: .from_prefix", "2: .append_slots", "3: .blocks_needed"]
    assert table_touches("self.kv_cache.allocate_slots(req, seq, 1)\nx.tables") == []
    assert _release_calls(ast.parse("def f(t):\n    t.release()\n    lock.release(1)\n")) == [("f", 2)]
