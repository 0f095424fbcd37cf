"""One owner for every KV table: the KV cache manager (`chatcore/engine/kv_manager.py`) keeps them all,
with the two parts it composes, each holding only its own (`session_pins.py`: the sessions' pins;
`disk_installs.py`: the disk tier's installs and prefetches), and `KVCacheManager._release` is the
only code that releases one.

Checked on the source of everything the wheel ships (chatcore/, the linked `kernels/` and `bench/`
included), outside the manager, its parts and `chatcore/cache/` (which defines tables):
* a call `x.release()` with no arguments (the block tables' own method) is another object's
  `release`, named here with its reason (and every such name is still in use); in the manager it sits
  in `_release` alone, and the parts call none (they are handed `_release`);
* no module names `BlockTable`, reads or writes an attribute `.table`, passes a `table=` keyword, or
  calls a table's methods (`from_prefix`, `append_slots`, `blocks_needed`): callers name a request and
  a sequence, and the manager answers (`allocate_slots`, `block_ids`, `cache_blocks`, `fork`, `free`);
* only the manager builds its parts;
* the scheduler neither imports the block pool nor reads its capacity: it asks the manager; the
  command handlers reach the pool only through the manager (resize, stats, prefix-cache reset);
* a table's owner is typed (`chatcore/cache/owners.py`): no module anywhere gives one a string, or
  calls a method on an `.owner` (parsing a name back).
And on a live pool (a bare one, and a running engine's at every step), the registry
(`BlockPool.tables`) holds only typed owners, each accounted for by what the manager holds: a running
request's sequence, a held prefix, a session's pin.
The self-test at the end shows each static check catches what it is for.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from chatcore.cache import BlockPool, PinOwner, PrefixOwner, SequenceOwner, TableOwner, audit, cache_salt
from chatcore.engine.commands import SessionPrefix
from chatcore.engine.core import EngineCore
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.outcomes import FinishReason
from tests.engine_helpers import QUESTIONS, chat_ids, run_to_end
from tests.shipped_sources import ROOT, relative, shipped_files

MANAGER = "chatcore/engine/kv_manager.py"
PARTS = {"chatcore/engine/session_pins.py": "SessionPins", "chatcore/engine/disk_installs.py": "DiskInstalls"}
# Zero-argument `release()` calls outside the manager: (module, enclosing function) -> why.
OTHER_RELEASES = {
    ("chatcore/sessions/leases.py", "stop"): "LeaseKeeper.release: this replica's session leases, in the database",
}
TABLE_METHODS = {"from_prefix", "append_slots", "blocks_needed"}
POOL_CAPACITY = {"pool", "can_allocate", "low_watermark_blocks", "num_available"}  # the manager has its own `can_admit`
SALT = cache_salt("test-kv-ownership", 4, "none")


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
            if not relative(path).startswith("chatcore/cache/") and relative(path) not in {MANAGER, *PARTS}]


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
    for part in PARTS:
        assert _release_calls(ast.parse((ROOT.parent / part).read_text(encoding="utf-8"))) == [], part


def test_only_the_manager_builds_its_parts() -> None:
    built = {}
    for path in shipped_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PARTS.values():
                built.setdefault(node.func.id, set()).add(relative(path))
    assert built == {name: {MANAGER} for name in PARTS.values()}


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


def test_the_command_handlers_reach_the_pool_through_the_manager() -> None:
    tree = ast.parse((ROOT / "engine" / "command_handlers.py").read_text(encoding="utf-8"))
    imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imports if m and m.startswith("chatcore.cache")}, imports
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "pool"]


def owner_strings(source: str) -> list[str]:
    """Where `source` gives a table's owner a string (`owner=`, `.owner =`), or calls a method on an
    `.owner` (a name parsed back)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.keyword) and node.arg == "owner" and _is_text(node.value):
            found.append(f"{line}: owner= a string")
        elif isinstance(node, ast.Assign) and _is_text(node.value) and any(
                isinstance(t, ast.Attribute) and t.attr == "owner" for t in node.targets):
            found.append(f"{line}: .owner = a string")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "owner":
            found.append(f"{line}: .owner.{node.func.attr}()")
    return sorted(found, key=lambda where: int(where.partition(":")[0]))


