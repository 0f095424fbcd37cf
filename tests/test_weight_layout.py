"""Linear weights are re-stored for the CPU's GEMM (float32 column-major, bfloat16 packed for
oneDNN); the model computes the same bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatcore.config import Settings
from chatcore.kernels import cpu_linear
from chatcore.models.loader import load_model
from chatcore.models.weight_layout import (
    PackedLinear,
    _packed_gemm_matches,
    pack_bfloat16_linears,
    store_linears_transposed,
)
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


def test_float16_weights_stay_row_major(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "llama", "llama")
    loaded = load_model(Settings(model=str(folder), dtype="float16", device="cpu"))
    assert all(type(linear) is torch.nn.Linear and linear.weight.is_contiguous() for linear in _linears(loaded.model))


def _bfloat16_packing_here() -> bool:
    return _packed_gemm_matches(torch.randn(64, 32).to(torch.bfloat16))


@pytest.mark.parametrize("tied", [False, True])
def test_packed_bfloat16_linears_compute_the_same_bits(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "llama", "llama", tie_word_embeddings=tied)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    packed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    count = pack_bfloat16_linears(packed)
    if not _bfloat16_packing_here():
        assert count == 0 and not any(isinstance(m, PackedLinear) for m in packed.modules())
        pytest.skip("oneDNN has no bfloat16 GEMM matching F.linear on this CPU: nothing is packed")
    assert count == len(_linears(packed)) == 2 * 7 + 1
    ids = torch.randint(3, 250, (3, 40))
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, reference(ids).logits)
        one_row, expected = packed(ids[:1, :1]).logits, reference(ids[:1, :1]).logits
    few_rows = [linear.few_rows is not None for linear in _linears(packed)]
    assert all(few_rows) if cpu_linear.available() else not any(few_rows)
    if cpu_linear.available():  # one row takes the few-row kernel: the same sums, in another order
        torch.testing.assert_close(one_row, expected, rtol=0.05, atol=0.05)
    else:
        assert torch.equal(one_row, expected)
    head, embed = packed.get_output_embeddings(), packed.get_input_embeddings()
    assert (head.weight is embed.weight) == tied
    for linear in _linears(packed):
        assert isinstance(linear, PackedLinear) and linear.weight.shape == (linear.out_features, linear.in_features)
        # Only the packed copy holds values, except the head's weight, which the embedding still reads.
        assert (linear.weight.stride() == (0, 0)) == (linear is not head or not tied)
    assert torch.equal(embed.weight, reference.get_input_embeddings().weight)
    assert pack_bfloat16_linears(packed) == 0  # already packed: nothing to do


def test_loader_packs_bfloat16_linears_where_the_cpu_matches(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "llama", "llama")
    loaded = load_model(Settings(model=str(folder), dtype="bfloat16", device="cpu"))
    packed = [isinstance(linear, PackedLinear) for linear in _linears(loaded.model)]
    assert all(packed) if _bfloat16_packing_here() else not any(packed)


def test_packed_linears_take_the_few_row_kernel_up_to_its_rows_only(tmp_path: Path) -> None:
    if not (_bfloat16_packing_here() and cpu_linear.available()):
        pytest.skip("no oneDNN bfloat16 GEMM or no AVX512-BF16 here: nothing is packed or laid out")
    linear = torch.nn.Linear(64, 40, bias=True).bfloat16()
    reference = torch.nn.Linear(64, 40, bias=True).bfloat16()
    reference.load_state_dict(linear.state_dict())
    model = torch.nn.Sequential(linear)
    assert pack_bfloat16_linears(model) == 1 and isinstance(linear, PackedLinear) and linear.few_rows is not None
    with torch.inference_mode():
        for rows in range(1, 9):
            x = torch.randn(rows, 64).bfloat16()
            expected = (cpu_linear.linear(x, linear.few_rows, 40, linear.bias) if rows <= cpu_linear.MAX_ROWS
                        else reference(x))
            assert torch.equal(linear(x), expected), rows


def test_no_few_row_copy_where_it_would_take_too_much_memory(tmp_path: Path, monkeypatch) -> None:
    if not _bfloat16_packing_here():
        pytest.skip("oneDNN has no bfloat16 GEMM matching F.linear on this CPU: nothing is packed")
    monkeypatch.setattr("chatcore.models.weight_layout.FEW_ROWS_MEMORY_SHARE", 1e-12)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40).bfloat16())
    assert pack_bfloat16_linears(model) == 1 and model[0].few_rows is None
