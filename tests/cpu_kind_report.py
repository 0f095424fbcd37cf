"""The one line `make test` prints about the CPU: its kind and the kinds whose paths the suite ran
(tests/test_cpu_kinds.py records each). Under pytest-xdist each worker sends its kinds to the
controller in `workeroutput`, and the controller prints the union."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from chatcore.kernels import cpu_kind

_KEY = "chatcore_cpu_kinds"


def _kinds(config: pytest.Config) -> set[str]:
    if not hasattr(config, "_chatcore_cpu_kinds"):
        config._chatcore_cpu_kinds = set()  # type: ignore[attr-defined]
    return config._chatcore_cpu_kinds  # type: ignore[attr-defined]


@pytest.fixture
def record_cpu_kind(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record that the test's paths ran as `kind`."""
    return _kinds(request.config).add


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[_KEY] = sorted(_kinds(session.config))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_testnodedown(node: Any, error: Any) -> None:
    _kinds(node.config).update(getattr(node, "workeroutput", {}).get(_KEY, ()))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if getattr(config, "workeroutput", None) is not None:
        return
    ran = [kind for kind in cpu_kind.KINDS if kind in _kinds(config)]
    flags = " ".join(sorted(cpu_kind.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}))
    terminalreporter.write_line(f"chatcore CPU kind: {cpu_kind.detected()} ({flags or 'none of avx2/avx512'}); "
                                f"ISA variants exercised: {', '.join(ran) or 'none (tests/test_cpu_kinds.py did not run)'}")
