"""The engine's one door, and the layers: checked on the source, without importing it.

Code outside `chatcore.engine` holds an `InferenceEngine` and nothing of what sits behind it: it
neither imports `EngineCore`, `Scheduler`, `BlockPool`, `KVCacheManager` (nor its parts) or `GrammarMatchers` (nor their
modules) nor reaches through an engine to them (`.core`, `.scheduler`, `.pool`, `.kv_cache`, `.grammars`).
The block pool's own package, `chatcore.cache`, is below the engine and defines `BlockPool`; the
benchmarks (`bench/`) measure the core itself. The door takes typed commands only: no `call`, `on_thread` or `core`.

Every unit (a package, or a top-level module) imports only the units docs/architecture.md's
`layers` block allows it: the documented graph is the code's graph, store, kernels, bench and the
top-level modules included. Its module table names every module of chatcore/ and kernels/, and
every file it names exists; docs/benchmarks.md names every module of bench/. Every scan walks the
package with its links (`chatcore/kernels`, `chatcore/bench`) followed (tests/shipped_sources.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.shipped_sources import REPO, ROOT, relative, shipped_files

BEHIND_THE_DOOR = {"EngineCore", "Scheduler", "BlockPool", "KVCacheManager", "SessionPins", "DiskInstalls",
                   "GrammarMatchers"}
HIDDEN_MODULES = {"chatcore.engine.core", "chatcore.engine.scheduler", "chatcore.cache.pool",
                  "chatcore.engine.kv_manager", "chatcore.engine.session_pins", "chatcore.engine.disk_installs",
                  "chatcore.engine.command_handlers", "chatcore.engine.grammar_matchers"}
REACH_THROUGH = {"core", "scheduler", "pool", "kv_cache", "_core", "grammars"}
INSIDE = ("engine", "cache", "bench")  # the units that may use what is behind the door


def module_name(path: Path) -> str:
    """`chatcore.x.y` for a file under chatcore/ (kernels/ and bench/ through their links)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    return module.split(".")[1]


