"""The GPU check's stages. Each runs in a child process of its own (bench/gpu_runner.py), so a stage that
hangs or crashes costs only its own result:

    python -m chatcore.bench.gpu_stages STAGE PLAN.json RESULT.json

Each reads the plan (bench/gpu_plan.py) and writes a JSON object. The engine is driven through its modules
(`EngineCore`, `load_model`), never `chatcore.cli`: the CLI checks the installed packages against the lock,
and a lent machine's torch and transformers are its image's own.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chatcore.bench.gpu_plan import Plan

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 2+2?", "Name three colors.",
             "Why is the sky blue?", "Give me a tip for learning Python.", "What do cats eat?",
             "Translate 'good morning' into Spanish."]
SYSTEM = ("You are Atlas, the support assistant of the Northwind travel agency. Answer politely and briefly. "
          "Refunds are possible up to fourteen days before departure, minus a handling fee of twenty euros.")
WORKLOAD_SEED = 0


def _settings(plan: Plan, **overrides: Any) -> Any:
    from chatcore.config import Settings

    return Settings(**{"model": plan.model, "device": plan.device, "dtype": plan.dtype, "num_blocks": plan.num_blocks,
                       **overrides})


def _tokenizer(plan: Plan) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(plan.model)


def workload(tokenizer: Any, plan: Plan, chats: int) -> list[list[int]]:
    """The first `chats` prompts of the check's workload: one shared system prompt, a distinct message each."""
    from chatcore.bench.engine_runs import chat_prompts
    from chatcore.bench.workload import chat_workload

    system, users = chat_workload(tokenizer, max(plan.chats), plan.system_tokens, plan.user_tokens,
                                  seed=WORKLOAD_SEED)
    return chat_prompts(tokenizer, system, users[:chats])


def _hf_model(plan: Plan, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(plan.model, dtype=getattr(torch, dtype))
    return model.to(plan.device).eval()


def _audit_ok(core: Any) -> bool:
    """The pool's invariants hold and no block is still held: a finished run leaks nothing."""
    from chatcore.cache import audit

    report = audit(core.pool)
    return report.ok and report.used == 0


def stage_model(plan: Plan) -> dict[str, Any]:
    from chatcore.bench.gpu_model import build_random_model

    if not plan.random_weights:
        return {"path": plan.model, "weights": "real"}
    return {"weights": f"random of {plan.model_source}'s config"} | build_random_model(
        Path(plan.model_source), Path(plan.model), plan.shape)


def stage_fidelity(plan: Plan) -> dict[str, Any]:
    """Greedy fp32 output of the engine against transformers' `generate`, token for token, same weights."""
    from chatcore.engine.core import EngineCore
    from chatcore.engine.request import SamplingParams
    from chatcore.models.loader import load_model

    settings = _settings(plan, dtype="float32", num_blocks=plan.fidelity_blocks)
    loaded = load_model(settings)
    core = EngineCore(loaded, settings)
    tok = loaded.tokenizer
    prompts = []
    for i, question in enumerate(QUESTIONS[:plan.fidelity_prompts]):
        messages = ([{"role": "system", "content": SYSTEM}] if i % 2 else []) + [{"role": "user", "content": question}]
        prompts.append(list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)))
    requests = [core.make_request(p, SamplingParams(max_tokens=plan.fidelity_tokens)) for p in prompts]
    for req in requests:
        core.add(req)
    finals: dict[str, Any] = {}
    while core.has_work:
        finals.update({o.request_id: o for o in core.step() if o.finished})
    audit_ok = _audit_ok(core)
    hf = _hf_model(plan, "float32")
    exact = 0
    with torch.inference_mode():
        for req, prompt in zip(requests, prompts, strict=True):
            ids = torch.tensor([prompt], device=loaded.device)
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=plan.fidelity_tokens,
                                 do_sample=False)[0, len(prompt):].tolist()
            exact += finals[req.request_id].outputs[0].token_ids == theirs
    return {"dtype": "float32", "prompts": len(prompts), "max_tokens": plan.fidelity_tokens, "exact": exact,
            "audit_ok": audit_ok}


def prefill_tok_s(steps: list[tuple[int, int, float]]) -> float | None:
    """Prompt tokens computed a second: the scheduled chunks' tokens (cached ones are not scheduled) over the
    time of the steps that computed them, decode rows beside them included."""
    tokens = sum(prefill for _, prefill, _ in steps if prefill)
    seconds = sum(dt for _, prefill, dt in steps if prefill)
    return tokens / seconds if seconds else None


