"""Penalties, logit_bias and logprobs in the engine (fp32, against transformers' own logits), and a
step that shapes and reports log-probs still crosses host and device once each way."""

from __future__ import annotations

import pytest
import torch

from chatcore.engine.request import SamplingParams
from tests.engine_helpers import QUESTIONS, chat_ids, run_to_end
from tests.test_step_transfers import _run_watched, _watch

pytestmark = pytest.mark.model


def _reference_shaping(logits: torch.Tensor, prompt: list[int], generated: list[int],
                       params: SamplingParams) -> torch.Tensor:
    """The documented semantics, token by token on the host."""
    out = logits.clone()
    for token in set(prompt) | set(generated) if params.repetition_penalty != 1 else ():
        value = out[token]
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(generated):
        out[token] -= params.frequency_penalty * generated.count(token) + params.presence_penalty
    for token, bias in params.logit_bias:
        out[token] += bias
    return out


def _check_against_transformers(hf_model, prompt: list[int], out, params: SamplingParams, greedy: bool) -> None:
    """Each reported step equals the shaped log-softmax of transformers' logits over that sample's own history."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for step, entry in enumerate(out.logprobs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out.token_ids[:step]])).logits[0, -1].float()
        expected = torch.log_softmax(_reference_shaping(logits, prompt, out.token_ids[:step], params), -1)
        assert entry.token_id == out.token_ids[step]
        if greedy:
            assert entry.token_id == int(expected.argmax())
        assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-4)
        top = torch.topk(expected, params.top_logprobs)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_of_each_step_are_the_shaped_log_softmax_of_transformers_logits(make_core, loaded_fp32,
                                                                                  hf_model) -> None:
    core = make_core()
    prompt = chat_ids(loaded_fp32.tokenizer, QUESTIONS[4])
    with torch.no_grad():
        banned = int(hf_model(torch.tensor([prompt])).logits[0, -1].argmax())
    params = SamplingParams(max_tokens=4, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                            logit_bias=((banned, -100.0), (42, 3.0)), logprobs=True, top_logprobs=5)
    plain = SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3)
    shaped_req, plain_req = core.make_request(prompt, params), core.make_request(prompt, plain)
    core.add(shaped_req)
    core.add(plain_req)
    finals = run_to_end(core)
    for req in (shaped_req, plain_req):
        out = finals[req.request_id].outputs[0]
        assert len(out.token_ids) == 4
        _check_against_transformers(hf_model, prompt, out, req.params, greedy=True)
    assert banned not in finals[shaped_req.request_id].outputs[0].token_ids
    assert finals[plain_req.request_id].outputs[0].token_ids[0] == banned


def test_n_samples_are_penalized_by_their_own_tokens(make_core, loaded_fp32, hf_model) -> None:
    """Forks start from the parent's counts, then count only their own tokens."""
    core = make_core()
    prompt = chat_ids(loaded_fp32.tokenizer, QUESTIONS[1])
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=2, frequency_penalty=2.0, presence_penalty=1.0,
                            logprobs=True, top_logprobs=3, ignore_eos=True)
    req = core.make_request(prompt, params)
    core.add(req)
    outputs = run_to_end(core)[req.request_id].outputs
    assert len(outputs) == 2 and outputs[0].token_ids[1:] != outputs[1].token_ids[1:]  # they diverged
    for out in outputs:
        _check_against_transformers(hf_model, prompt, out, params, greedy=False)


def test_a_step_that_shapes_and_reports_logprobs_still_transfers_once_each_way(make_core, loaded_fp32,
                                                                                monkeypatch) -> None:
    core = make_core()
    watch, counts = _watch(core, monkeypatch)
    tokenizer = loaded_fp32.tokenizer
    core.add(core.make_request(chat_ids(tokenizer, QUESTIONS[0]),
                               SamplingParams(max_tokens=4, frequency_penalty=1.0, logprobs=True, top_logprobs=2)))
    core.add(core.make_request(chat_ids(tokenizer, QUESTIONS[1]),
                               SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=2, repetition_penalty=1.2,
                                              logit_bias=((11, 5.0),), logprobs=True)))
    core.add(core.make_request(chat_ids(tokenizer, QUESTIONS[2]), SamplingParams(max_tokens=4)))
    steps = _run_watched(core, watch, counts)
    assert steps and all(step == {"upload": 1, "download": 1, "bad": []} for step in steps), steps


def test_beam_search_does_not_combine_with_shaping_or_logprobs() -> None:
    for extra in ({"logprobs": True}, {"frequency_penalty": 0.5}, {"logit_bias": ((1, 1.0),)}):
        with pytest.raises(ValueError, match="beam search"):
            SamplingParams(beam_width=2, **extra)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=2)
