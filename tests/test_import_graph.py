"""The engine's one door, and the layers: checked on the source, without importing it.

Code outside `chatcore.engine` holds an `InferenceEngine` and nothing of what sits behind it: it
neither imports `EngineCore`, `Scheduler`, `BlockPool` or `KVCacheManager` (nor their modules) nor
reaches through an engine to them (`.core`, `.scheduler`, `.pool`, `.kv_cache`). The block pool's own
package, `chatcore.cache`, is below the engine and defines `BlockPool`; the benchmarks (`bench/`)
measure the core itself. The door takes typed commands only: no `call`, `on_thread` or `core`.

Every unit (a package, or a top-level module) imports only the units docs/architecture.md's
`layers` block allows it: the documented graph is the code's graph, store, kernels, bench and the
top-level modules included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import chatcore

ROOT = Path(chatcore.__file__).parent
REPO = ROOT.parent
BEHIND_THE_DOOR = {"EngineCore", "Scheduler", "BlockPool", "KVCacheManager"}
HIDDEN_MODULES = {"chatcore.engine.core", "chatcore.engine.scheduler", "chatcore.cache.pool",
                  "chatcore.engine.kv_manager", "chatcore.engine.command_handlers"}
REACH_THROUGH = {"core", "scheduler", "pool", "kv_cache", "_core"}
INSIDE = ("engine", "cache", "bench")  # the units that may use what is behind the door


def module_name(path: Path) -> str:
    """`chatcore.x.y` for a file under chatcore/, kernels/ or bench/ (the last two are linked into chatcore)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts if parts[0] == "chatcore" else ("chatcore", *parts)
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
    """Every module of the package: chatcore/ (whose links are not followed), kernels/ and bench/."""
    paths = [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in ("kernels", "bench")]
    paths += [p for folder in ("kernels", "bench") for p in (REPO / folder).rglob("*.py")]
    return [(module_name(path), path.read_text(encoding="utf-8")) for path in sorted(paths)]


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


def test_every_module_is_documented() -> None:
    """docs/architecture.md names every module of chatcore/ and kernels/ (bench/'s are in docs/benchmarks.md)."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [m for m, _ in sources() if m != "chatcore" and unit_of(m) != "bench" and m.rsplit(".", 1)[-1] not in text
               and not m.endswith("__init__")]
    assert missing == []
