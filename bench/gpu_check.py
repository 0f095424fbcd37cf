"""`make gpu-check`: every check that needs a CUDA GPU, in one run, into one JSON report.

1. the CUDA-only kernel tests (tests/test_kernels_triton.py, its `cuda` cases);
2. the engine's greedy output against transformers on CUDA: exact (token for token) in fp32,
   and in bf16, where rounding makes exactness a matter of luck, the top-1 agreement: the share
   of the engine's tokens that transformers also ranks first, given the same text before them;
3. bench/kernels.py (quick): the decode kernel's time as a fraction of a device-to-device copy
   of the bytes it reads, measured in the same run;
4. `chatcore bench --suite throughput --quick --device cuda`.

Where torch sees no CUDA device it prints one line and exits 0. Otherwise it exits 1 when a
kernel test fails, fp32 output is not exact, or a step leaves a block unaccounted for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 2+2?", "Name three colors.",
             "Why is the sky blue?", "Give me a tip for learning Python.", "What do cats eat?",
             "Translate 'good morning' into Spanish."]
SYSTEM = ("You are Atlas, the support assistant of the Northwind travel agency. Answer politely and briefly. "
          "Refunds are possible up to fourteen days before departure, minus a handling fee of twenty euros.")
MAX_TOKENS = 48


def _log(message: str) -> None:
    print(f"gpu-check: {message}", flush=True)


def _run(argv: list[str], timeout_s: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A step in a child process; one that overruns its share of the 8 minutes is reported, not waited for."""
    try:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace")  # bytes, whatever `text` says
        return subprocess.CompletedProcess(argv, 124, output + f"\ntimed out after {timeout_s} s", "")


def kernel_tests(timeout_s: int) -> dict[str, Any]:
    env = {**os.environ, "CHATCORE_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
                 "tests/test_kernels_triton.py"], timeout_s, env)
    lines = done.stdout.strip().splitlines()
    return {"passed": done.returncode == 0, "summary": lines[-1] if lines else done.stderr[-2000:],
            "failures": [line for line in lines if line.startswith("FAILED")]}


def fidelity(dtype: str) -> dict[str, Any]:
    """The engine on CUDA against transformers on CUDA, same weights and dtype."""
    from transformers import AutoModelForCausalLM

    from chatcore.cache import audit
    from chatcore.config import Settings
    from chatcore.engine.core import EngineCore
    from chatcore.engine.request import SamplingParams
    from chatcore.models.loader import load_model

    settings = Settings(device="cuda", dtype=dtype, num_blocks=4096)
    loaded = load_model(settings)
    core = EngineCore(loaded, settings)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.dtype).to(loaded.device).eval()
    tok = loaded.tokenizer
    prompts = []
    for i, question in enumerate(QUESTIONS):
        messages = ([{"role": "system", "content": SYSTEM}] if i % 2 else []) + [{"role": "user", "content": question}]
        prompts.append(list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)))
    requests = [core.make_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    for req in requests:
        core.add(req)
    finals: dict[str, Any] = {}
    started = time.perf_counter()
    while core.has_work:
        finals.update({o.request_id: o for o in core.step() if o.finished})
    engine_s = time.perf_counter() - started
    report = audit(core.pool)
    exact, agree, total = 0, 0, 0
    with torch.inference_mode():
        for req, prompt in zip(requests, prompts, strict=True):
            ours = finals[req.request_id].outputs[0].token_ids
            ids = torch.tensor([prompt], device=loaded.device)
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)[0, len(prompt):].tolist()
            exact += ours == theirs
            forced = torch.tensor([prompt + ours[:-1]], device=loaded.device)
            ranked = hf(forced).logits[0, len(prompt) - 1:].argmax(dim=-1).tolist()
            agree += sum(a == b for a, b in zip(ranked, ours, strict=True))
            total += len(ours)
    return {"dtype": dtype, "prompts": len(prompts), "max_tokens": MAX_TOKENS, "exact": exact,
            "top1_agreement": agree / total, "engine_s": engine_s, "audit_ok": report.ok and report.used == 0}


def throughput(timeout_s: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        done = _run([sys.executable, "-m", "chatcore.cli", "bench", "--suite", "throughput", "--quick",
                     "--device", "cuda", "--no-fail", "--out", out], timeout_s)
        path = Path(out) / "results.json"
        if done.returncode != 0 or not path.exists():
            return {"error": f"exit {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"}
        suite = json.loads(path.read_text())["suites"]["throughput"]
    return {key: suite.get(key) for key in ("ratios", "targets", "limit")} | {
        "tok_s": {name: system.get("tok_s") for name, system in suite.get("systems", {}).items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/gpu-check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: skipped, no CUDA device (torch {torch.__version__} sees none)")
        return 0
    import triton

    from chatcore.bench import kernels as kernel_bench

    started = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "cuda": torch.version.cuda}
    _log(f"{result['device']}: kernel tests")
    result["kernel_tests"] = kernel_tests(150)
    _log(f"  {result['kernel_tests']['summary']}")
    result["fidelity"] = []
    for dtype in ("float32", "bfloat16"):
        _log(f"engine fidelity against transformers, {dtype}")
        row = fidelity(dtype)
        result["fidelity"].append(row)
        _log(f"  {row['exact']}/{row['prompts']} exact, top-1 agreement {row['top1_agreement']:.4f}, "
             f"audit {'ok' if row['audit_ok'] else 'FAILED'}")
    _log("bench/kernels.py --quick")
    result["kernel_bench"] = kernel_bench.run(quick=True)
    for row in result["kernel_bench"]["decode"]:
        _log(f"  decode kernel {row.get('kernel_ms', float('nan')):.3f} ms = "
             f"{row.get('kernel_bw_fraction', float('nan')):.1%} of copy bandwidth")
    _log("chatcore bench --suite throughput --quick --device cuda")
    result["throughput"] = throughput(210)
    _log(f"  {result['throughput'].get('tok_s') or result['throughput'].get('error')}")
    result["seconds"] = time.perf_counter() - started
    fp32 = result["fidelity"][0]
    ok = (result["kernel_tests"]["passed"] and fp32["exact"] == fp32["prompts"]
          and all(row["audit_ok"] for row in result["fidelity"]) and "error" not in result["throughput"])
    result["ok"] = ok
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    _log(f"{'ok' if ok else 'FAILED'} in {result['seconds']:.0f} s; report: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
