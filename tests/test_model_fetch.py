"""The default model is provisioned once, and the converted folder generates coherent text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chatcore.models.fetch import COMPLETE_MARKER

pytestmark = pytest.mark.model


def test_converted_folder_is_a_safetensors_model(default_model_dir: Path) -> None:
    assert (default_model_dir / COMPLETE_MARKER).is_file()
    assert (default_model_dir / "model.safetensors").is_file()
    assert (default_model_dir / "config.json").is_file()
    assert (default_model_dir / "tokenizer.json").is_file()


def test_second_fetch_is_a_no_op(default_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chatcore.cli", "--cache-dir", str(default_model_dir.parents[1]), "model", "fetch"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert "already at" in out.stdout
    assert str(default_model_dir) in out.stdout


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
