"""Whether the Triton interpreter is requested, read without importing triton."""

from __future__ import annotations

import os

# Spellings that Triton's own `getenv_bool` treats as true (checked against Triton 3.9).
_TRUTHY = frozenset({"1", "true", "on", "yes", "y"})


def interpreting() -> bool:
    """Whether `TRITON_INTERPRET` is set to true right now."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY
