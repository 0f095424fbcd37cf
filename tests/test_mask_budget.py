"""Grammar mask time is charged to its tenant (issue 47, item 3): `MaskBudget` holds a tenant's constrained
decode rows past its share, least recently masked first, never another tenant's, and never when nobody else
waits. The share follows the forward time it is given; these tests give it measured-looking figures."""

from __future__ import annotations

import pytest

from chatcore.engine.grammar import ResponseFormat
from chatcore.engine.mask_budget import BURST_STEPS, MaskBudget
from chatcore.engine.request import Request, RequestState, SamplingParams, TokenSequence
from chatcore.engine.scheduler import StepPlan
from tests.engine_helpers import QUESTIONS, chat_ids

JSON = ResponseFormat("json_object")


def decoding(tenant: str, rows: int, fmt: ResponseFormat | None = JSON) -> Request:
    """A request whose `rows` sequences each decode one token next step."""
    req = Request(f"{tenant}-{id(object())}", [1, 2, 3], SamplingParams(n=max(rows, 1), response_format=fmt),
                  tenant=tenant)
    req.seqs = [TokenSequence(i, [1, 2, 3, 4], 3, num_computed=3) for i in range(rows)]
    req.state = RequestState.RUNNING
    return req


def constrained_in(*requests: Request):
    seqs = {seq for req in requests if req.params.response_format is not None for seq in req.seqs}
    return lambda seq: seq in seqs


def test_a_costly_tenants_rows_wait_and_the_others_never_do() -> None:
    budget = MaskBudget(fraction=0.25)
    budget.forward_took(100.0, decode=True)  # share: 0.25 * 100 ms / 2 tenants = 12.5 ms a step
    mallory, alice = decoding("mallory", 8), decoding("alice", 1, fmt=None)
    constrained = constrained_in(mallory, alice)
    assert budget.hold([mallory, alice], constrained) == frozenset()  # no cost known yet
    budget.charge("mallory", 8 * 20.0, mallory.seqs)  # 20 ms a row: far past the share
    masked_per_step = []
    for _ in range(40):
        held = budget.hold([mallory, alice], constrained)
        assert not held & set(alice.seqs)
        masked = [seq for seq in mallory.seqs if seq not in held]
        masked_per_step.append(len(masked))
        if masked:
            budget.charge("mallory", 20.0 * len(masked), masked)
    # Over the steps, mallory's masks cost about its share a step (12.5 ms of 20 ms rows), and each row got its turn.
    assert 0 < sum(masked_per_step) * 20.0 / 40 <= 12.5 + 20.0 / 40 * BURST_STEPS
    assert budget.held_rows == 40 * 8 - sum(masked_per_step)


def test_held_rows_take_turns() -> None:
    budget = MaskBudget(fraction=0.25)
    budget.forward_took(80.0, decode=True)  # share 0.25 * 80 ms / 2 tenants = 10 ms: one 20 ms row every other step
    mallory, alice = decoding("mallory", 4), decoding("alice", 1, fmt=None)
    constrained = constrained_in(mallory, alice)
    assert budget.hold([mallory, alice], constrained) == frozenset()  # no cost known yet
    budget.charge("mallory", 4 * 20.0, mallory.seqs)
    turns = []
    for _ in range(40):  # the first 80 ms are paid back, then a 20 ms row every other step
        held = budget.hold([mallory, alice], constrained)
        masked = [seq for seq in mallory.seqs if seq not in held]
        if masked:
            budget.charge("mallory", 20.0 * len(masked), masked)
        turns.extend(seq.index for seq in masked)
    assert 40 * 10 / 20 - 80 / 20 - 1 <= len(turns) <= 40 * 10 / 20 and sorted(set(turns)) == [0, 1, 2, 3]
    assert max(turns.count(i) for i in range(4)) - min(turns.count(i) for i in range(4)) <= 1


