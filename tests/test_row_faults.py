"""A fault in one request's rows stays inside that request (issue 47, item 1).

A request is made to fail in each place a step works on one request's rows after the shared forward
pass: its draw, its grammar mask (a mask that allows nothing, and a matcher that raises), its batch
of choices, its detokenizing and its stop check. Beside it, another tenant's greedy answer runs in the
same steps and must come out exactly as it does alone, and every block is accounted for afterwards
(`make_core`'s audit).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar

from chatcore.engine.core import EngineCore
from chatcore.engine.grammar import GrammarError, ResponseFormat
from chatcore.engine.request import Request, SamplingParams
from chatcore.outcomes import ErrorCode, FinishReason
from tests.engine_helpers import chat_ids, run_to_end

pytestmark = pytest.mark.model
TOKENS = 12
SELF_REFERENCE = {"allOf": [{"$ref": "#"}]}  # the review's schema: it compiles to a grammar that allows no token


def victim(core: EngineCore) -> Request:
    return core.make_request(chat_ids(core.tokenizer, "Name three colors."),
                             SamplingParams(max_tokens=TOKENS, ignore_eos=True), tenant="alice")


def culprit(core: EngineCore, **params: Any) -> Request:
    return core.make_request(chat_ids(core.tokenizer, "What is 2+2?"),
                             SamplingParams(max_tokens=TOKENS, ignore_eos=True, **params), tenant="mallory")


class Exploding:
    """Stands in for one request's part (its detokenizer, its grammar matcher): every use raises."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"{self.what} exploded")


def zero_repetition_penalty(core: EngineCore) -> Request:
    """The review's first trigger as the engine saw it: 1e-300 was 0 in float32, so seen logits became inf."""
    req = culprit(core, temperature=1.0, repetition_penalty=1.5)
    object.__setattr__(req.params, "repetition_penalty", 0.0)  # past the validation the API now applies
    return req


def empty_grammar(core: EngineCore) -> Request:
    """The review's second trigger, compiled by xgrammar directly (the engine's compile now refuses it)."""
    compiler = core.grammar_compiler._get_compiler()
    compiled = compiler.compile_json_schema(json.dumps(SELF_REFERENCE), any_whitespace=False, strict_mode=True)
    return culprit(core, response_format=ResponseFormat("json_schema", json.dumps(SELF_REFERENCE), compiled))


def json_object(core: EngineCore) -> Request:
    return culprit(core, response_format=ResponseFormat("json_object"))


def presence_penalty(core: EngineCore) -> Request:
    return culprit(core, presence_penalty=0.5)


def break_matcher(core: EngineCore, req: Request) -> None:
    core.grammars._matchers[req.seqs[0]] = Exploding("the matcher")


def break_detokenizer(core: EngineCore, req: Request) -> None:
    core.detokenizers._by_seq[req.seqs[0]] = Exploding("the detokenizer")


def break_stop_check(core: EngineCore, req: Request) -> None:
    object.__setattr__(req.params, "stop_token_ids", None)  # not a collection: the stop check raises


def break_penalties(core: EngineCore, req: Request) -> None:
    core._penalties._requests.clear()  # its shaping tensors gone: the batch of choices raises


CASES = {  # place: (the culprit, the fault injected once it decodes, what its error names, its code)
    "draw": (zero_repetition_penalty, None, "not a distribution", ErrorCode.INTERNAL),
    # the client's schema at a dead end: its fault, not the server's
    "mask allows nothing": (empty_grammar, None, "allows no next token", ErrorCode.BAD_REQUEST),
    "mask raises": (json_object, break_matcher, "the matcher exploded", ErrorCode.INTERNAL),
    "choices": (presence_penalty, break_penalties, "sampling failed", ErrorCode.INTERNAL),
    "detokenizing": (presence_penalty, break_detokenizer, "the detokenizer exploded", ErrorCode.INTERNAL),
    "stop check": (presence_penalty, break_stop_check, "choosing its token failed", ErrorCode.INTERNAL),
}


@pytest.mark.parametrize("place", list(CASES))
def test_a_fault_in_one_requests_rows_fails_it_alone(make_core, place: str) -> None:
    make_culprit, inject, names, code = CASES[place]
    alone = make_core()
    alone.add(victim(alone))
    expected = run_to_end(alone)
    (solo,) = expected.values()

    core = make_core()
    good, bad = victim(core), make_culprit(core)
    core.add(good)
    core.add(bad)
    finals: dict[str, Any] = {}
    while core.has_work:
        if inject is not None and bad.request_id in core.requests and bad.seqs[0].num_generated == 1:
            inject(core, bad)
            inject = None
        finals.update({out.request_id: out for out in core.step() if out.finished})
    failed, intact = finals[bad.request_id], finals[good.request_id]
    assert failed.error_code is code and names in (failed.error or ""), failed.error
    assert failed.outputs[0].finish_reason is FinishReason.ERROR
    assert intact.error is None
    assert intact.outputs[0].finish_reason is FinishReason.LENGTH
    assert intact.outputs[0].token_ids == solo.outputs[0].token_ids
    assert core.step_failure is None and not core.requests


def test_a_grammar_that_allows_no_token_is_refused_at_compile(make_core) -> None:
    core = make_core()
    with pytest.raises(GrammarError, match="no output satisfies it"):
        core.grammar_compiler.compile(ResponseFormat("json_schema", json.dumps(SELF_REFERENCE)))
    assert core.grammar_compiler.compile(ResponseFormat("json_object")) is not None


def test_a_matcher_that_raises_in_a_batch_leaves_the_other_rows_masked(make_core) -> None:
    """The batch fill raises on a broken matcher; the rows are then filled one by one, and only it fails."""
    core = make_core()
    fmt = ResponseFormat("json_object")
    good, bad = object(), object()
    core.grammars.admit(good, fmt)
    core.grammars.admit(bad, fmt)
    core.grammars._matchers[bad] = Exploding("the matcher")
    fill = core.grammars.masks({"t": [(good, 0), (bad, 1)]}, 2, threads=2)
    assert list(fill.failed) == [bad] and "the matcher exploded" in fill.failed[bad][1]
    assert fill.failed[bad][0] == "internal"
    allowed = xgrammar.allocate_token_bitmask(1, core.vocab_size)
    xgrammar.GrammarMatcher(core.grammar_compiler.compile(fmt)).fill_next_token_bitmask(allowed, 0)
    assert fill.bitmask[0].equal(allowed[0])
    assert fill.took_ms["t"] >= 0
    for seq in (good, bad):
        core.grammars.release(seq)