def imported(tree: ast.AST, module: str) -> list[tuple[int, str, set[str]]]:
    """(line, module, names) of each import in `tree`; relative imports resolved against `module`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, set()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            found.append((node.lineno, base, {alias.name for alias in node.names}))
    return found


def door_violations(source: str, module: str) -> list[str]:
    """Where `source` (module `module`, outside the engine) gets behind the engine's door."""
    tree = ast.parse(source)
    out = []
    for line, name, names in imported(tree, module):
        if name in HIDDEN_MODULES or any(name == m.rsplit(".", 1)[0] and m.rsplit(".", 1)[1] in names
                                         for m in HIDDEN_MODULES):
            out.append(f"{module}:{line} imports {name}")
        if names & BEHIND_THE_DOOR:
            out.append(f"{module}:{line} imports {', '.join(sorted(names & BEHIND_THE_DOOR))}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in REACH_THROUGH:
            out.append(f"{module}:{node.lineno} reaches through .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in BEHIND_THE_DOOR:
            out.append(f"{module}:{node.lineno} names {node.id}")
    return out


def documented_layers() -> dict[str, set[str]]:
    """docs/architecture.md's `layers` block: `unit: allowed, units` per line."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no ```layers block"
    layers: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        unit, _, allowed = line.partition(":")
        layers[unit.strip()] = {u.strip() for u in allowed.split(",") if u.strip()}
    return layers


def layer_violations(source: str, module: str, layers: dict[str, set[str]]) -> list[str]:
    """Where `source` (module `module`) imports a unit its own may not."""
    unit = unit_of(module)
    out = []
    for line, name, names in imported(ast.parse(source), module):
        target = name.split(".")
        if target[0] != "chatcore":
            continue
        for used in [target[1]] if len(target) > 1 else sorted(names):
            if used != unit and used not in layers.get(unit, set()):
                out.append(f"{module}:{line} imports chatcore.{used}, which {unit} may not")
    return out


def sources() -> list[tuple[str, str]]:
    """Every module of the package: chatcore/, its links to kernels/ and bench/ followed."""
    return [(module_name(path), path.read_text(encoding="utf-8")) for path in shipped_files()]


def test_nothing_outside_the_engine_gets_behind_its_door() -> None:
    outside = [(m, s) for m, s in sources() if m != "chatcore" and unit_of(m) not in INSIDE]
    assert len(outside) > 20  # the scan sees the sessions, the server, the store...
    assert [v for m, s in outside for v in door_violations(s, m)] == []


def test_the_door_takes_commands_only() -> None:
    from chatcore.engine.engine import InferenceEngine

    public = {name for name in vars(InferenceEngine) if not name.startswith("_")}
    assert not public & {"call", "on_thread", "core", "blocks", "housekeeping"}, public
    assert "send" in public


def test_every_unit_imports_only_what_its_layer_allows() -> None:
    layers = documented_layers()
    found = sources()
    units = {unit_of(m) for m, _ in found if m != "chatcore"}
    assert {"store", "kernels", "bench", "outcomes", "config"} <= units
    assert units - set(layers) == set(), "units missing from docs/architecture.md's layers block"
    assert set(layers) - units == set(), "the layers block names units that do not exist"
    assert [v for m, s in found if m != "chatcore" for v in layer_violations(s, m, layers)] == []


def test_the_checks_catch_what_they_look_for() -> None:
    """Each way through the door, and an import the layers forbid, is reported (relative imports too)."""
    cases = {
        "from chatcore.engine.core import EngineCore": "imports chatcore.engine.core",
        "import chatcore.engine.scheduler": "imports chatcore.engine.scheduler",
        "from chatcore.cache import BlockPool": "imports BlockPool",
        "from chatcore.engine import core": "imports chatcore.engine",
        "from ..engine.scheduler import Scheduler": "imports chatcore.engine.scheduler",
        "from chatcore.engine.kv_manager import KVCacheManager": "imports chatcore.engine.kv_manager",
        "n = services.engine.core.vocab_size": "reaches through .core",
        "x = engine._core.kv_cache.pinned_sessions": "reaches through .kv_cache",
        "def f(s: 'x') -> None:\n    s.scheduler.check_fits(r)": "reaches through .scheduler",
        "await engine.grammars.compile_async(fmt, tenant)": "reaches through .grammars",
        "from chatcore.engine.grammar_matchers import GrammarMatchers": "imports chatcore.engine.grammar_matchers",
    }
    for source, expected in cases.items():
        assert any(expected in v for v in door_violations(source, "chatcore.sessions.turns")), source
    assert door_violations("from chatcore.engine.engine import InferenceEngine\nawait engine.send(Unpin(s))",
                           "chatcore.sessions.turns") == []
    layers = {"sessions": {"engine"}, "engine": {"cache"}}
    assert layer_violations("from chatcore.server.services import Services", "chatcore.sessions.turns", layers)
    assert layer_violations("from ..sessions import state", "chatcore.engine.core", layers)
    assert layer_violations("from chatcore import outcomes", "chatcore.engine.core", layers)
    assert layer_violations("from chatcore.cache import BlockTable", "chatcore.engine.core", layers) == []


def module_table(text: str) -> list[str]:
    """The files docs/architecture.md's `| module | owns | may call |` table names, relative to chatcore/.

    A cell lists backticked names; `engine/core.py` names its folder, and the names after it without
    one (`beam.py`) are in the same folder; `store/repos/*` is every module of that folder.
    """
    rows = text.split("| module | owns | may call |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    named = []
    for row in rows:
        folder = ""
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if "/" in name and (ROOT / name.split("/")[0]).is_dir():
                folder = name.split("/")[0]
                named.append(name)
            else:
                named.append(f"{folder}/{name}" if folder else name)
    return named


def table_gaps(named: list[str], modules: list[str]) -> tuple[list[str], list[str]]:
    """(modules, as paths under chatcore/, the table does not name; names that are no file)."""
    folders = [n.removesuffix("*") for n in named if n.endswith("/*")]
    missing = [m for m in modules if m not in named and not any(m.startswith(f) for f in folders)]
    gone = [n for n in named if not (n.endswith("/*") and (ROOT / n[:-2]).is_dir()) and not (ROOT / n).is_file()]
    return missing, gone


def _table_modules() -> list[str]:
    """Every module of chatcore/ (kernels/ linked in) as a path under it; bench/'s are in docs/benchmarks.md."""
    paths = [relative(p).removeprefix("chatcore/") for p in shipped_files()]
    return [p for p in paths if "/" in p and not p.startswith("bench/") and not p.endswith("__init__.py")
            or "/" not in p and p != "__init__.py"]


def test_the_module_table_names_every_module_and_no_gone_one() -> None:
    """docs/architecture.md's module table names every module of chatcore/ and kernels/, and each file it names exists."""
    named = module_table((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    modules = _table_modules()
    assert {"kernels/paged_decode.py", "engine/core.py", "cli.py"} <= set(modules)  # the links are followed
    assert table_gaps(named, modules) == ([], [])


def test_the_module_table_check_sees_gaps() -> None:
    table = ("| module | owns | may call |\n|---|---|---|\n| `engine/core.py`, `beam.py` | x | y |\n"
             "| `store/repos/*`, `db.py` | x | y |\n| `cli.py` | x | y |\n\nafter")
    named = module_table(table)
    assert named == ["engine/core.py", "engine/beam.py", "store/repos/*", "store/db.py", "cli.py"]
    assert table_gaps(named, ["engine/core.py", "engine/beam.py", "store/repos/turns.py", "store/db.py", "cli.py"]) \
        == ([], [])
    assert table_gaps(named + ["engine/gone.py"], ["engine/core.py", "engine/runner.py", "store/repos/turns.py"]) \
        == (["engine/runner.py"], ["engine/gone.py"])


def test_every_bench_module_is_documented() -> None:
    """docs/benchmarks.md names every module of bench/ (through the link)."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    missing = [m for m, _ in sources() if m.startswith("chatcore.bench.") and m.rsplit(".", 1)[-1] not in text]
    assert missing == []
