"""Jitting the kernels so that the Triton interpreter is chosen per launch.

Triton 3.9 decides between compiled and interpreted inside `triton.jit`, reading
`TRITON_INTERPRET` at that moment, and it jits its own standard library (`tl.sum`, `tl.max`,
`tl.cdiv`, `tl.zeros`, ...) during `import triton`. Whoever imports triton first therefore
fixes the mode of those functions for the whole process; in a test session that is often
`torch._dynamo`, which imports triton while probing for it. An interpreted kernel cannot call
a library function that was jitted compiled ("Cannot call @triton.jit'd outside of the scope
of a kernel"). So our kernels:

- are jitted at their first launch in each mode, following `TRITON_INTERPRET` at launch time
  (`LazyKernel`), not at import;
- call only Triton builtins, which the interpreter patches in at every launch, plus
  `tl.reduce` with the combine functions below. Those are compiled-mode `JITFunction`s, which
  the compiler needs, and the interpreter calls them as plain Python (`.fn`), whatever mode
  triton was imported in. Where triton's own `_elementwise_max` and `_sum_combine` are
  compiled-mode (triton imported without the interpreter, the usual case), they are the ones:
  the interpreter recognises them and reduces with numpy, where any other combine function is
  applied element by element in Python, ~100x slower (what lets the engine run its decode
  steps through the interpreter in a test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction
from triton.runtime.interpreter import InterpretedFunction


def interpreted() -> bool:
    """Whether a launch now would run in Triton's interpreter (`TRITON_INTERPRET`, as Triton reads it)."""
    return bool(triton.knobs.runtime.interpret)


class LazyKernel:
    """A Triton kernel jitted at its first launch in each mode; launch as `kernel[grid](...)`."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        mode = interpreted()
        kernel = self._jitted.get(mode)
        if kernel is None:
            kernel = self._jitted[mode] = InterpretedFunction(self.fn) if mode else JITFunction(self.fn)
        return kernel[grid]


def require_launchable(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and not interpreted():
        raise RuntimeError("the Triton kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1)")


def _max(a, b):
    return tl.maximum(a, b)


def _add(a, b):
    return a + b


def _compiled(library: object, fallback: Callable[..., Any]) -> JITFunction:
    return library if isinstance(library, JITFunction) else JITFunction(fallback)


max_combine = _compiled(tl.standard._elementwise_max, _max)
sum_combine = _compiled(tl.standard._sum_combine, _add)
