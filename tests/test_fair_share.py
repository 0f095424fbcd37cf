"""Tenants share the engine (issue 53, deliverable 1): slots, each step's token budget, and the queue
wait (chatcore/engine/fair_share.py, chatcore/engine/scheduler.py). Engine-level and deterministic: each
test counts steps and reads the plans the scheduler made, never the clock. The `make_core` fixture
audits every core's blocks at teardown."""

from __future__ import annotations

import pytest

from chatcore.engine.core import EngineCore
from chatcore.engine.request import Request, SamplingParams
from chatcore.engine.scheduler import StepPlan
from tests.engine_helpers import LONG_SYSTEM, QUESTIONS, chat_ids, run_to_end

pytestmark = pytest.mark.model


def _request(core: EngineCore, tokenizer, tenant: str, question: int = 0, system: str | None = None,
             **params) -> Request:
    sampling = SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **params})
    return core.make_request(chat_ids(tokenizer, QUESTIONS[question], system), sampling, tenant=tenant,
                             scope_key=f"tenant:{tenant}")  # as the server scopes the prefix cache


def _record(core: EngineCore) -> list[StepPlan]:
    plans: list[StepPlan] = []
    core.on_step.append(plans.append)
    return plans


def _tenants(plan: StepPlan, prefill: bool | None = None) -> set[str]:
    entries = plan.prefill if prefill else plan.decode if prefill is False else [*plan.decode, *plan.prefill]
    return {e.req.tenant for e in entries}


def test_a_tenant_arriving_at_full_slots_is_admitted_in_one_step(make_core, loaded_fp32) -> None:
    """Alpha holds every sequence slot (two requests of n=4 on a cap of 8). Beta's request is admitted in
    the very next step: alpha's newest request is preempted (recompute), its oldest keeps running."""
    core = make_core(max_num_seqs=8, max_queue_wait_s=3600)
    tokenizer = loaded_fp32.tokenizer
    hogs = [_request(core, tokenizer, "alpha", i, n=4, temperature=0.8, seed=i) for i in range(2)]
    for req in hogs:
        core.add(req)
    while core.scheduler.num_running_seqs < 8:
        core.step()
    assert not core.scheduler.waiting
    beta = _request(core, tokenizer, "beta", 3, max_tokens=4)
    core.add(beta)
    plans = _record(core)
    core.step()
    assert "beta" in _tenants(plans[0], prefill=True)
    assert hogs[1] in core.scheduler.waiting and hogs[0] in core.scheduler.running
    assert core.scheduler.preemptions == 1
    finals = run_to_end(core)
    assert finals[beta.request_id].outputs[0].finish_reason == "length"
    assert all(finals[r.request_id].error is None for r in hogs)


def test_a_long_prompt_is_chunked_with_another_tenants_rows_between(make_core, loaded_fp32) -> None:
    """Alpha's prompt is many budgets long. Once beta arrives, every step runs beta's rows (its prefill,
    then each of its decode tokens) beside a chunk of alpha's prompt no larger than alpha's half of the
    budget, and beta's answer ends before alpha's prompt is computed."""
    budget = 64
    core = make_core(max_batch_tokens=budget, max_queue_wait_s=3600)
    tokenizer = loaded_fp32.tokenizer
    alpha = _request(core, tokenizer, "alpha", 0, system=LONG_SYSTEM * 4, max_tokens=2)
    assert len(alpha.prompt) > 8 * budget
    core.add(alpha)
    plans = _record(core)
    core.step()
    assert plans[0].num_tokens == budget  # alone, alpha takes the whole step
    beta = _request(core, tokenizer, "beta", 2, max_tokens=6)
    core.add(beta)
    beta_steps = 0
    while not beta.finished:
        core.step()
        plan = plans[-1]
        alpha_tokens = sum(e.num_tokens for e in plan.prefill if e.req is alpha)
        assert 0 < alpha_tokens <= budget // 2, alpha_tokens
        assert "beta" in _tenants(plan), "a step ran without beta's rows"
        beta_steps += 1
    assert alpha.seqs[0].num_computed < len(alpha.prompt), "beta waited for alpha's whole prompt"
    assert beta_steps <= 1 + 6 + 1  # its prompt in one or two chunks, then one token a step
    run_to_end(core)


