"""Honest baselines (issue 36, target 6): a verdict is inconclusive when the baseline it compares with
moved by more than 20% between repeats, and transformers' static batching and cold prefill run on
its static cache. Pure functions, and a tiny random model for the transformers paths (no download)."""

from __future__ import annotations

import math

import pytest

from chatcore.bench.cli import exit_code
from chatcore.bench.common import BASELINE_MOVED, baseline_note, baseline_spread, reported, target


def test_baseline_spread_is_range_over_median() -> None:
    assert baseline_spread([100.0, 110.0, 125.0]) == pytest.approx(25 / 110)
    assert baseline_spread([2.0, 2.0]) == 0
    assert baseline_spread([1.0, float("nan"), 1.5]) == pytest.approx(0.5 / 1.25)  # NaN repeats left out
    assert baseline_spread([5.0]) is None and baseline_spread([]) is None  # one repeat checks nothing
    assert baseline_spread([0.0, 0.0, 0.0]) is None
    assert BASELINE_MOVED == 0.20


def test_a_moved_baseline_makes_any_verdict_inconclusive() -> None:
    # Met, and comfortably, but the baseline moved 40%: the ratio cannot be trusted.
    moved = target("fast", 3.0, ">=", 1.3, "ours vs theirs", runs=[2.9, 3.0, 3.1], baseline_runs=[100.0, 120.0, 140.0])
    assert moved["verdict"] == "inconclusive" and moved["met"] is False
    assert moved["baseline_spread"] == pytest.approx(40 / 120) and moved["baseline_runs"] == [100.0, 120.0, 140.0]
    assert moved["detail"].startswith("ours vs theirs; baseline moved 33% between 3 repeats (100, 120, 140)")
    assert "inconclusive" in moved["detail"]
    assert exit_code({"a": {"targets": [moved]}}, 0, fail_on_missed=True) == 1
    # A miss stays unjudged too.
    assert target("slow", 0.5, "<=", 0.3, baseline_runs=[1.0, 1.3])["verdict"] == "inconclusive"


def test_a_steady_baseline_keeps_the_verdict() -> None:
    steady = target("fast", 3.0, ">=", 1.3, "ours vs theirs", baseline_runs=[100.0, 110.0, 119.0])
    assert steady["verdict"] == "met" and steady["met"] is True
    assert steady["detail"] == "ours vs theirs; baseline moved 17% between 3 repeats (100, 110, 119)"
    # 20% exactly is not more than 20%.
    assert target("at the edge", 3.0, ">=", 1.3, baseline_runs=[90.0, 100.0, 110.0])["verdict"] == "met"
    assert target("slow", 0.5, "<=", 0.3, baseline_runs=[1.0, 1.1])["verdict"] == "missed"
    # Repeats on both sides of the threshold are still inconclusive with a steady baseline.
    assert target("spread", 1.35, ">=", 1.3, runs=[1.2, 1.4], baseline_runs=[1.0, 1.0])["verdict"] == "inconclusive"


def test_a_single_repeat_says_so_and_is_judged_on_its_value() -> None:
    once = target("quick", 0.2, "<=", 0.3, "x vs y", runs=[0.2], baseline_runs=[812.0])
    assert once["verdict"] == "met" and once["baseline_spread"] is None
    assert once["detail"] == "x vs y; " + baseline_note([812.0])
    assert "one repeat" in baseline_note([812.0])
    unmeasured = target("failed baseline", float("nan"), ">=", 1.5, baseline_runs=[])
    assert unmeasured["verdict"] == "missed" and unmeasured["detail"] == "baseline not measured"


def test_targets_without_baseline_runs_are_unchanged() -> None:
    plain = target("plain", 2.0, ">=", 1.0, "detail")
    assert plain["verdict"] == "met" and plain["detail"] == "detail"
    assert plain["baseline_runs"] is None and plain["baseline_spread"] is None
    assert reported("figure", 1.5)["verdict"] == "reported"


def _sessions_run(hot_before: float, hot_after: float, device_cached: int) -> dict:
    """A sessions run's summary (`bench.sessions._summary`) from made-up turns: one final turn of 1,000
    tokens at 120 ms, 800 of its 900 history tokens read from disk; hot probes whose pins held `device_cached`."""
    from chatcore.bench import sessions

    def turn(ttft: float, cached_device: int, cached_disk: int, history: int = 0) -> dict:
        return {"ttft_ms": ttft, "prompt_tokens": 1000, "cached_tokens": cached_device + cached_disk,
                "cached_device_tokens": cached_device, "cached_disk_tokens": cached_disk,
                "recomputed_tokens": 1000 - cached_device - cached_disk, "history_tokens": history}

    probes = [[turn(500.0, 0, 0), turn(ms, device_cached, 0, 900)] for ms in (hot_before,) * 3 + (hot_after,) * 3]
    cold = [turn(1000.0, 0, 0)] * 6
    run = sessions._summary([[turn(120.0, 100, 800)]], sessions._hot(probes, 16), cold, cold)
    return {"sessions": 1, "turns": 2, "working_set_over_tiers": 1.5, **run,
            "replay": {"policies": {p: {"hit_rate": 0.5, "of_belady": 1.0} for p in ("session", "belady", "lru",
                                                                                      "one_slot")}}}


