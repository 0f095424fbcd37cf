"""Parallel samples, aborts in every state, oversubscription and the async front (fp32, default model)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

import pytest
import torch

from chatcore.cache import audit
from chatcore.engine.commands import Audit, SessionPrefix
from chatcore.engine.engine import EngineStopped, InferenceEngine
from chatcore.engine.errors import PrefixOnDisk, RequestRejected
from chatcore.engine.request import RequestState, SamplingParams
from tests.engine_helpers import LONG_SYSTEM, QUESTIONS, chat_ids, run_to_end

pytestmark = pytest.mark.model


def test_n4_samples_share_the_prompt_and_are_reproducible(make_core, loaded_fp32) -> None:
    core = make_core()
    bs = core.pool.block_size
    prompt = chat_ids(loaded_fp32.tokenizer, QUESTIONS[1], LONG_SYSTEM)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, n=4, ignore_eos=True)
    peak: dict[str, int] = {"used": 0, "checked": 0}

    def watch(plan) -> None:
        report = audit(core.pool)
        peak["used"] = max(peak["used"], report.used)
        live = [(r, s) for r in core.scheduler.running for s in r.live_seqs]
        if len(live) == 4 and all(core.kv_cache.has_table(r, s) for r, s in live):
            full_prompt_blocks = len(prompt) // bs
            for block_id in core.kv_cache.block_ids(*live[0])[:full_prompt_blocks]:
                assert report.refs[block_id] == 4
            peak["checked"] += 1

    core.on_step.append(watch)
    runs = []
    for _ in range(2):
        req = core.make_request(prompt, params)
        core.add(req)
        runs.append(run_to_end(core)[req.request_id])
    core.on_step.clear()
    texts = [[o.token_ids for o in run.outputs] for run in runs]
    assert texts[0] == texts[1]
    assert len({tuple(ids) for ids in texts[0]}) > 1  # the four samples differ
    assert peak["checked"] > 0
    prompt_blocks = -(-len(prompt) // bs)
    generated_blocks = -(-24 // bs)
    assert peak["used"] <= prompt_blocks + 4 * (generated_blocks + 1)


def _prompt(core, loaded_fp32, i: int, max_tokens: int = 16):
    return core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[i % len(QUESTIONS)]),
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _assert_idle(core) -> None:
    report = audit(core.pool)
    assert report.ok, report.format()
    assert report.used == 0 and not core.requests, report.format()


def test_abort_while_waiting(make_core, loaded_fp32) -> None:
    core = make_core()
    req = _prompt(core, loaded_fp32, 0)
    core.add(req)
    out = core.abort(req.request_id)
    assert out is not None and out.finished and out.outputs[0].finish_reason == "cancelled"
    _assert_idle(core)


def test_abort_while_prefilling(make_core, loaded_fp32) -> None:
    core = make_core(max_batch_tokens=16)
    req = core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0], LONG_SYSTEM), SamplingParams(max_tokens=8))
    core.add(req)
    core.step()
    seq = req.seqs[0]
    assert req.state is RequestState.RUNNING and 0 < seq.num_computed < len(seq.tokens) - 1
    assert audit(core.pool).used > 0
    core.abort(req.request_id)
    _assert_idle(core)


def test_abort_while_decoding(make_core, loaded_fp32) -> None:
    core = make_core()
    req = _prompt(core, loaded_fp32, 1, max_tokens=32)
    core.add(req)
    while req.seqs[0].num_generated < 3:
        core.step()
    out = core.abort(req.request_id)
    assert out.outputs[0].finish_reason == "cancelled" and len(out.outputs[0].token_ids) >= 3
    _assert_idle(core)


def test_abort_while_preempted(make_core, loaded_fp32) -> None:
    core = make_core(num_blocks=20, block_size=8, low_watermark=0.0)
    requests = [_prompt(core, loaded_fp32, i, max_tokens=24) for i in range(6)]
    for req in requests:
        core.add(req)
    preempted = None
    for _ in range(200):
        core.step()
        preempted = next((r for r in requests if r.preemptions and r.state is RequestState.WAITING), None)
        if preempted:
            break
    assert preempted is not None, "no request was preempted"
    core.abort(preempted.request_id)
    assert audit(core.pool).ok
    run_to_end(core)
    _assert_idle(core)


def test_threefold_oversubscription_finishes_or_fails_clearly(make_core, loaded_fp32) -> None:
    # The last two requests wait about 54 steps for room: on a loaded 2-core machine that is more
    # than a minute, so the queue bound is an hour here (requests must finish, not age out).
    core = make_core(num_blocks=24, block_size=8, max_queue_wait_s=3600)
    # Each request may need prompt (~5 blocks) + 32 tokens (4 blocks): 12 of them ask 3x the pool.
    requests = [_prompt(core, loaded_fp32, i, max_tokens=32) for i in range(12)]
    for req in requests:
        core.add(req)
    finals = run_to_end(core, max_steps=5000)
    assert set(finals) == {r.request_id for r in requests}
    for out in finals.values():
        assert out.error is None and out.outputs[0].finish_reason == "length"
    assert core.scheduler.preemptions > 0
    _assert_idle(core)


def test_requests_that_can_never_fit_are_rejected_at_once(make_core, loaded_fp32) -> None:
    core = make_core(num_blocks=16, block_size=8)
    prompt = chat_ids(loaded_fp32.tokenizer, QUESTIONS[0])
    with pytest.raises(RequestRejected, match="KV blocks"):
        core.add(core.make_request(prompt, SamplingParams(max_tokens=500)))
    with pytest.raises(RequestRejected, match="context"):
        core.add(core.make_request(prompt, SamplingParams(max_tokens=loaded_fp32.max_context)))
    with pytest.raises(RequestRejected, match="empty"):
        core.add(core.make_request([], SamplingParams(max_tokens=4)))
    _assert_idle(core)


def test_queue_wait_is_bounded(make_core, loaded_fp32) -> None:
    core = make_core(num_blocks=16, block_size=8, max_queue_wait_s=0.2, low_watermark=0.0)
    hog = core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0], LONG_SYSTEM[:200]),
                            SamplingParams(max_tokens=30, ignore_eos=True))
    core.add(hog)
    core.step()
    late = _prompt(core, loaded_fp32, 2)
    core.add(late)
    late.waiting_since -= 1.0  # as if it had waited longer than the bound
    finals = run_to_end(core)
    assert finals[late.request_id].outputs[0].finish_reason == "busy"
    assert "max_queue_wait_s" in finals[late.request_id].error
    assert finals[hog.request_id].outputs[0].finish_reason == "length"
    _assert_idle(core)


async def test_async_engine_streams_and_cancels(make_core, loaded_fp32) -> None:
    engine = InferenceEngine(make_core())
    engine.start()
    try:
        req = engine.make_request(engine.chat_prompt([{"role": "user", "content": QUESTIONS[0]}]),
                                  SamplingParams(max_tokens=16))
        texts = []
        final = None
        async for out in engine.generate(req):
            texts.extend(d.text for d in out.deltas)
            final = out
        assert final is not None and final.finished
        assert "".join(texts) == final.outputs[0].text and "Paris" in final.outputs[0].text
        assert final.timings.ttft_ms is not None and final.timings.ttft_ms <= final.timings.total_ms

        # Leaving a stream early aborts the request and releases its blocks (a cancelled consumer, and
        # that the abort is the Abort command: tests/test_side_entrances.py).
        slow = engine.make_request(engine.chat_prompt([{"role": "user", "content": QUESTIONS[1]}]),
                                   SamplingParams(max_tokens=200, ignore_eos=True))
        async with aclosing(engine.generate(slow)) as stream:
            async for out in stream:
                if out.deltas:
                    break
        assert (await engine.send(Audit())).used == 0 and not engine._core.requests  # the abort ran first

        with pytest.raises(RequestRejected):
            async for _ in engine.generate(engine.make_request([], SamplingParams())):
                pass
    finally:
        engine.shutdown()


async def test_prefill_quiet_is_clear_until_the_first_token(make_core, loaded_fp32) -> None:
    """The disk tier's writer waits on `prefill_quiet`: it is clear at every step that computes
    a prompt, and set once every request has its first token."""
    core = make_core(max_batch_tokens=16)
    engine = InferenceEngine(core)
    seen: list[tuple[bool, bool]] = []  # per step: computed prompt tokens, the gate as the step ran
    core.on_step.append(lambda plan: seen.append((bool(plan.prefill), engine._events.state.prefill_quiet)))
    engine.start()
    try:
        req = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0], LONG_SYSTEM),
                                  SamplingParams(max_tokens=6, ignore_eos=True))
        async for _ in engine.generate(req):
            pass
        await engine.stats()  # one more round of the engine's loop, which publishes the gate
        assert engine.prefill_quiet.is_set()
    finally:
        engine.shutdown()
    prefill = [quiet for computed_prompt, quiet in seen if computed_prompt]
    decode = [quiet for computed_prompt, quiet in seen if not computed_prompt]
    assert len(prefill) > 2 and not any(prefill)
    assert len(decode) == 5 and all(decode)


async def test_a_session_prefix_is_prepared_with_the_add_and_may_decline(make_core, loaded_fp32) -> None:
    """A session turn's prefix is prepared on the engine thread in the command that adds the request:
    with a disk tier and the pool short of the prompt's blocks it declines (`PrefixOnDisk`), keeping
    nothing; with the blocks read back it is added, and its prefill is the engine's next step."""
    core = make_core()
    engine = InferenceEngine(core)
    first_step: dict[str, int] = {}
    core.on_step.append(lambda plan: [first_step.setdefault(e.req.request_id, core.steps) for e in plan.prefill])
    engine.start()
    try:
        prompt = engine.chat_prompt([{"role": "user", "content": QUESTIONS[0]}])
        declined = engine.make_request(prompt, SamplingParams(max_tokens=2))
        prefix = SessionPrefix("s1", disk_tier=True)
        with pytest.raises(PrefixOnDisk) as raised:
            async for _ in engine.generate(declined, prefix):
                pass
        assert raised.value.device_blocks == 0
        assert (await engine.send(Audit())).used == 0 and declined.request_id not in engine._core.requests

        admitted = engine.make_request(prompt, SamplingParams(max_tokens=2))
        outs = [out async for out in engine.generate(admitted, SessionPrefix("s1", disk=(0, [])))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
        assert first_step[admitted.request_id] == 1  # no step ran before its prefill
    finally:
        engine.shutdown()


def test_pool_grows_and_shrinks_under_a_running_request(make_core, loaded_fp32) -> None:
    core = make_core(num_blocks=32, block_size=16, low_watermark=0.0, high_watermark=0.0)
    req = _prompt(core, loaded_fp32, 4, max_tokens=20)
    core.add(req)
    core.step()
    table_before = list(core.kv_cache.block_ids(req, req.seqs[0]))
    data_before = core.kv.data[:, :, table_before].clone()
    assert core.kv_cache.resize(64) == 64 and core.kv.num_blocks == 64
    assert list(core.kv_cache.block_ids(req, req.seqs[0])) == table_before
    assert core.kv_cache.resize(8) == core.pool.num_blocks == core.kv.num_blocks
    assert core.pool.num_blocks >= max(table_before) + 1
    assert torch.equal(core.kv.data[:, :, table_before], data_before)
    out = run_to_end(core)[req.request_id]
    assert out.outputs[0].finish_reason == "length"
    _assert_idle(core)


def test_a_full_waiting_queue_refuses_with_queue_full_and_keeps_nothing(make_core, loaded_fp32) -> None:
    from chatcore.engine.errors import QueueFull

    core = make_core(max_waiting_requests=2)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    requests = [core.make_request(chat_ids(loaded_fp32.tokenizer, q), params) for q in QUESTIONS[:3]]
    core.add(requests[0])
    core.add(requests[1])
    with pytest.raises(QueueFull):
        core.add(requests[2])
    assert requests[2].request_id not in core.requests and len(core.scheduler.waiting) == 2
    while core.has_work:
        core.step()
    report = audit(core.pool)
    assert report.ok and report.used == 0, report.format()


async def test_a_command_queued_as_the_engine_stops_still_runs(make_core, loaded_fp32) -> None:
    """A command that reaches the queue after the loop's last drain runs before the thread ends
    (before, its caller waited until something else cancelled it); one after shutdown is refused."""
    core = make_core()
    engine = InferenceEngine(core)
    in_housekeeping, release = threading.Event(), threading.Event()
    core.tend_pins = lambda: (in_housekeeping.set(), release.wait())  # the loop's first round stops here
    engine.start()
    try:
        await asyncio.to_thread(in_housekeeping.wait)  # the thread is past this round's drain
        stats = asyncio.create_task(engine.stats())
        while engine._commands.empty():  # the task's first step queues its command
            await asyncio.sleep(0)
        stopping = asyncio.create_task(asyncio.to_thread(engine.shutdown))
        while not engine._stopping:
            await asyncio.sleep(0)
        release.set()
        counted = await asyncio.wait_for(stats, timeout=30)
        await stopping
        assert counted == core.pool.stats() and counted.total == core.pool.num_blocks
        with pytest.raises(EngineStopped):
            await engine.stats()
    finally:
        release.set()
        engine.shutdown()


def test_a_preempted_beam_search_gives_back_every_beam(make_core, loaded_fp32) -> None:
    """Preempting a beam search restarts it from its prompt: every beam's table goes back first (the
    beams' tables were once dropped unreleased, their blocks held until the process ended)."""
    core = make_core(num_blocks=20, block_size=8, low_watermark=0.0, max_queue_wait_s=3600)
    older = [_prompt(core, loaded_fp32, i, max_tokens=24) for i in range(2)]
    for req in older:
        core.add(req)
    core.step()
    beams = core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[5]),
                              SamplingParams(max_tokens=24, beam_width=3, ignore_eos=True))
    core.add(beams)
    for _ in range(400):
        core.step()
        if beams.preemptions and len(beams.seqs) == 1:
            break
    assert beams.preemptions, "the beam search was not preempted"
    report = audit(core.pool)
    assert report.ok and all(getattr(t.owner, "request_id", None) != beams.request_id for t in report.tables), report.format()
    finals = run_to_end(core, max_steps=5000)
    assert finals[beams.request_id].error is None and len(finals[beams.request_id].outputs) == 3
    _assert_idle(core)