def test_two_long_prompts_split_each_step(make_core, loaded_fp32) -> None:
    """Two tenants' long prompts, both waiting: each step gives each of them half of the budget."""
    budget = 64
    core = make_core(max_batch_tokens=budget, max_queue_wait_s=3600)
    tokenizer = loaded_fp32.tokenizer
    first = _request(core, tokenizer, "alpha", 0, system=LONG_SYSTEM, max_tokens=2)
    second = _request(core, tokenizer, "beta", 1, system=LONG_SYSTEM[::-1], max_tokens=2)
    for req in (first, second):
        core.add(req)
    plans = _record(core)
    for _ in range(4):
        core.step()
    for plan in plans:
        per_tenant = {t: sum(e.num_tokens for e in plan.prefill if e.req.tenant == t) for t in ("alpha", "beta")}
        assert per_tenant == {"alpha": budget // 2, "beta": budget // 2}, per_tenant
    run_to_end(core)


def test_the_queue_wait_is_paused_while_other_tenants_are_served(make_core, loaded_fp32) -> None:
    """Beta waits behind alpha (one slot, alpha at its share): the time the engine spends serving alpha
    does not count against beta's max_queue_wait_s, so beta is served when alpha ends, not refused.
    (A request waiting behind its own tenant still ages out: test_engine_lifecycle's queue-wait test.)"""
    core = make_core(max_num_seqs=1, max_queue_wait_s=0.2)
    tokenizer = loaded_fp32.tokenizer
    alpha = _request(core, tokenizer, "alpha", 0, max_tokens=8)
    core.add(alpha)
    core.step()
    beta = _request(core, tokenizer, "beta", 1, max_tokens=2)
    core.add(beta)
    core.step()
    assert beta in core.scheduler.waiting
    beta.waiting_since -= 1.0  # as if the engine had served alpha for a second meanwhile
    finals = run_to_end(core)
    assert finals[beta.request_id].error is None
    assert finals[beta.request_id].outputs[0].finish_reason == "length"
    assert finals[alpha.request_id].outputs[0].finish_reason == "length"


def test_admission_takes_the_tenant_holding_fewest_slots_first(make_core, loaded_fp32) -> None:
    """Alpha queued eight requests before beta's one, on room for four sequences: beta's request is
    admitted in the first step, ahead of alpha's queue."""
    core = make_core(max_num_seqs=4, max_queue_wait_s=3600)
    tokenizer = loaded_fp32.tokenizer
    alphas = [_request(core, tokenizer, "alpha", i % len(QUESTIONS), max_tokens=12) for i in range(8)]
    for req in alphas:
        core.add(req)
    beta = _request(core, tokenizer, "beta", 4, max_tokens=2)
    core.add(beta)
    plans = _record(core)
    core.step()
    assert "beta" in _tenants(plans[0], prefill=True)
    assert beta in core.scheduler.running and all(r in core.scheduler.waiting for r in alphas[1:])
    run_to_end(core)


def test_a_request_larger_than_its_share_is_not_starved(make_core, loaded_fp32) -> None:
    """Alpha's n=8 request needs every slot of 8; beta always has a request running or waiting. Once alpha
    holds nothing it is the least served: beta's next request waits behind it, and alpha's request runs to
    its end without being preempted (it is alpha's only one)."""
    core = make_core(max_num_seqs=8, max_queue_wait_s=3600)
    tokenizer = loaded_fp32.tokenizer
    beta = _request(core, tokenizer, "beta", 1, max_tokens=6)
    core.add(beta)
    core.step()
    alpha = _request(core, tokenizer, "alpha", 0, max_tokens=6, n=8, temperature=0.8, seed=1)
    core.add(alpha)
    betas = [beta]
    for _ in range(200):
        if alpha.finished:
            break
        if betas[-1].finished:  # beta keeps sending
            betas.append(_request(core, tokenizer, "beta", len(betas) % len(QUESTIONS), max_tokens=6))
            core.add(betas[-1])
        core.step()
    assert alpha.finished and alpha.error is None and alpha.preemptions == 0
    assert len(betas) <= 3  # beta's requests waited behind alpha's once it was the least served
    run_to_end(core)


def test_a_tenants_newest_rows_wait_past_its_share_of_the_step(make_core, loaded_fp32) -> None:
    """On a step budget of 16, alpha's 16 decode rows (two requests of n=8, within its slots) take all of
    it alone; once beta has work, alpha runs 8 rows a step, its older request's, and beta's rows run in
    every step."""
    core = make_core(max_batch_tokens=16, max_num_seqs=32, max_queue_wait_s=3600)
    tokenizer = loaded_fp32.tokenizer
    alphas = [_request(core, tokenizer, "alpha", i, max_tokens=40, n=8, temperature=0.8, seed=i) for i in range(2)]
    for req in alphas:
        core.add(req)
    plans = _record(core)
    while core.scheduler.num_running_seqs < 16 or not plans or plans[-1].prefill:
        core.step()
    assert len(plans[-1].decode) == 16
    beta = _request(core, tokenizer, "beta", 2, max_tokens=4)
    core.add(beta)
    while not beta.finished:
        core.step()
        plan = plans[-1]
        alpha_rows = [e for e in (*plan.decode, *plan.prefill) if e.req.tenant == "alpha"]
        assert sum(e.num_tokens for e in alpha_rows) <= 8 and all(e.req is alphas[0] for e in alpha_rows)
        assert "beta" in _tenants(plan)
    for req in alphas:
        core.abort(req.request_id)
