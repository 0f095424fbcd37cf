"""Shared fixtures. The default model is converted once (idempotent) and loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from chatcore.config import Settings
    from chatcore.models.fetch import fetch_default_model

    path, _ = fetch_default_model(Settings().cache_dir)
    return path
