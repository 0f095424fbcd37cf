"""Interpreter detection and launch-time JIT for the Triton kernels.

`triton.jit` decides whether a function is compiled or interpreted when it *decorates* it:
in Triton 3.9 it reads `TRITON_INTERPRET` (through `triton.knobs.runtime.interpret`, which
consults `os.environ` on every access) inside the decorator, and an `InterpretedFunction`
or a `JITFunction` is then fixed for the life of the object. Decorating at import time
would therefore freeze the mode of whoever imported the kernel module first. `LazyKernel`
keeps the plain Python function and decorates it on first launch, once per mode, so the mode
is a property of the launch and import order does not matter.

This module must not import triton at import time: `import kernels` has to stay cheap and
must work on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# Spellings that Triton's own `getenv_bool` treats as true (checked against Triton 3.9).
_TRUTHY = frozenset({"1", "true", "on", "yes", "y"})


def interpreting() -> bool:
    """Whether Triton kernels run in interpreter mode (`TRITON_INTERPRET` is set to true)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


class LazyKernel:
    """A Triton kernel, jitted at its first launch in each mode (compiled or interpreted).

    Launch it like a jitted kernel: `kernel[grid](*args, **meta)`.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        import triton

        mode = bool(triton.knobs.runtime.interpret)
        kernel = self._jitted.get(mode)
        if kernel is None:
            kernel = self._jitted[mode] = triton.jit(self._fn)
        return kernel[grid]
