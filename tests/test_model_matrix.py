"""The engine serves each supported architecture exactly, and refuses at load the ones it would not.

Every model here is tiny, with random weights, built from its config inside the test (no
download), and compared in fp32 against transformers' own `generate` and forward.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from chatcore.cache import audit
from chatcore.config import Settings
from chatcore.engine.core import EngineCore
from chatcore.engine.errors import RequestRejected
from chatcore.engine.request import SamplingParams
from chatcore.models.errors import UnsupportedModel
from chatcore.models.loader import LoadedModel, load_model
from tests.engine_helpers import QUESTIONS, add_all, chat_ids, hf_greedy, run_to_end
from tests.tiny_models import save_tiny_model

SYSTEM = "You are a travel agent. Refunds are possible before departure; travel insurance is recommended."
SUPPORTED = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": None},
    "gemma": {},
    "cohere": {"logit_scale": 0.25},  # logits scaled in the top-level forward
    "granite": {"logits_scaling": 4.0, "attention_multiplier": 0.5, "embedding_multiplier": 2.0},
}


def _load(folder: Path) -> tuple[LoadedModel, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    loaded = load_model(Settings(model=str(folder), dtype="float32", device="cpu"))
    return loaded, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _core(loaded: LoadedModel) -> EngineCore:
    return EngineCore(loaded, Settings(dtype="float32", device="cpu", num_blocks=96, block_size=8, debug_audit=True))


def _assert_all_blocks_accounted_for(core: EngineCore) -> None:
    report = audit(core.pool)
    assert report.ok, report.format()
    assert report.used == 0, report.format()


@pytest.fixture(scope="module", params=list(SUPPORTED))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Any]:
    return _load(save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, **SUPPORTED[request.param]))


def test_greedy_equals_transformers_with_a_prefix_hit_and_a_batch_of_3(tiny: tuple[LoadedModel, Any]) -> None:
    loaded, reference = tiny
    core = _core(loaded)
    tokenizer = loaded.tokenizer
    first = core.make_request(chat_ids(tokenizer, QUESTIONS[0], SYSTEM), SamplingParams(max_tokens=12))
    core.add(first)
    finals = run_to_end(core)
    prompts = [chat_ids(tokenizer, QUESTIONS[1], SYSTEM), chat_ids(tokenizer, QUESTIONS[2]),
               chat_ids(tokenizer, QUESTIONS[3])]
    batch = [core.make_request(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, (16, 10, 14), strict=True)]
    add_all(core, batch)
    finals.update(run_to_end(core))

    for req, max_tokens in zip([first, *batch], (12, 16, 10, 14), strict=True):
        out = finals[req.request_id]
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(reference, req.prompt, max_tokens), req.request_id
    shared = len(chat_ids(tokenizer, "", SYSTEM)) - 8
    assert shared >= 2 * core.pool.block_size
    assert finals[batch[0].request_id].usage.cached_tokens >= (shared // core.pool.block_size) * core.pool.block_size
    _assert_all_blocks_accounted_for(core)


def test_logprobs_equal_transformers_after_the_top_level_forward(tiny: tuple[LoadedModel, Any]) -> None:
    """Log-probs see what greedy cannot: the logit scaling and final steps of the top-level forward."""
    loaded, reference = tiny
    core = _core(loaded)
    prompt = chat_ids(loaded.tokenizer, QUESTIONS[4])
    req = core.make_request(prompt, SamplingParams(max_tokens=4, logprobs=True))
    core.add(req)
    out = run_to_end(core)[req.request_id].outputs[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1: -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.token_ids).unsqueeze(1))[:, 0]
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    _assert_all_blocks_accounted_for(core)


def test_a_sliding_window_caps_the_context_where_it_masks_nothing(tmp_path: Path) -> None:
    window = 48
    loaded, reference = _load(save_tiny_model(tmp_path, "mistral", sliding_window=window))
    assert loaded.max_context == window
    core = _core(loaded)
    prompt = chat_ids(loaded.tokenizer, QUESTIONS[2])
    room = window - len(prompt)
    assert room >= 12
    with pytest.raises(RequestRejected):
        core.add(core.make_request(prompt, SamplingParams(max_tokens=room + 1)))
    req = core.make_request(prompt, SamplingParams(max_tokens=room, ignore_eos=True))
    core.add(req)
    out = run_to_end(core)[req.request_id]
    ids = torch.tensor([prompt])
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=room, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected
    _assert_all_blocks_accounted_for(core)


MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 8, "kv_lora_rank": 16,
       "q_lora_rank": None, "num_key_value_heads": 4, "first_k_dense_replace": 2}
REFUSED = [
    ("gemma2", {}, r"attention logit softcap \(softcap\)"),
    ("gpt_oss", {"num_local_experts": 2, "num_experts_per_tok": 1}, r"attention sinks \(s_aux\)"),
    ("bloom", {}, r"unknown layout: 2 layers, but the attention function was called for layers \[\]"),
    ("deepseek_v3", MLA, r"unknown layout: layer 0 has query/key/value head sizes 16/16/8"),
]


@pytest.mark.parametrize(("model_type", "overrides", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_attention_the_paged_path_cannot_reproduce_is_refused_in_one_line(
        tmp_path: Path, model_type: str, overrides: dict[str, Any], reason: str) -> None:
    folder = save_tiny_model(tmp_path, model_type, **overrides)
    with pytest.raises(UnsupportedModel, match=reason) as refused:
        load_model(Settings(model=str(folder), dtype="float32", device="cpu"))
    assert str(refused.value).startswith(f"model {folder} is refused: ")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hello", "--max-tokens", "2"], ["serve", "--port", "0"]])
def test_the_command_line_prints_a_refusal_as_one_line_and_exits_2(tmp_path: Path, command: list[str]) -> None:
    folder = save_tiny_model(tmp_path / "gemma2", "gemma2")
    done = subprocess.run([sys.executable, "-m", "chatcore.cli", command[0], "--model", str(folder), "--device", "cpu",
                           *command[1:]], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CHATCORE_DATA_DIR": str(tmp_path / "data")})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("chatcore: ")]
    assert lines == [(f"chatcore: model {folder} is refused: layer 0 uses an attention logit softcap (softcap), "
                      "which the paged attention does not implement")]