def test_nothing_waits_when_no_one_else_is_in_the_engine_and_nothing_is_owed_after() -> None:
    budget = MaskBudget(fraction=0.25)
    budget.forward_took(100.0, decode=True)
    mallory, alice = decoding("mallory", 8), decoding("alice", 1, fmt=None)
    for _ in range(10):  # alone: 400 ms of masks a step cost nobody
        assert budget.hold([mallory], constrained_in(mallory)) == frozenset()
        budget.charge("mallory", 8 * 50.0, mallory.seqs)
    # Alice arrives: mallory's rows now wait past its share, but it owes nothing for the steps it ran alone.
    held = budget.hold([mallory, alice], constrained_in(mallory, alice))
    assert len(held) == 8 - 1  # its saved credit (capped at one 50 ms row) pays for one row; had the steps alone
    # been charged, its debt (4,000 ms) would hold all eight

    # The same tenant's request without a grammar is somebody waiting: its chat is protected too.
    plain = decoding("mallory", 1, fmt=None)
    assert budget.hold([mallory, plain], constrained_in(mallory, plain))


def test_a_row_dearer_than_the_burst_is_still_masked_in_time() -> None:
    """One row costs more than `BURST_STEPS` shares: credit saves up to one row's cost, so it is never starved."""
    budget = MaskBudget(fraction=0.25)
    budget.forward_took(8.0, decode=True)  # share 1 ms a step; a row costs 30 ms
    mallory, alice = decoding("mallory", 1), decoding("alice", 1)
    constrained = constrained_in(mallory, alice)
    assert budget.hold([mallory, alice], constrained) == frozenset()
    budget.charge("mallory", 30.0, mallory.seqs)
    waits = 0
    while budget.hold([mallory, alice], constrained) & set(mallory.seqs):
        waits += 1
        assert waits < 100, "the row starved"
    assert waits >= 2 * 30 - 2  # it paid back its 30 ms debt and saved 30 ms, at 1 ms a step


COSTLY = ResponseFormat("json_schema", '{"pattern": ".{1,500}", "type": "string"}')  # the review's: 13-35 ms a row


@pytest.mark.model
def test_in_the_engine_a_costly_tenants_rows_wait_while_another_tenant_decodes_every_step(make_core) -> None:
    """With a share of 1% of a step (the default's effect on latency is the bench's `grammar` suite), the
    review's costly rows are past it on any machine: they wait, and alice's row runs in every step."""
    core = make_core(grammar_mask_share=0.01)
    fmt = ResponseFormat(COSTLY.kind, COSTLY.schema, core.grammar_compiler.compile(COSTLY))
    load = [core.make_request(chat_ids(core.tokenizer, q), SamplingParams(
        max_tokens=200, n=4, temperature=1.0, ignore_eos=True, response_format=fmt), tenant="mallory")
        for q in QUESTIONS[:2]]
    for req in load:
        core.add(req)
    while any(len(req.seqs) < 4 or req.seqs[0].num_generated < 2 for req in load):
        core.step()
    alice = core.make_request(chat_ids(core.tokenizer, QUESTIONS[3]), SamplingParams(max_tokens=8, ignore_eos=True),
                              tenant="alice")
    core.add(alice)
    plans: list[StepPlan] = []
    core.on_step.append(plans.append)
    final = None
    try:
        while final is None:
            final = next((out for out in core.step() if out.request_id == alice.request_id and out.finished), None)
        held, alices = core.mask_budget.held_rows, list(plans)
        live = [seq for req in load for seq in req.live_seqs]
        generated = [seq.num_generated for seq in live]
        core.step()  # mallory alone: nobody else waits, so no row of hers does
        assert core.mask_budget.held_rows == held
        assert [seq.num_generated for seq in live] == [n + 1 for n in generated]
    finally:
        for req in load:
            core.abort(req.request_id)
    assert final.error is None and len(final.outputs[0].token_ids) == 8
    decoding = [plan for plan in alices if not any(e.req is alice for e in plan.prefill)]
    assert all(any(e.req is alice for e in plan.decode) for plan in decoding)  # never held
    assert held > 0
