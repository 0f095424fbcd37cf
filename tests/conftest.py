"""Shared fixtures. The default model is converted once (idempotent) and loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before anything imports torch (libgomp reads it once): `make test` runs two workers on two
# cores, and OpenMP workers that spin-wait between parallel ops take the CPU the other worker's
# threads need (chatcore/openmp.py). Measured 2026-12-02: test files 2.9-3.9x slower spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest_plugins = ["tests.openai_fixtures", "tests.bench_fixtures", "tests.cpu_kind_report"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite compares against transformers on the CPU, also on a machine with a GPU (whose
# `device=auto` would pick it); `make gpu-check` runs the CUDA checks (bench/gpu_check.py).
os.environ.setdefault("CHATCORE_DEVICE", "cpu")
# ... and against transformers on the converted float32 weights: the default model's GGUF blocks
# (weights=auto, its default) are other weights. tests/test_gguf_weights.py asks for them by name.
os.environ.setdefault("CHATCORE_WEIGHTS", "full")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from chatcore.config import Settings
    from chatcore.models.fetch import fetch_default_model

    path, _ = fetch_default_model(Settings().cache_dir)
    return path


@pytest.fixture(scope="session")
def loaded_fp32(default_model_dir: Path):
    """The default model in float32 with the paged attention, loaded once."""
    import torch

    from chatcore.config import Settings
    from chatcore.models.loader import load_model

    torch.set_num_threads(2)
    return load_model(Settings(dtype="float32"))


@pytest.fixture(scope="session")
def hf_model(default_model_dir: Path):
    """The same weights through plain transformers (its own attention and cache): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_core(loaded_fp32):
    """Build engine cores over the shared fp32 model; at teardown each must audit clean and idle."""
    from chatcore.cache import audit
    from chatcore.config import Settings
    from chatcore.engine.core import EngineCore

    cores = []

    def factory(**overrides):
        settings = Settings(**{"dtype": "float32", "num_blocks": 512, "debug_audit": True, **overrides})
        core = EngineCore(loaded_fp32, settings)
        cores.append(core)
        return core

    yield factory
    for core in cores:
        report = audit(core.pool)
        assert report.ok, report.format()
        assert report.used == 0, f"blocks still in use after the test:\n{report.format()}"


@pytest.fixture(scope="session")
def live_server(tmp_path_factory, default_model_dir: Path):
    """A real server process in open mode (no keys) with the default model, shared by a test session."""
    from tests.server_helpers import start_server

    server = start_server(tmp_path_factory.mktemp("live-server"))
    yield server
    server.stop()
