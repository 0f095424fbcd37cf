"""llama.cpp as a peer, in process, through its Python binding (`llama-cpp-python`, which
`make bench-peers` builds for this CPU, `GGML_NATIVE=ON`).

One chat on the model's own GGUF at the run's thread count (`n_threads` and `n_threads_batch`):
the prompt's token ids are evaluated as one batch, then `new_tokens` greedy tokens follow, each the
argmax of the last position's logits, so EOS is never special (it is ignored, as chatcore's
`ignore_eos` does). The prompt cache is off: the context is reset before each turn, and
`Llama.eval` then drops every KV cell from position 0 on, so nothing of an earlier turn is reused.

Each token is stamped when its logits have been read: decode tok/s is measured as chatcore's is,
(tokens - 1) / (last - first token time), Python's share of each step included as it is in
chatcore's figure. llama.cpp's own counter of its single-token evaluations
(`llama_perf_context`: `n_eval` over `t_eval_ms`) is reported beside it as `own_decode_tok_s`.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = "llama-cpp-python"
BUILD_HINT = "run make bench-peers"
# What importing or loading a binding that is present but broken raises (a library built for another
# CPU, a missing symbol, a file it cannot read).
LOAD_ERRORS = (ImportError, OSError, RuntimeError, ValueError, AttributeError)


def missing() -> str | None:
    """Why the binding cannot be imported here (the reason a report gives), or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"{PACKAGE} is not installed: {BUILD_HINT}"
    return None


@contextmanager
def _no_extra_buffers() -> Iterator[None]:
    """`Llama` built inside this block loads its weights without ggml's extra CPU buffer types
    (`use_extra_bufts` off: the AMX and repacked layouts), which `Llama`'s arguments cannot ask for.

    A `GGML_NATIVE=ON` build on an AMX CPU puts Q4_1 and Q8_0 weights in AMX buffers, and on an
    AMX Xeon their first product died with SIGILL at `tilezero` (docs/measurements.md, "llama.cpp on
    AMX"), taking the bench with it. Without them ggml multiplies the GGUF's blocks with its
    AVX-512 / AVX2 dot products, as on the CPUs without AMX where the anchors were measured."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params() -> Any:
        chosen = default()
        chosen.use_extra_bufts = False
        return chosen

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


@dataclass
class Generated:
    """One turn: its start and each token's time (perf_counter), its tokens, llama.cpp's own decode rate,
    and how many prompt tokens llama.cpp evaluated as a batch (all of them: nothing came from a cache)."""

    start: float
    times: list[float]
    token_ids: list[int]
    own_decode_tok_s: float
    prompt_evaluated: int


@dataclass
class LlamaCpp:
    """The model's GGUF loaded by the binding; else `skipped` says why."""

    skipped: str | None = None
    llm: Any = None
    gguf: Path | None = None
    weights: str | None = None  # the GGUF's quantization, from its file name (`...Q4_1.gguf`: Q4_1)
    version: str | None = None

    @classmethod
    def load(cls, gguf: Path, threads: int, n_ctx: int) -> LlamaCpp:
        reason = missing()
        if reason is not None:
            return cls(skipped=reason)
        try:
            import llama_cpp

            with _no_extra_buffers():
                llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                      verbose=False)
        except LOAD_ERRORS as exc:
            return cls(skipped=f"{PACKAGE} did not load {gguf.name}: {type(exc).__name__}: {exc} ({BUILD_HINT})")
        return cls(llm=llm, gguf=gguf, weights=gguf.stem.rsplit(".", 1)[-1], version=llama_cpp.__version__)

    def generate(self, prompt: list[int], new_tokens: int) -> Generated:
        """`new_tokens` greedy tokens after `prompt`, from an empty context."""
        import llama_cpp
        import numpy as np

        llm = self.llm
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        vocab = llm.n_vocab()
        start = time.perf_counter()
        times: list[float] = []
        tokens: list[int] = []
        batch = list(prompt)
        for _ in range(new_tokens):
            llm.eval(batch)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            tokens.append(int(logits.argmax()))
            times.append(time.perf_counter())
            batch = tokens[-1:]
        perf = llama_cpp.llama_perf_context(llm.ctx)
        own = perf.n_eval / perf.t_eval_ms * 1e3 if perf.t_eval_ms > 0 else float("nan")
        return Generated(start, times, tokens, own, int(perf.n_p_eval))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