def stage_engine(plan: Plan) -> dict[str, Any]:
    """The engine at default settings on the workload, for each chat count (one model load for both)."""
    from chatcore.bench.engine_runs import run_batch
    from chatcore.engine.core import EngineCore
    from chatcore.engine.request import SamplingParams
    from chatcore.models.loader import load_model

    settings = _settings(plan)
    loaded = load_model(settings)
    runs = []
    for chats in plan.chats:
        prompts = workload(loaded.tokenizer, plan, chats)
        core = EngineCore(loaded, settings)
        run_batch(core, prompts[:4], SamplingParams(max_tokens=plan.warmup_tokens, ignore_eos=True), share=False)
        run = run_batch(core, prompts, SamplingParams(max_tokens=plan.new_tokens, ignore_eos=True))
        runs.append({"chats": chats, "prompt_tokens_mean": sum(map(len, prompts)) / chats,
                     "wall_s": run.wall_s, "tokens": run.output_tokens, "tok_s": run.tok_s,
                     "decode_tok_s": run.decode_tok_s, "cached_tokens": run.cached_tokens,
                     "ttft_p50_s": statistics.median(run.ttft_s), "prefill_tok_s": prefill_tok_s(run.steps),
                     "settings": {"max_num_seqs": settings.max_num_seqs, "max_batch_tokens": settings.max_batch_tokens,
                                  "num_blocks": core.pool.num_blocks},
                     "audit_ok": _audit_ok(core)})
        del core  # its pool, before the next one sizes itself from the free memory
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"dtype": loaded.dtype_name, "runs": runs, "audit_ok": all(r["audit_ok"] for r in runs)}


def _hf_static_run(plan: Plan, configure: Callable[[Any], None] | None) -> dict[str, Any]:
    """transformers' static batched `generate` (left-padded) on the first chat count's workload: one untimed
    call of the same shapes first (for the compiled run it is the compile), then the timed one."""
    from chatcore.bench import baselines

    hf = _hf_model(plan, plan.dtype)
    tok = _tokenizer(plan)
    chats = plan.chats[0]
    prompts = workload(tok, plan, chats)
    pad = tok.pad_token_id or 0
    config = baselines.greedy_config(hf, plan.new_tokens, pad)
    if configure is not None:
        configure(config)
    started = time.perf_counter()
    baselines.hf_static(hf, prompts, plan.new_tokens, pad, config=config)
    first_s = time.perf_counter() - started
    run = baselines.hf_static(hf, prompts, plan.new_tokens, pad, config=config)
    return {"chats": chats, "tokens": run.output_tokens, "wall_s": run.wall_s, "tok_s": run.tok_s,
            "decode_tok_s": run.decode_tok_s, "first_call_s": first_s}


def stage_hf_eager(plan: Plan) -> dict[str, Any]:
    return _hf_static_run(plan, None)


def stage_hf_compiled(plan: Plan) -> dict[str, Any]:
    """The static cache, whose decode step `generate` compiles itself on a GPU (torch.compile, CUDA graphs
    through reduce-overhead). On the CPU transformers compiles only when asked (`_compile_all_devices`), and
    the rehearsal asks for dynamo's eager backend: the decode step is traced and run as a graph, without
    inductor's C++ build (a minute on two cores)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    def static(config: Any) -> None:
        config.cache_implementation = "static"
        if plan.device == "cpu":
            config.compile_config = CompileConfig(backend="eager", mode=None)
            config.compile_config._compile_all_devices = True

    result = _hf_static_run(plan, static)
    graphs = counters["stats"]["unique_graphs"]
    if not graphs:
        raise RuntimeError("transformers did not compile its decode step: the run would be eager")
    return result | {"compiled_graphs": graphs}


def stage_profile(plan: Plan) -> dict[str, Any]:
    from chatcore.bench.gpu_profile import decode_profile
    from chatcore.engine.core import EngineCore
    from chatcore.engine.request import SamplingParams
    from chatcore.models.loader import load_model

    settings = _settings(plan)
    loaded = load_model(settings)
    core = EngineCore(loaded, settings)
    for prompt in workload(loaded.tokenizer, plan, plan.chats[0]):
        core.add(core.make_request(prompt, SamplingParams(max_tokens=plan.new_tokens, ignore_eos=True)))
    result = decode_profile(core, loaded.device, plan.profile_warm_steps, plan.profile_steps)
    while core.has_work:
        core.step()
    return result | {"audit_ok": _audit_ok(core)}


def stage_kernel(plan: Plan) -> dict[str, Any]:
    """The Triton decode kernel's time against a device-to-device copy of the bytes it reads (bench/kernels.py's
    measure). On the CPU the kernel runs in Triton's interpreter: the code runs, the figure means nothing."""
    from chatcore.bench import kernels as kernel_bench
    from chatcore.kernels import dispatch

    if plan.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels pick their mode at each launch
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    device = torch.device(plan.device)
    config = kernel_bench.Config(**plan.kernel_case)
    case = kernel_bench.make_case(config, device, ragged=False)
    copy_bw = kernel_bench.copy_bandwidth(device, plan.copy_bytes, plan.timing_reps)
    out = torch.empty_like(case.query)
    seconds = kernel_bench.timed(lambda: dispatch.paged_decode_attention(*case.args(), out=out), device,
                                 plan.timing_reps)
    return {"case": plan.kernel_case, "kv_bytes": case.kv_bytes(), "kernel_ms": seconds * 1e3,
            "copy_bandwidth_gbs": copy_bw / 1e9, "kernel_bw_fraction": case.kv_bytes() / seconds / copy_bw,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"}


STAGES: dict[str, Callable[[Plan], dict[str, Any]]] = {
    "model": stage_model, "fidelity_fp32": stage_fidelity, "engine": stage_engine, "hf_eager": stage_hf_eager,
    "profile": stage_profile, "kernel": stage_kernel, "hf_compiled": stage_hf_compiled,
}


def main(argv: list[str]) -> int:
    name, plan_path, result_path = argv
    plan = Plan.from_file(Path(plan_path))
    if plan.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    result = STAGES[name](plan)
    Path(result_path).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
