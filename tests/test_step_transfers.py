"""Host-device hygiene of the engine step (what lets it run well on a GPU), held on the CPU.

A step must cross between host and device exactly twice: one upload of its packed metadata
and one download of its sampled ids (`chatcore.engine.transfers.StepTransfers`). Anything else
that reads device data back (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `int(t)`, `bool(t)`,
`nonzero`) or builds a tensor from host data or on the default device would synchronise, or
copy, on a GPU. A `TorchFunctionMode` sees every such call during `core.step()`; calls inside
the seam are the allowed ones, and calls inside `kernels.*` are left out (on CUDA those are
Triton launches; their CPU reference path is not what runs there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from chatcore.engine import step_sampler as sampler_module
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams
from chatcore.kernels import dispatch as kernels
from tests.engine_helpers import LONG_SYSTEM, QUESTIONS, chat_ids

pytestmark = pytest.mark.model
READS_BACK = {"tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "nonzero",
              "masked_select"}
FROM_HOST = {"tensor", "as_tensor", "from_numpy", "frombuffer"}
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm", "eye", "linspace"}


class StepWatch(TorchFunctionMode):
    """Records the calls a GPU step must not make, outside the seam and the kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.exempt = 0
        self.bad: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if not self.exempt:
            name = getattr(func, "__name__", str(func))
            # `.to("cpu")` spelled out (a device object may be the engine's own device, the CPU here).
            moves_to_host = name == "to" and "cpu" in (*args[1:], kwargs.get("device"))
            if (name in READS_BACK or name in FROM_HOST or moves_to_host
                    or (name in FACTORIES and kwargs.get("device") is None)):
                self.bad.append(name)
        return func(*args, **kwargs)

    @contextmanager
    def exempted(self) -> Iterator[None]:
        self.exempt += 1
        try:
            yield
        finally:
            self.exempt -= 1


def _watch(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> tuple[StepWatch, dict[str, int]]:
    watch = StepWatch()
    counts = {"upload": 0, "download": 0}
    transfers = core.runner.transfers
    for name in ("upload", "download"):
        real = getattr(transfers, name)

        def seam(*args, _real=real, _name=name):  # type: ignore[no-untyped-def]
            counts[_name] += 1
            with watch.exempted():
                return _real(*args)

        monkeypatch.setattr(transfers, name, seam)
    for name in ("paged_decode_attention", "store_kv", "copy_blocks"):
        real = getattr(kernels, name)

        @functools.wraps(real)
        def kernel(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            with watch.exempted():
                return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, kernel)
    return watch, counts


def _run_watched(core: EngineCore, watch: StepWatch, counts: dict[str, int]) -> list[dict[str, Any]]:
    """Step to the end; for each step that ran the model: its uploads, downloads and bad calls."""
    steps = []
    finals = {}
    while core.has_work:
        before = dict(counts)
        ran = core.steps
        watch.bad.clear()
        with watch:
            outputs = core.step()
        finals.update({o.request_id: o for o in outputs if o.finished})
        if core.steps > ran:
            steps.append({"upload": counts["upload"] - before["upload"],
                          "download": counts["download"] - before["download"], "bad": list(watch.bad)})
    assert all(o.error is None for o in finals.values())
    return steps


def _mixed_requests(core: EngineCore, tokenizer: Any) -> list[int]:
    """Greedy, seeded sampling with top-k/top-p and n=2 (forks: copy-on-write), beam search, and
    a long shared system prompt; returns a next turn's prompt, which continues a cached history."""
    first = chat_ids(tokenizer, QUESTIONS[0], LONG_SYSTEM)
    core.add(core.make_request(first, SamplingParams(max_tokens=5)))
    core.add(core.make_request(chat_ids(tokenizer, QUESTIONS[1], LONG_SYSTEM),
                               SamplingParams(max_tokens=5, temperature=0.8, top_k=40, top_p=0.9, seed=7, n=2)))
    core.add(core.make_request(chat_ids(tokenizer, QUESTIONS[2]), SamplingParams(max_tokens=4, beam_width=2)))
    return first + first[-20:]


def test_a_step_uploads_once_downloads_once_and_reads_nothing_else_back(make_core, loaded_fp32, monkeypatch) -> None:
    core = make_core()
    watch, counts = _watch(core, monkeypatch)
    kinds = {"copies": 0, "continuations": 0}

    def seen(plan: Any) -> None:
        kinds["copies"] += len(plan.copies)
        kinds["continuations"] += sum(1 for e in plan.prefill if e.start > 0)

    core.on_step.append(seen)
    next_turn = _mixed_requests(core, loaded_fp32.tokenizer)
    steps = _run_watched(core, watch, counts)
    core.add(core.make_request(next_turn, SamplingParams(max_tokens=3)))  # alone: the continuation path
    steps += _run_watched(core, watch, counts)
    assert len(steps) >= 5 and kinds["copies"] > 0 and kinds["continuations"] > 0, (len(steps), kinds)
    for i, step in enumerate(steps):
        assert step == {"upload": 1, "download": 1, "bad": []}, f"step {i}: {step}"


def test_the_watch_catches_a_read_back_added_to_the_step(make_core, loaded_fp32, monkeypatch) -> None:
    """The check above can fail: an `.item()` slipped into sampling is reported."""
    core = make_core()
    watch, counts = _watch(core, monkeypatch)
    real = sampler_module.sample

    def sample_and_peek(logits: torch.Tensor, params: SamplingParams, generator: Any) -> torch.Tensor:
        token = real(logits, params, generator)
        token.item()
        return token

    monkeypatch.setattr(sampler_module, "sample", sample_and_peek)
    core.add(core.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[3]),
                               SamplingParams(max_tokens=2, temperature=0.7, seed=1)))
    steps = _run_watched(core, watch, counts)
    assert steps and all(step["bad"] == ["item"] for step in steps), steps