def test_sessions_targets_compare_with_hot_and_judge_its_repeats() -> None:
    """Issue 36, target 5: a run's final turn against hot (the same turn on pinned sessions), from disk
    on the overflow run; the hot probes' medians before and after the trace are the baseline's repeats."""
    from chatcore.bench import sessions

    run = _sessions_run(100.0, 110.0, 899)
    assert run["hot"]["ttft_ms"] == 100.0 and run["hot"]["served_hot"] == 6
    assert run["final_over_hot"] == pytest.approx(1.2) and run["disk_final"]["over_hot"] == pytest.approx(1.2)
    targets = sessions._targets({"64x10": run, "overflow": run}, "session")
    judged = [t for t in targets if t["verdict"] != "reported"]
    assert [(t["name"], t["verdict"]) for t in judged] == [
        ("64x10: final-turn median TTFT <= 1.25x hot", "met"),
        ("overflow: final turns from the disk tier, median TTFT <= 1.6x hot", "met"),
        ("overflow replay: session policy hit rate >= 80% of Belady's", "met")]
    assert judged[0]["baseline_runs"] == [100.0, 110.0] and "120 ms vs hot TTFT" in judged[0]["detail"]
    assert "1 of 1 final turns had disk hits, median 120 ms vs hot TTFT" in judged[1]["detail"]
    assert [t["name"] for t in targets if t["verdict"] == "reported"] == [
        "64x10: final-turn median TTFT / cold", "64x10: final-turn median TTFT / transformers cold prefill",
        "overflow (1.50x the tiers): final-turn median TTFT / hot", "overflow: final-turn median TTFT / cold",
        "overflow: final-turn median TTFT / transformers cold prefill"]
    # The hot baseline moved 30% between before and after the trace: inconclusive.
    moved_run = _sessions_run(100.0, 130.0, 899)
    moved = sessions._targets({"64x10": moved_run, "overflow": moved_run}, "session")
    assert [t["verdict"] for t in moved if " hot" in t["name"] and t["verdict"] != "reported"] == ["inconclusive"] * 2
    # A probe whose final turn missed its pin (half its history recomputed) was no hot baseline: inconclusive.
    cold_probes = _sessions_run(100.0, 110.0, 450)
    assert cold_probes["hot"]["served_hot"] == 0
    missed = sessions._targets({"64x10": cold_probes, "overflow": cold_probes}, "session")
    assert missed[0]["verdict"] == "inconclusive" and "not a hot baseline" in missed[0]["detail"]


def _tiny_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_models import SHAPE

    config = AutoConfig.for_model("llama", **{**SHAPE, "vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2,
                                              "pad_token_id": 0})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_static_batching_uses_the_static_cache_and_decodes_the_same_tokens() -> None:
    import torch

    from chatcore.bench import baselines

    model = _tiny_model()
    prompts = [[5 + i % 200 for i in range(n)] for n in (9, 23, 16)]
    config = baselines.static_cache_config(model, 6, 0)
    assert config.cache_implementation == "static" and not config.do_sample and config.min_new_tokens == 6
    run = baselines.hf_static(model, prompts, 6, 0, config=config)
    assert run.note == "static cache" and run.output_tokens == 3 * 6
    assert baselines.hf_static(model, prompts, 6, 0).note == "dynamic cache"

    def tokens(cfg) -> torch.Tensor:
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, generation_config=cfg)[:, width:]

    assert torch.equal(tokens(config), tokens(baselines.greedy_config(model, 6, 0)))


def test_hf_cold_ttft_is_a_prefill_and_the_greedy_first_token() -> None:
    import torch

    from chatcore.bench import baselines

    model = _tiny_model()
    prompt = [7 + (3 * i) % 250 for i in range(40)]
    first, seconds = baselines.hf_cold_ttft(model, prompt)
    assert seconds > 0 and not math.isnan(seconds)
    config = baselines.greedy_config(model, 1)
    config.min_new_tokens = None  # EOS allowed, as the plain argmax allows it
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    assert first == int(out[0, -1])
