"""The transformers baselines: `generate` one request at a time, static batched `generate`
with left padding and transformers' static cache, transformers' own continuous batching
(`generate_batch`), and a cold prefill of one prompt into a static cache (`hf_cold_ttft`).

All take token-id prompts, decode greedily with EOS disabled (so every request produces exactly
`max_new_tokens`), and report times measured from the moment the requests were handed over.
TTFT is taken by a stopping criterion, which transformers calls right after each new token.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList


@dataclass
class BatchRun:
    """One run of a set of requests that all arrived at t=0."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float]  # per request, from t=0 (arrival)
    own_ttft_s: list[float] | None = None  # per request, from its own start (sequential only)
    decode_tok_s: float | None = None
    cached_tokens: int = 0
    note: str = ""
    full_decode_tokens: int = 0  # chatcore: tokens decoded in steps where every request decodes, no prefill
    full_decode_s: float = 0.0  # and those steps' time
    # chatcore: (decode rows, prefill tokens, seconds) of each timed step; and of each step run under
    # torch.profiler instead (`engine_runs.run_batch`'s `profile_steps`), its ops' split and wall seconds
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    profiled: list[tuple[dict[str, float], float]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


class FirstTokenClock(StoppingCriteria):
    """Records when the first new token exists; never stops anything."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        if self.first is None:
            self.first = time.perf_counter()
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def greedy_config(model: Any, max_new_tokens: int, pad_token_id: int | None = None) -> GenerationConfig:
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.temperature = None
    config.top_p = None
    config.top_k = None
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = max_new_tokens  # EOS suppressed: a fixed amount of work
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    return config


def static_cache_config(model: Any, max_new_tokens: int, pad_token_id: int | None = None) -> GenerationConfig:
    """`greedy_config` with transformers' static cache (`cache_implementation="static"`): `generate`
    allocates the KV cache once at prompt + `max_new_tokens` and writes each step in place, instead
    of a `DynamicCache` that grows by `torch.cat` every step. Same greedy tokens.

    On a GPU, `generate` then compiles its decode step itself. On the CPU it does not:
    transformers compiles there only when a private flag asks (`CompileConfig._compile_all_devices`,
    "often not optimal, but useful for testing purposes"), so the eager static cache is the
    library's own path on the CPU, and the one measured (docs/benchmarks.md, "throughput")."""
    config = greedy_config(model, max_new_tokens, pad_token_id)
    config.cache_implementation = "static"
    return config


@torch.inference_mode()
def hf_cold_ttft(model: Any, prompt: list[int]) -> tuple[int, float]:
    """transformers' cold prefill of one prompt, batch 1: one forward over the whole prompt into a
    fresh static cache (`StaticCache`, allocated by that forward as `generate` allocates it), then
    the first token, greedy. Returns (that token's id, TTFT in seconds). The LM head runs on the
    last position only (`logits_to_keep=1`, as `generate`'s prefill does)."""
    from transformers import StaticCache

    ids = torch.tensor([prompt], device=model.device)
    t0 = time.perf_counter()
    cache = StaticCache(config=model.config, max_cache_len=len(prompt) + 1)
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    first = int(logits[0, -1].argmax())  # on a GPU this waits for the forward
    return first, time.perf_counter() - t0


@torch.inference_mode()
def hf_one(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[int, float, float]:
    """One request through `generate`: (new tokens, TTFT s, total s)."""
    ids = torch.tensor([prompt], device=model.device)
    clock = FirstTokenClock()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(model, max_new_tokens),
                         stopping_criteria=StoppingCriteriaList([clock]))
    total = time.perf_counter() - t0
    assert clock.first is not None
    return out.shape[1] - len(prompt), clock.first - t0, total


def hf_sequential(model: Any, prompts: list[list[int]], max_new_tokens: int) -> BatchRun:
    """One request at a time, in arrival order: request i waits for requests 0..i-1."""
    t0 = time.perf_counter()
    ttft, own, tokens = [], [], 0
    decode_time = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        new, first, total = hf_one(model, prompt, max_new_tokens)
        tokens += new
        own.append(first)
        ttft.append(start - t0 + first)
        decode_time += total - first
    wall = time.perf_counter() - t0
    decode = (tokens - len(prompts)) / decode_time if decode_time > 0 else None
    return BatchRun(wall, tokens, ttft, own_ttft_s=own, decode_tok_s=decode)


@torch.inference_mode()
def hf_static(model: Any, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int,
              config: GenerationConfig | None = None) -> BatchRun:
    """All requests in one left-padded batch: nobody gets a token before the whole batch's prefill.
    `config` replaces the greedy one (`static_cache_config`, say); it must decode `max_new_tokens` greedily."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    clock = FirstTokenClock()
    t0 = time.perf_counter()
    ids, mask = ids.to(model.device), mask.to(model.device)
    config = config or greedy_config(model, max_new_tokens, pad_token_id)
    out = model.generate(ids, attention_mask=mask, generation_config=config,
                         stopping_criteria=StoppingCriteriaList([clock]))
    wall = time.perf_counter() - t0
    assert clock.first is not None
    new = out.shape[1] - width
    decode = (len(prompts) * (new - 1)) / (wall - (clock.first - t0)) if new > 1 else None
    return BatchRun(wall, len(prompts) * new, [clock.first - t0] * len(prompts), decode_tok_s=decode,
                    note=f"{config.cache_implementation or 'dynamic'} cache")


@torch.inference_mode()
def hf_continuous(model: Any, prompts: list[list[int]], max_new_tokens: int, *, page_size: int = 32,
                  num_blocks: int = 512, max_batch_tokens: int = 512, sharing: bool = True) -> BatchRun:
    """transformers' continuous batching, with prefix sharing where it supports it.

    `generate_batch` allocates its paged cache inside the call; here the manager and its cache
    are built (`warmup` creates the batch processor) before the timer starts, as chatcore's pool
    is, and the timer covers handing the requests over to the last result. The prompt tokens its
    prefix cache matched are counted (`cached_tokens`)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = greedy_config(model, max_new_tokens)
    config.min_new_tokens = None
    config.eos_token_id = None  # CB: "eos_token_id not set ... disabled"
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  allow_block_sharing=sharing)
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level = cb_logger.level
    cb_logger.setLevel(logging.ERROR)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    try:
        manager.warmup()
        matched = _count_prefix_matches(manager.batch_processor.cache)
        manager.start()
        finished: dict[str, Any] = {}
        t0 = time.perf_counter()  # transformers stamps with perf_counter too
        manager.add_requests(inputs=prompts, max_new_tokens=max_new_tokens, record_timestamps=True)
        while len(finished) < len(prompts) and manager.is_running():
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished[result.request_id] = result
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
        cb_logger.setLevel(level)
    results = list(finished.values())
    errors = [r.error for r in results if r.error]
    if errors or len(results) != len(prompts):
        raise RuntimeError(f"continuous batching failed: {errors[:2]} ({len(results)} of {len(prompts)} results)")
    tokens = sum(len(r.generated_tokens) for r in results)
    ttft = [r.timestamps[0] - t0 for r in results if r.timestamps]
    return BatchRun(wall, tokens, ttft, decode_tok_s=_all_decoding_rate(results), cached_tokens=sum(matched),
                    note=f"page {page_size}, {num_blocks} blocks, max {max_batch_tokens} tokens/batch, "
                         f"sharing {'on' if sharing else 'off'}")


def _count_prefix_matches(cache: Any) -> list[int]:
    """The prompt tokens each lookup of `cache`'s prefix cache matches, appended as it looks them up."""
    matched: list[int] = []
    search = cache.search_prefix_match

    def counted(request_id: str, prompt_ids: list[int]) -> int:
        matched.append(search(request_id, prompt_ids))
        return matched[-1]

    cache.search_prefix_match = counted
    return matched


def _all_decoding_rate(results: list[Any]) -> float | None:
    """Tokens stamped in the window in which every request was decoding / its length; None if there is none."""
    firsts = [r.timestamps[0] for r in results if r.timestamps]
    lasts = [r.timestamps[-1] for r in results if r.timestamps]
    if not firsts or max(firsts) >= min(lasts):
        return None
    lo, hi = max(firsts), min(lasts)
    inside = sum(1 for r in results for t in (r.timestamps or []) if lo < t <= hi)
    return inside / (hi - lo)
