"""Float32 linear weights are re-stored column-major on the CPU; the model computes the same."""

from __future__ import annotations

from pathlib import Path

import torch

from chatcore.config import Settings
from chatcore.models.loader import load_model
from chatcore.models.weight_layout import store_linears_transposed
from tests.tiny_models import save_tiny_model


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_loaded_float32_model_has_column_major_linears_and_keeps_its_tie(loaded_fp32) -> None:
    model = loaded_fp32.model
    for linear in _linears(model):
        assert linear.weight.t().is_contiguous(), linear
        assert not linear.weight.is_contiguous()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embed.weight  # SmolLM2 ties them: one storage moved once


def test_moving_weights_changes_no_output(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "llama", "llama", tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    moved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    count = store_linears_transposed(moved)
    assert count == len(_linears(moved)) == 2 * 7 + 1
    ids = torch.randint(3, 250, (3, 40))
    with torch.inference_mode():
        expected, got = reference(ids).logits, moved(ids).logits
    # Bitwise equal on the machines measured; the GEMM may sum in another order elsewhere.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert store_linears_transposed(moved) == 0  # already moved: nothing to do


def test_half_precision_weights_stay_row_major(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "llama", "llama")
    for dtype in ("float16", "bfloat16"):
        loaded = load_model(Settings(model=str(folder), dtype=dtype, device="cpu"))
        assert all(linear.weight.is_contiguous() for linear in _linears(loaded.model))
