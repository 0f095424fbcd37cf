"""The engine's decode steps run through the Triton kernels (in Triton's interpreter, on CPU
tensors) and greedy output still equals transformers, token for token, in fp32.

On CUDA the same engine code calls the same kernels compiled (each step's attention, prefill chunks and
decode rows together, one `unified_attention` launch a layer); here `TRITON_INTERPRET=1`
routes `kernels.*` to them at every call (kernels/_triton.py). Small on purpose: the
interpreter runs each Triton program in Python. Three chat prompts, each longer than two
blocks: two share a system prompt and run concurrently, one asks for two greedy samples
(which share their prompt's last block, so a write copies it: `copy_blocks`), and the pool is
small enough that a request is preempted and resumed.
"""

from __future__ import annotations

from collections import Counter

import pytest
import triton  # noqa: F401  imported before TRITON_INTERPRET is set: see kernels/_triton.py

from chatcore.engine.request import SamplingParams
from chatcore.kernels import cache_ops, unified_attention
from tests.engine_helpers import QUESTIONS, chat_ids, hf_greedy, run_to_end

pytestmark = pytest.mark.model
SYSTEM = "You are Atlas, the support assistant of a travel agency. Answer briefly."
MAX_TOKENS = 6


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Run the kernels in Triton's interpreter and count the launches of each."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls: Counter[str] = Counter()
    for module, name in ((unified_attention, "unified_attention"), (cache_ops, "store_kv"),
                         (cache_ops, "copy_blocks")):
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_interpreted_kernels_serve_the_engine_exactly(make_core, loaded_fp32, hf_model, triton_calls) -> None:
    tok = loaded_fp32.tokenizer
    # The interpreter runs each step for seconds; a preempted request must not age out while it waits.
    core = make_core(block_size=4, num_blocks=16, low_watermark=0.0, high_watermark=0.0, max_queue_wait_s=3600)
    prompts = [chat_ids(tok, QUESTIONS[0], SYSTEM), chat_ids(tok, QUESTIONS[1], SYSTEM), chat_ids(tok, QUESTIONS[2])]
    assert all(len(p) > 2 * 4 for p in prompts)
    params = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=MAX_TOKENS),
              SamplingParams(max_tokens=MAX_TOKENS, n=2)]
    requests = [core.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for req in requests:
        core.add(req)
    finals = run_to_end(core)
    for req, prompt in zip(requests, prompts, strict=True):
        out = finals[req.request_id]
        assert out.error is None
        expected = hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert [o.token_ids for o in out.outputs] == [expected] * req.params.n, req.request_id
    shared = finals[requests[1].request_id].usage.cached_tokens
    assert shared >= len(chat_ids(tok, "", SYSTEM)) // 4 * 4 - 8, "the second request reuses the system prompt"
    assert core.scheduler.preemptions > 0
    # Every step's attention, prefill chunks and decode rows together, is one launch a layer.
    assert triton_calls["unified_attention"] == triton_calls["store_kv"] >= MAX_TOKENS * loaded_fp32.num_layers
    assert triton_calls["store_kv"] > 0 and triton_calls["copy_blocks"] > 0
