"""The default model is provisioned once, and the converted folder generates coherent text; a hub
id resolves through the local Hugging Face cache, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatcore.models.fetch import COMPLETE_MARKER
from tests.tiny_models import save_tiny_model

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.model
def test_converted_folder_is_a_safetensors_model(default_model_dir: Path) -> None:
    assert (default_model_dir / COMPLETE_MARKER).is_file()
    assert (default_model_dir / "model.safetensors").is_file()
    assert (default_model_dir / "config.json").is_file()
    assert (default_model_dir / "tokenizer.json").is_file()


@pytest.mark.model
def test_second_fetch_is_a_no_op(default_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chatcore.cli", "--cache-dir", str(default_model_dir.parents[1]), "model", "fetch"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert "already at" in out.stdout
    assert str(default_model_dir) in out.stdout


@pytest.mark.model
def test_greedy_answer_is_coherent(default_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def _generate(model: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    return subprocess.run([sys.executable, "-m", "chatcore.cli", "generate", "--model", model, "--device", "cpu",
                           "--dtype", "float32", "--prompt", "hello", "--max-tokens", "3", "--json"],
                          check=False, capture_output=True, text=True, timeout=120, env={**clean, "HF_HUB_OFFLINE": "1", **env})


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache_offline(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--tinyorg--tiny-llama"
    save_tiny_model(repo / "snapshots" / SNAPSHOT, "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    done = _generate("tinyorg/tiny-llama", HF_HOME=str(tmp_path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["usage"]["prompt_tokens"] > 0
    assert 1 <= result["usage"]["completion_tokens"] <= 3


def test_an_absent_hub_id_is_one_line_naming_it_and_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    done = _generate("tinyorg/absent", HF_HUB_CACHE=str(cache))
    assert done.returncode == 2
    expected = f"chatcore: model tinyorg/absent: not in the local Hugging Face cache ({cache}), and HF_HUB_OFFLINE is set"
    assert done.stderr.splitlines() == [expected]
