"""One update after the step (issue 56): only `chatcore/engine/step_update.py` applies a step's outcome.

Checked on the source of the engine and the benchmarks that drive it (chatcore/engine/, the linked
`bench/`), where sequences and the KV cache manager live (nothing else reaches them: the door):
* a sequence's state (its `tokens`, its `logprobs`; a request's `seqs`) is appended to, extended,
  assigned or changed in place only in the update, but for the named exceptions below (a request's
  own constructor; preemption, which restarts a beam search from the prompt), and no other module
  calls an `append_token`;
* the KV cache manager's verbs that change a sequence's table after a step (`cache_blocks`, `fork`,
  `rename`, `free_seq`, `finish_seq`) are called only by the update, but for the named exceptions
  (preemption; the benchmarks' offline replay, which stands in for a step);
* the step's records (`engine/step_types.py`) import no stage of the step, so every stage can name them.
The self-test shows each check catches what it is for. And at run time, over one workload with
every kind of sampling (n > 1 with a stop string, a beam search, log-probs, a grammar, preemption),
each step that runs the model calls schedule → runner → sampler → update → output processor once
each, in that order, and neither the sampler nor the output processor changes a request, a sequence
or a table.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import pytest

from chatcore.engine.core import EngineCore
from chatcore.engine.grammar import ResponseFormat
from chatcore.engine.request import SamplingParams
from chatcore.outcomes import FinishReason
from tests.engine_helpers import QUESTIONS, chat_ids
from tests.shipped_sources import ROOT, relative, shipped_files

UPDATE = "chatcore/engine/step_update.py"
SEQUENCE_STATE = {"tokens", "logprobs", "seqs"}
MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "sort", "reverse"}
TABLE_VERBS = {"cache_blocks", "fork", "rename", "free_seq", "finish_seq"}
UNIQUE_VERBS = {"cache_blocks", "free_seq", "finish_seq"}  # named for the manager alone, whatever holds it
# (module, function, what) -> why it may change a sequence's state or table outside the update.
EXCEPTIONS = {
    ("chatcore/engine/request.py", "__post_init__", "seqs ="): "a request's first sequence, as it is made",
    ("chatcore/engine/scheduler.py", "preempt", "kv_cache.free_seq"): "preemption gives a request's tables back",
    ("chatcore/engine/scheduler.py", "preempt", "seqs ="): "a preempted beam search restarts from the prompt",
    ("chatcore/bench/bookkeeping.py", "extend", "tokens ="): "the offline replay's stand-in for a step: a turn's history",
    ("chatcore/bench/bookkeeping.py", "extend", "kv_cache.cache_blocks"): "the offline replay's stand-in for a step",
}
STAGES = {"core", "scheduler", "kv_manager", "runner", "step_sampler", "step_update", "output_processor", "beams",
          "engine", "command_handlers"}


def _target(node: ast.AST) -> str | None:
    """`tokens` for `x.tokens`, `x.tokens[i]`: the sequence attribute an expression names, if any."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in SEQUENCE_STATE:
        return node.attr
    return None


def _change(node: ast.AST) -> str | None:
    """What `node` does to a sequence's state or table, as `tokens.append`, `seqs =`, `kv_cache.fork`; or None."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            if (name := _target(target)) is not None:
                return f"{name} =" if not isinstance(node, ast.Delete) else f"del {name}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr, receiver = node.func.attr, node.func.value
        if attr in MUTATORS and (name := _target(receiver)) is not None:
            return f"{name}.{attr}"
        if attr in ("append_token", "_append_token"):
            return attr
        held = ast.unparse(receiver).endswith("kv_cache")
        if attr in UNIQUE_VERBS or attr in TABLE_VERBS and held:
            return f"kv_cache.{attr}"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "append_token":
        return node.func.id
    return None


def changes(source: str) -> list[tuple[str, str, int]]:
    """(enclosing function, what, line) of each change to a sequence's state or table in `source`."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [(func.name, what, node.lineno) for node in ast.walk(func) if (what := _change(node))]
    return sorted(set(found), key=lambda change: change[2])


def test_only_the_update_changes_a_sequence_or_its_table_after_a_step() -> None:
    found, named = {}, set()
    walked = set()
    for path in shipped_files(ROOT / "engine") + shipped_files(ROOT / "bench"):
        rel = relative(path)
        walked.add(rel)
        if rel in (UPDATE, "chatcore/engine/kv_manager.py"):
            continue
        for func, what, line in changes(path.read_text(encoding="utf-8")):
            if (rel, func, what) in EXCEPTIONS:
                named.add((rel, func, what))
            else:
                found[f"{rel}:{line}"] = f"{func}: {what}"
    assert found == {}, found
    assert named == set(EXCEPTIONS)  # none is stale
    assert {"chatcore/engine/step_sampler.py", "chatcore/engine/output_processor.py", "chatcore/engine/beams.py",
            "chatcore/bench/bookkeeping.py"} <= walked  # the linked benchmarks included


def test_the_update_applies_every_kind_of_outcome() -> None:
    whats = {what for _, what, _ in changes((ROOT / "engine" / "step_update.py").read_text(encoding="utf-8"))}
    assert {"tokens.append", "logprobs.append", "seqs.append", "seqs =", "kv_cache.cache_blocks", "kv_cache.fork",
            "kv_cache.rename", "kv_cache.free_seq", "kv_cache.finish_seq"} <= whats, whats


def test_the_steps_records_import_no_stage() -> None:
    tree = ast.parse((ROOT / "engine" / "step_types.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    stages = {m for m in imported if m.startswith("chatcore.engine.") and m.rsplit(".", 1)[-1] in STAGES}
    assert stages == set(), stages
    assert "chatcore.engine.request" in imported


def test_the_checks_catch_what_they_are_for() -> None:
    source = """
def f(seq, req, kv, self):
    seq.tokens.append(1)
    seq.tokens += [2]
    seq.tokens[0] = 3
    seq.logprobs.extend([])
    req.seqs = []
    req.seqs.append(seq)
    self.output.append_token(req, seq, 1)
    self.kv_cache.fork(req, seq, seq)
    kv.free_seq(req, seq)
    self.sessions.rename(1, 2)
    x = len(seq.tokens) + seq.tokens[-1]
    state.tokens_seen = 1
"""
    assert [(what, line) for _, what, line in changes(source)] == [
        ("tokens.append", 3), ("tokens =", 4), ("tokens =", 5), ("logprobs.extend", 6), ("seqs =", 7),
        ("seqs.append", 8), ("append_token", 9), ("kv_cache.fork", 10), ("kv_cache.free_seq", 11)]


STAGES_IN_ORDER = ["schedule", "execute", "sample", "update_from_output", "process"]


def _state(core: EngineCore) -> list[Any]:
    """Every live request's state that a step's outcome changes: its sequences, their tables, its error."""
    return [(req.request_id, req.error, req.forked, req.first_token, list(req.token_times), [
        (seq.index, list(seq.tokens), list(seq.logprobs), seq.num_computed, seq.finish_reason, seq.cum_logprob,
         core.kv_cache.block_ids(req, seq) if core.kv_cache.has_table(req, seq) else None)
        for seq in req.seqs]) for req in core.requests.values()]


def _watch(core: EngineCore, monkeypatch: pytest.MonkeyPatch, calls: list[str], unchanged: list[bool]) -> None:
    """Record each stage's call; check that the sampler and the output processor leave the state as they found it."""
    stages: dict[str, tuple[Any, bool]] = {
        "schedule": (core.scheduler, False), "execute": (core.runner, False), "sample": (core.step_sampler, True),
        "update_from_output": (core.update, False), "process": (core.output_processor, True)}
    for name, (owner, pure) in stages.items():
        real: Callable[..., Any] = getattr(owner, name)

        def stage(*args: Any, _real: Callable[..., Any] = real, _name: str = name, _pure: bool = pure) -> Any:
            calls.append(_name)
            before = _state(core) if _pure else None
            result = _real(*args)
            if _pure:
                unchanged.append(_state(core) == before)
            return result

        monkeypatch.setattr(owner, name, stage)


@pytest.mark.model
def test_a_step_walks_each_stage_once_and_only_the_update_changes_state(make_core, monkeypatch) -> None:
    # a small pool: the beam search and the samples preempt each other
    core = make_core(num_blocks=24, block_size=8, low_watermark=0.0, max_queue_wait_s=3600)
    ids = [chat_ids(core.tokenizer, q) for q in QUESTIONS[:4]]
    requests = [
        core.make_request(ids[0], SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=7, stop=(".",))),
        core.make_request(ids[1], SamplingParams(max_tokens=24, beam_width=3, ignore_eos=True)),
        core.make_request(ids[2], SamplingParams(max_tokens=24, logprobs=True, top_logprobs=2, ignore_eos=True)),
        core.make_request(ids[3], SamplingParams(max_tokens=24, response_format=ResponseFormat("json_object"))),
    ]
    for req in requests:
        core.add(req)
    calls: list[str] = []
    unchanged: list[bool] = []
    _watch(core, monkeypatch, calls, unchanged)
    finals, model_steps = {}, 0
    while core.has_work:
        calls.clear()
        steps = core.steps
        finals.update({out.request_id: out for out in core.step() if out.finished})
        if core.steps > steps:
            model_steps += 1
            assert calls == STAGES_IN_ORDER, calls
    assert model_steps > 5 and unchanged and all(unchanged)
    sampled, beams, logprobs, grammar = (finals[req.request_id] for req in requests)
    assert len(sampled.outputs) == 3 and all(o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                                             for o in sampled.outputs)
    assert all("." not in o.text for o in sampled.outputs)  # the stop string ends a sample, and is cut
    assert len(beams.outputs) == 3 and beams.error is None
    assert len(logprobs.outputs[0].logprobs or []) == 24 == len(logprobs.outputs[0].token_ids)
    assert grammar.error is None and grammar.outputs[0].token_ids
    assert any(req.preemptions for req in requests), "nothing was preempted"
