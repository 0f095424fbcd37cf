"""`make gpu-check`'s dress rehearsal on the CPU, so the check cannot rot between loans of a GPU.

The rehearsal runs the very script a lent machine runs (bench/gpu_check.sh), with every stage at toy sizes,
under a Python that sees only what that machine has of ours: torch, triton, transformers and pytest (the
image's own there) and the packages `make gpu-prepare` carries as wheels, each with what it requires. A new
import on the check's path of anything else fails here as it would there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatcore.bench import gpu_prepare
from chatcore.bench.gpu_check import failures
from chatcore.bench.gpu_runner import run_child
from tests.image_env import image_python

REPO = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = ["device", "commit", "fp32_exact", "engine_64_defaults_tok_s", "engine_256_defaults_tok_s",
                "hf_static_compiled_64_tok_s", "hf_eager_64_tok_s", "gpu_busy_share_64", "launches_per_decode_step",
                "kernel_copy_bw_fraction", "ttft_p50_64_s", "prefill_tok_s_64", "launches_per_prefill_step_64"]
IMAGE_ROOTS = ("torch", "triton", "transformers", "pytest", *gpu_prepare.CARRIED)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, default_model_dir: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    tmp = tmp_path_factory.mktemp("gpu-check")
    assert gpu_prepare.main(["--no-wheels", "--out", str(tmp / "staged")]) == 0  # the model's config, tokenizer
    python = image_python(tmp / "image", IMAGE_ROOTS)
    report = tmp / "out" / "gpu-check.json"
    env = {**os.environ, "PYTHON": str(python), "GPU_CHECK_SITE": str(tmp / "site")}
    env.pop("PYTHONPATH", None)  # the script puts the checkout first itself
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--rehearse", "--model-src",
                           str(tmp / "staged" / "model"), "--work", str(tmp / "work"), "--out", str(report)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(report.read_text())


def test_rehearsal_summary_has_exactly_the_keys_and_sane_values(rehearsal) -> None:
    _, report = rehearsal
    summary = report["summary"]
    assert list(summary) == SUMMARY_KEYS
    assert summary["device"] == "cpu (rehearsal)"
    assert summary["commit"] and summary["fp32_exact"] == "8/8"
    for key in ("engine_64_defaults_tok_s", "engine_256_defaults_tok_s", "hf_static_compiled_64_tok_s",
                "hf_eager_64_tok_s", "kernel_copy_bw_fraction", "ttft_p50_64_s", "prefill_tok_s_64"):
        assert isinstance(summary[key], float) and summary[key] > 0, (key, summary[key])
    # No CUDA kernels on the CPU: the profile ran (its step time) and says why the two figures are null.
    assert summary["gpu_busy_share_64"] is None and summary["launches_per_decode_step"] is None
    assert summary["launches_per_prefill_step_64"] is None and report["stages"]["profile"]["prefill_steps"] >= 1
    assert report["stages"]["profile"]["step_ms"] > 0 and "no CUDA kernels" in report["stages"]["profile"]["note"]
    assert report["ok"] and report["failures"] == [] and report["errors"] == {}


def test_rehearsal_ran_every_stage_at_toy_sizes_without_the_servers_packages(rehearsal) -> None:
    done, report = rehearsal
    stages = report["stages"]
    assert list(stages) == ["model", "fidelity_fp32", "engine", "hf_eager", "profile", "kernel", "kernel_tests",
                            "hf_compiled"]
    assert [run["chats"] for run in stages["engine"]["runs"]] == [4, 8]
    assert all(run["tokens"] == run["chats"] * report["plan"]["new_tokens"] for run in stages["engine"]["runs"])
    assert stages["engine"]["audit_ok"] and stages["fidelity_fp32"]["audit_ok"] and stages["profile"]["audit_ok"]
    assert stages["hf_compiled"]["compiled_graphs"] >= 1
    assert stages["kernel_tests"]["passed"] and "skipped" in stages["kernel_tests"]["summary"]  # CUDA cases only
    assert stages["model"]["seed"] == 0 and report["versions"]["xgrammar"]
    assert "gpu-check: ok in" in done.stdout


def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path) -> None:
    started = time.perf_counter()
    sleeper = ("import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
               "print('started', flush=True); time.sleep(120)")
    outcome = run_child([sys.executable, "-c", sleeper], 3, tmp_path / "log")
    assert outcome.timed_out and "started" in outcome.log
    assert time.perf_counter() - started < 30  # a grandchild holding the log open does not keep us waiting


@pytest.mark.parametrize(("stages", "expected"), [
    ({"fidelity_fp32": {"exact": 8, "prompts": 8, "audit_ok": True}}, []),
    ({"fidelity_fp32": {"exact": 7, "prompts": 8, "audit_ok": True}},
     ["fp32 greedy output equals transformers' on 7 of 8 prompts"]),
    ({"fidelity_fp32": {"error": "exit 1"}}, ["fp32 fidelity did not run: exit 1"]),
    ({"fidelity_fp32": {"exact": 8, "prompts": 8, "audit_ok": True}, "engine": {"audit_ok": False}},
     ["engine: the audit found a block still held or a broken invariant after the run"]),
])
def test_the_check_fails_on_inexact_fp32_or_a_leaked_block(stages: dict, expected: list[str]) -> None:
    assert failures(stages) == expected