def _is_text(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and isinstance(node.value, str) \
        or isinstance(node, ast.BinOp) and (_is_text(node.left) or _is_text(node.right))


def test_table_owners_are_typed_and_never_parsed() -> None:
    found = {relative(path): owner_strings(path.read_text(encoding="utf-8")) for path in shipped_files()}
    assert {rel: where for rel, where in found.items() if where} == {}


def _turn(kv_cache: KVCacheManager, request_id: str, prompt: list[int], session_id: str | None = None,
          prefix: SessionPrefix | None = None) -> Request:
    """A request prepared (its prefix held, if any), admitted and given slots for its prompt."""
    req = Request(request_id, prompt, SamplingParams(max_tokens=4), salt=SALT, session_id=session_id)
    if prefix is not None:
        assert kv_cache.prepare(req, prefix) is None
    kv_cache.get_computed_blocks(req, req.seqs)
    assert kv_cache.can_admit(req, alone=False)
    kv_cache.admit(req)
    seq = req.seqs[0]
    assert kv_cache.allocate_slots(req, seq, seq.to_compute) is not None
    seq.num_computed = len(seq.tokens)
    kv_cache.cache_blocks(req, seq)
    return req


def test_the_registry_holds_typed_owners_each_accounted_for() -> None:
    pool = BlockPool(64, 4, low_watermark=0.0, high_watermark=0.0)
    kv_cache = KVCacheManager(pool, None, hot_window_s=60.0)
    for request_id, session_id in (("t1", "s1"), ("t2", "s2")):  # two sessions' finished turns: their pins
        turn = _turn(kv_cache, request_id, list(range(10)) if session_id == "s1" else list(range(50, 60)), session_id)
        turn.seqs[0].finish_reason = FinishReason.STOP
        kv_cache.free(turn)
    sampled = _turn(kv_cache, "sampled", list(range(100, 110)))
    child = TokenSequence(1, list(sampled.seqs[0].tokens), 10, num_computed=10)
    kv_cache.fork(sampled, sampled.seqs[0], child)  # a second sample shares the first's blocks
    sampled.seqs.append(child)
    following = Request("next", [*range(10), *range(200, 206)], SamplingParams(max_tokens=4), salt=SALT,
                        session_id="s1")
    assert kv_cache.prepare(following, SessionPrefix("s1")) is None  # s1's pin, now held for its next turn
    owners = [table.owner for table in pool.tables]
    assert all(isinstance(owner, TableOwner) for owner in owners), owners
    # exactly what the manager holds: the running request's samples, the held prefix, the one pin left
    assert sorted(owners, key=str) == sorted([SequenceOwner("sampled", 0), SequenceOwner("sampled", 1),
                                              PrefixOwner("next"), PinOwner("s2")], key=str)
    for table in pool.tables:
        match table.owner:
            case SequenceOwner(index=index):
                assert kv_cache.block_ids(sampled, sampled.seqs[index]) == tuple(table.block_ids)
            case PinOwner(session_id=session):
                assert kv_cache.pinned_sessions == [session] and kv_cache.pins.blocks(session) == len(table)
            case PrefixOwner():
                assert kv_cache.get_computed_blocks(following, following.seqs) == len(table)
                kv_cache.unwind(following)
    report = audit(pool)  # every block in use is mapped by these tables, and by nothing else
    assert report.ok and report.used > 0 and report.sum_refs == report.sum_table_lens, report.format()
    for req in (sampled, following):
        kv_cache.free(req)
    kv_cache.pins.unpin("s2")
    assert pool.tables == [] and pool.num_used == 0


def _registry_accounted_for(core: EngineCore) -> list[TableOwner]:
    """Check each table in the pool's registry against what the engine holds; returns the owners."""
    kv_cache, owners = core.kv_cache, [table.owner for table in core.pool.tables]
    assert all(isinstance(owner, TableOwner) for owner in owners) and len(set(owners)) == len(owners), owners
    for table in core.pool.tables:
        match table.owner:
            case SequenceOwner(request_id=request_id, index=index):
                req = core.requests[request_id]
                (seq,) = [seq for seq in req.seqs if seq.index == index]
                assert kv_cache.block_ids(req, seq) == tuple(table.block_ids)
            case PrefixOwner(request_id=request_id):
                assert core.requests[request_id] in core.scheduler.waiting
            case PinOwner(session_id=session_id):
                assert session_id in kv_cache.pinned_sessions and kv_cache.pins.blocks(session_id) == len(table)
            case other:
                raise AssertionError(f"{other} outlived its command")
    return owners


@pytest.mark.model
def test_a_running_engines_registry_is_accounted_for_at_every_step(make_core, loaded_fp32) -> None:
    core = make_core()
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    first = core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0]), greedy)
    first.session_id = "s1"
    core.add(first)
    run_to_end(core)
    assert _registry_accounted_for(core) == [PinOwner("s1")]
    follow_up = core.make_request([*first.seqs[0].tokens, *chat_ids(loaded_fp32.tokenizer, QUESTIONS[2])], greedy)
    follow_up.session_id = "s1"
    core.add(follow_up, SessionPrefix("s1"))
    assert _registry_accounted_for(core) == [PrefixOwner(follow_up.request_id)]
    samples = core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[1]),
                                SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3, ignore_eos=True))
    core.add(samples)
    seen: set[type] = set()
    core.on_step.append(lambda plan: seen.update(type(owner) for owner in _registry_accounted_for(core)))
    run_to_end(core)
    assert seen == {SequenceOwner, PinOwner}  # the samples' forks ran, and the follow-up's turn was pinned
    assert _registry_accounted_for(core) == [PinOwner("s1")]
    core.kv_cache.pins.unpin("s1")


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
    assert owner_strings("BlockTable(p, owner=f'{r}/{i}')\nt.owner = 'session:' + s\nt.owner.split('/')") == \
        ["1: owner= a string", "2: .owner = a string", "3: .owner.split()"]
    assert owner_strings("BlockTable(p, owner=SequenceOwner(r, i))\nt.owner = PinOwner(s)\nt.owner.index") == []
