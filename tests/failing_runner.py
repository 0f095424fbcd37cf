"""`python -m tests.failing_runner FLAG chatcore-args...`: the real `chatcore` command, with a fault to inject.

While the file FLAG exists, every model forward raises: a `RuntimeError` (a step that fails), or,
when FLAG holds the word `device`, the `torch.AcceleratorError` that CUDA raises for an illegal
memory access (the device is lost). Without FLAG the runner computes as usual. The tests create
and remove FLAG to break the engine at start (the warm-up) or later (a step), from outside.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from chatcore.engine.runner import ModelRunner
from chatcore.engine.scheduler import StepPlan

INJECTED = "CUDA error: an illegal memory access was encountered (injected)"


def main() -> int:
    flag = Path(sys.argv[1])
    execute = ModelRunner.execute

    def failing(self: ModelRunner, plan: StepPlan):  # type: ignore[no-untyped-def]
        if flag.exists():
            raise (torch.AcceleratorError if flag.read_text() == "device" else RuntimeError)(INJECTED)
        return execute(self, plan)

    ModelRunner.execute = failing  # type: ignore[method-assign]
    from chatcore.cli import main as chatcore

    return chatcore(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
