"""The model the GPU check runs: the default model's real weights where they are, else random weights
(seed 0) of its shape, built from its config and tokenizer files (`make gpu-prepare` stages those, a few
MiB, since the weights exceed what travels to a lent machine). Same shapes, so the same work per token;
fidelity compares the engine with transformers on the same weights either way.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

# Everything of the converted default model but its weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
WEIGHTS = "model.safetensors"
SEED = 0


def copy_model_files(source: Path, target: Path) -> list[str]:
    """Copy the config and tokenizer files of `source` that exist into `target`; returns their names."""
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json")
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def has_weights(folder: Path) -> bool:
    return (folder / WEIGHTS).is_file()


def build_random_model(source: Path, target: Path, shape: dict[str, int]) -> dict[str, Any]:
    """Save a model of `source`'s config (with `shape` overriding sizes) and random weights into `target`,
    with `source`'s tokenizer files. Written to a sibling folder first and renamed, so a killed stage never
    leaves a half-written model that a later run would take as complete."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if has_weights(target):
        return {"path": str(target), "reused": True}
    started = time.perf_counter()
    config = AutoConfig.from_pretrained(source)
    for key, value in shape.items():
        setattr(config, key, value)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in TOKENIZER_FILES:  # save_pretrained wrote the config, with the overrides, as the weights have it
        if (source / name).is_file():
            shutil.copy2(source / name, staging / name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return {"path": str(target), "params": sum(p.numel() for p in model.parameters()), "seed": SEED,
            "build_s": time.perf_counter() - started}
