"""Greedy and beam outputs of the paged engine equal plain transformers, token for token (fp32)."""

from __future__ import annotations

import functools

import pytest

from chatcore.engine.request import SamplingParams
from tests.engine_helpers import LONG_SYSTEM, QUESTIONS, chat_ids, hf_beam, hf_greedy, run_to_end

pytestmark = pytest.mark.model
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 18, 14]


@pytest.fixture(scope="module")
def reference(hf_model):
    @functools.cache
    def greedy(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        return hf_greedy(hf_model, list(prompt), max_new_tokens)

    return greedy


def _check_all(core, requests, reference, prompts):
    finals = run_to_end(core)
    for req, prompt, max_tokens in zip(requests, prompts, MAX_TOKENS, strict=True):
        out = finals[req.request_id]
        assert out.error is None
        assert out.outputs[0].token_ids == reference(tuple(prompt), max_tokens), req.request_id
    return finals


def test_concurrent_staggered_arrivals_match_transformers(make_core, loaded_fp32, reference) -> None:
    core = make_core()
    prompts = [chat_ids(loaded_fp32.tokenizer, q) for q in QUESTIONS]
    requests = [core.make_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    for req in requests[:3]:
        core.add(req)
    core.step()
    core.step()
    for req in requests[3:6]:
        core.add(req)
    core.step()
    for req in requests[6:]:
        core.add(req)
    _check_all(core, requests, reference, prompts)


def test_shared_system_prompt_hits_the_prefix_cache(make_core, loaded_fp32, reference) -> None:
    core = make_core()
    prompts = [chat_ids(loaded_fp32.tokenizer, q, LONG_SYSTEM) for q in QUESTIONS]
    requests = [core.make_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    computed = {"prefill": 0}
    core.on_step.append(lambda plan: computed.update(prefill=computed["prefill"] + sum(
        e.num_tokens for e in plan.prefill)))
    for req in requests:  # all at once: the shared blocks are computed by the first, then found by the rest
        core.add(req)
    finals = _check_all(core, requests, reference, prompts)
    core.on_step.clear()
    shared = len(chat_ids(loaded_fp32.tokenizer, "", LONG_SYSTEM)) - 8
    shared_blocks = shared // core.pool.block_size
    assert finals[requests[0].request_id].usage.cached_tokens == 0
    for req in requests[1:]:
        assert finals[req.request_id].usage.cached_tokens >= shared_blocks * core.pool.block_size
    assert computed["prefill"] == sum(len(p) - finals[r.request_id].usage.cached_tokens
                                      for p, r in zip(prompts, requests, strict=True))


def test_small_pool_preempts_and_still_matches(make_core, loaded_fp32, reference) -> None:
    core = make_core(num_blocks=20, block_size=8, low_watermark=0.0)
    prompts = [chat_ids(loaded_fp32.tokenizer, q) for q in QUESTIONS]
    requests = [core.make_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    for req in requests:
        core.add(req)
    _check_all(core, requests, reference, prompts)
    assert core.scheduler.preemptions > 0


@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_beam_search_matches_transformers(make_core, loaded_fp32, hf_model, question: str) -> None:
    core = make_core()
    prompt = chat_ids(loaded_fp32.tokenizer, question)
    req = core.make_request(prompt, SamplingParams(max_tokens=20, beam_width=4))
    core.add(req)
    out = run_to_end(core)[req.request_id]
    eos = loaded_fp32.tokenizer.eos_token_id
    assert out.outputs[0].token_ids == hf_beam(hf_model, prompt, 20, 4, eos)


def _long_chat(tokenizer, min_tokens: int) -> list[int]:
    """A conversation of several turns on the long system prompt, ending in a request for a long answer."""
    messages = [{"role": "system", "content": LONG_SYSTEM}]
    for question in QUESTIONS * 3:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": f"You asked: '{question}' I keep answers brief, as our policy "
                                                      "asks, so here is the short version, with an offer of more help."}]
        ids = tokenizer.apply_chat_template(messages + [{"role": "user", "content": "Now write me a long story about a lighthouse keeper, in four paragraphs."}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) > min_tokens:
            return list(ids)
    raise AssertionError("the conversation is too short")


@pytest.fixture(scope="module")
def auto_models(loaded_fp32, hf_model):
    """The engine's model and the transformers reference in the dtype `auto` picks on this CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from chatcore.config import Settings
    from chatcore.models.device import resolve_dtype
    from chatcore.models.loader import load_model

    dtype = resolve_dtype("auto", "cpu")
    if dtype == torch.float32:
        return loaded_fp32, hf_model
    loaded = load_model(Settings(dtype="auto"))
    return loaded, AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).eval()


def test_a_prompt_past_one_prefill_chunk_matches_in_the_auto_dtype(auto_models, hf_model, monkeypatch) -> None:
    """Issue 14, item 5: a prompt longer than one 512-token prefill chunk, 64 generated tokens,
    in the benchmarked dtype. fp32 must be exact. In bf16 (CPUs with native bf16 matmuls) the
    engine and transformers round differently (attention kernels, accumulation order), so a
    near-tie can flip and the texts then diverge. There, given the same text before each token,
    transformers must rank the engine's token first >= 90% of the time, and everywhere else
    within two bf16 steps of its top logit, or within transformers' own bf16 error at that token
    (the most any logit there moves from float32; the engine's few-row linears,
    kernels/cpu_linear.py, sum in another order than transformers' GEMM): a tie at bf16's
    resolution, not a wrong token.
    The second chunk continues 512 cached tokens with 512 more: in float32 it takes the CPU's
    cascade attention (`CASCADE_MIN_WORK`), the third the shifted-mask SDPA."""
    import torch

    from chatcore.cache import audit
    from chatcore.config import Settings
    from chatcore.engine.core import EngineCore
    from chatcore.kernels import prefill

    loaded, reference = auto_models
    prompt = _long_chat(loaded.tokenizer, 1100)
    core = EngineCore(loaded, Settings(dtype="auto", num_blocks=256, max_batch_tokens=512))
    chunks: list[int] = []
    core.on_step.append(lambda plan: chunks.extend(e.num_tokens for e in plan.prefill))
    cascades = []
    cascade = prefill._cascade_attention
    monkeypatch.setattr(prefill, "_cascade_attention", lambda *a: cascades.append(1) or cascade(*a))
    req = core.make_request(prompt, SamplingParams(max_tokens=64))
    core.add(req)
    ours = run_to_end(core)[req.request_id].outputs[0].token_ids
    report = audit(core.pool)
    assert report.ok and report.used == 0, report.format()
    assert len(chunks) >= 3 and max(chunks) <= 512, chunks  # the prompt really was split
    if loaded.dtype == torch.float32:
        assert len(cascades) == loaded.model.config.num_hidden_layers  # one chunk, every layer
        assert ours == hf_greedy(reference, prompt, 64)
        assert len(ours) == 64
        return
    text = torch.tensor([prompt + ours[:-1]])
    with torch.inference_mode():
        logits = reference(text).logits[0, len(prompt) - 1:].float()
        full = hf_model(text).logits[0, len(prompt) - 1:].float()
    top = logits.max(dim=-1).values
    gaps = (top - logits[torch.arange(len(ours)), torch.tensor(ours)]).tolist()
    # One bf16 step at the top logit's magnitude: logits this close are a tie at bf16's resolution.
    steps = torch.exp2(torch.floor(torch.log2(top.abs())) - 7).tolist()
    # transformers' own bf16 error there (against float32): the engine rounds in another order.
    noise = (logits - full).abs().max(dim=-1).values.tolist()
    agreement = sum(gap == 0 for gap in gaps) / len(ours)
    print(f"bf16 top-1 agreement with transformers: {agreement:.3f} over {len(ours)} tokens; gaps where not: "
          f"{[gap for gap in gaps if gap]}")
    assert agreement >= 0.9
    far = [(i, gap, step, error) for i, (gap, step, error) in enumerate(zip(gaps, steps, noise, strict=True))
           if gap > max(2 * step, error)]
    assert not far, far
