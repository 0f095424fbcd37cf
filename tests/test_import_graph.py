"""The engine's one door, and the layers: checked on the source, without importing it.

Code outside `chatcore.engine` holds an `InferenceEngine` and nothing of what sits behind it: it
neither imports `EngineCore`, `Scheduler` or `BlockPool` (nor their modules) nor reaches through
an engine to them (`.core`, `.scheduler`, `.pool`). The block pool's own package, `chatcore.cache`,
is below the engine and defines `BlockPool`. And no layer of cache -> kv -> models -> engine ->
sessions -> server imports one above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import chatcore

ROOT = Path(chatcore.__file__).parent
BEHIND_THE_DOOR = {"EngineCore", "Scheduler", "BlockPool"}
HIDDEN_MODULES = {"chatcore.engine.core", "chatcore.engine.scheduler", "chatcore.cache.pool"}
REACH_THROUGH = {"core", "scheduler", "pool"}
INSIDE = ("engine", "cache")  # the packages that may use what is behind the door
LAYERS = ["cache", "kv", "models", "engine", "sessions", "server"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


def layer_violations(source: str, module: str) -> list[str]:
    """Where `source` (module `module`) imports a layer above its own."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return []
    rank = LAYERS.index(parts[1])
    out = []
    for line, name, _ in imported(ast.parse(source), module):
        target = name.split(".")
        if target[0] == "chatcore" and len(target) > 1 and target[1] in LAYERS \
                and LAYERS.index(target[1]) > rank:
            out.append(f"{module}:{line} imports {name}, a layer above {parts[1]}")
    return out


def sources() -> list[tuple[str, str]]:
    return [(module_name(path), path.read_text(encoding="utf-8")) for path in sorted(ROOT.rglob("*.py"))]


def test_nothing_outside_the_engine_gets_behind_its_door() -> None:
    outside = [(m, s) for m, s in sources() if m.split(".")[1:2] not in ([p] for p in INSIDE)]
    assert len(outside) > 20  # the scan sees the sessions, the server, the store...
    assert [v for m, s in outside for v in door_violations(s, m)] == []


def test_no_layer_imports_one_above_it() -> None:
    assert [v for m, s in sources() for v in layer_violations(s, m)] == []


def test_the_checks_catch_what_they_look_for() -> None:
    """Each way through the door, and an upward import, is reported (relative imports too)."""
    cases = {
        "from chatcore.engine.core import EngineCore": "imports chatcore.engine.core",
        "import chatcore.engine.scheduler": "imports chatcore.engine.scheduler",
        "from chatcore.cache import BlockPool": "imports BlockPool",
        "from chatcore.engine import core": "imports chatcore.engine",
        "from ..engine.scheduler import Scheduler": "imports chatcore.engine.scheduler",
        "n = services.engine.core.vocab_size": "reaches through .core",
        "x = engine.blocks._core.pool.num_blocks": "reaches through .pool",
        "def f(s: 'x') -> None:\n    s.scheduler.check_fits(r)": "reaches through .scheduler",
    }
    for source, expected in cases.items():
        assert any(expected in v for v in door_violations(source, "chatcore.sessions.turns")), source
    assert door_violations("from chatcore.engine.engine import InferenceEngine\nengine.blocks.claim(g, ids)",
                           "chatcore.sessions.turns") == []
    assert layer_violations("from chatcore.server.services import Services", "chatcore.sessions.turns")
    assert layer_violations("from ..sessions import state", "chatcore.engine.core")
    assert layer_violations("from chatcore.cache import BlockTable", "chatcore.engine.core") == []
