"""How the kernels are jitted, and the one mode they can run in.

Triton's interpreter mode is process-wide and fixed when triton is first imported: Triton
3.9 reads `TRITON_INTERPRET` inside `triton.jit`, and its own standard library (`tl.sum`,
`tl.max`, `tl.cdiv`, ...) is decorated at `import triton`. A kernel jitted in the other mode
cannot call those functions. So `jit` follows the standard library's mode, whatever the
environment says later, and `require_launchable` turns a CPU launch without the
interpreter (which Triton would report as "0 active drivers") into an explanation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.language.standard as _tl_standard
from triton.runtime import JITFunction
from triton.runtime.interpreter import InterpretedFunction


def interpreted() -> bool:
    """Whether this process imported triton in interpreter mode."""
    return isinstance(_tl_standard.cdiv, InterpretedFunction)


def jit(fn: Callable[..., None]) -> Any:
    """`triton.jit`, in the mode triton itself was imported in."""
    return InterpretedFunction(fn) if interpreted() else JITFunction(fn)


def require_launchable(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and not interpreted():
        raise RuntimeError(
            "the Triton kernels run on CPU tensors only under Triton's interpreter, and this "
            "process imported triton without it: set TRITON_INTERPRET=1 before triton is first imported"
        )

