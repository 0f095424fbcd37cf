"""`weights=int8`: the decoder's linears as int8 (torchao, AWQ scales), on the paged engine.

Fidelity (issue 36, target 4; issue 52), teacher forced (tests/engine_helpers.py): on the fidelity
prompts (tests/test_engine_fidelity.py's questions, alone and after its long system prompt), each fed
the float32 model's own 64-token continuation, int8's top-1 agreement with the float32 model is at
most `INT8_DEFICIT` below full weights' in the same dtype, and its largest logit error is within 16
int8 steps (2^-7 of a row's largest weight each) of the largest logit.
`INT8_DEFICIT` comes from a measured spread (2026-12-07, an AMD EPYC with AVX512-BF16, 16 prompts x
64 positions, every CPU kind it runs through CHATCORE_CPU_ISA): int8 fell 0.0156 below full weights
in bfloat16 (the avx512bf16 kind), 0.0215 in float32 on the avx512f kind and 0.0254 on the avx2 kind
(torch's AVX2 kernels); the per-prompt deficit's standard error was 0.0051-0.0059. The bound is the
largest deficit plus three standard errors. Its logit error measured 2.31-2.45 at a largest logit of
41.7 (7-7.5 steps). Composition: in float32 the engine's int8 output equals transformers' with the same int8
linears, token for token (the paged attention is exact there), and the weight layout passes leave
the int8 linears alone. Refusals: a device other than the CPU, torchao missing, a bad value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatcore.config import ConfigError, Settings, load_config
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams
from chatcore.models import int8_weights
from chatcore.models.int8_weights import Int8Linear, UnsupportedWeights, check_weights, quantize_int8
from chatcore.models.loader import load_model
from chatcore.models.weight_layout import PackedLinear
from tests.engine_helpers import (
    LONG_SYSTEM,
    QUESTIONS,
    Fidelity,
    chat_ids,
    fidelity,
    forced_logits,
    hf_greedy,
    reference_continuations,
    reference_logits,
    run_to_end,
)
from tests.tiny_models import save_tiny_model

INT8_DEFICIT = 0.0254 + 3 * 0.006
INT8_STEP = 2.0**-7
NEW_TOKENS = 64


def _decoder_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]


def _greedy(loaded, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    core = EngineCore(loaded, Settings(dtype=loaded.dtype_name, num_blocks=512, debug_audit=True))
    requests = [core.make_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    for req in requests:
        core.add(req)
    finals = run_to_end(core)
    return [finals[r.request_id].outputs[0].token_ids for r in requests]


# --- settings and refusals -------------------------------------------------------------------------


def test_the_setting_comes_from_env_flag_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATCORE_WEIGHTS", raising=False)  # tests/conftest.py pins full
    assert Settings().weights == "auto"
    monkeypatch.setenv("CHATCORE_WEIGHTS", "int8")
    assert load_config().settings.weights == "int8"
    assert load_config({"weights": "full"}).settings.weights == "full"  # a flag wins
    monkeypatch.delenv("CHATCORE_WEIGHTS")
    toml = tmp_path / "chatcore.toml"
    toml.write_text('weights = "int4"\n')
    with pytest.raises(ConfigError, match="weights"):
        load_config(config=toml)


def test_int8_is_refused_off_the_cpu_and_without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    check_weights("full", torch.device("cuda"))  # full weights run anywhere
    check_weights("int8", torch.device("cpu"))
    with pytest.raises(UnsupportedWeights, match=r"weights=int8 runs on the CPU only.*device cuda:0"):
        check_weights("int8", torch.device("cuda", 0))
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UnsupportedWeights, match="weights=int8 needs torchao"):
        check_weights("int8", torch.device("cpu"))


def test_the_command_line_refuses_int8_on_a_gpu_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from chatcore import cli

    monkeypatch.setattr("chatcore.models.device.resolve_device", lambda name: torch.device("cuda", 0))
    assert cli.main(["generate", "--weights", "int8", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("chatcore: weights=int8 runs on the CPU only"), err


# --- a tiny model: layout, cache, exactness against its transformers twin ------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("int8") / "llama", "llama", tie_word_embeddings=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_linears_skip_the_layout_passes_and_are_cached(tiny: Path, tmp_path: Path, dtype: str) -> None:
    settings = Settings(model=str(tiny), dtype=dtype, device="cpu", weights="int8", cache_dir=tmp_path)
    loaded = load_model(settings)
    linears = _decoder_linears(loaded.model)
    assert len(linears) == 2 * 7 and all(type(m) is Int8Linear for m in linears)
    assert all(m.weight.qdata.dtype == torch.int8 and m.weight.dtype == loaded.dtype for m in linears)
    head = loaded.model.get_output_embeddings()
    assert type(head) in (torch.nn.Linear, PackedLinear)  # the head keeps the model's dtype and layout
    if dtype == "float32":
        assert head.weight.t().is_contiguous()  # still re-stored column-major
    assert loaded.fingerprint != load_model(settings.model_copy(update={"weights": "full"})).fingerprint
    cached = list((tmp_path / "int8").glob("*.safetensors"))
    assert len(cached) == 1
    again = load_model(settings)  # from the cache: the same int8 values and scales
    for a, b in zip(linears, _decoder_linears(again.model), strict=True):
        assert torch.equal(a.weight.qdata, b.weight.qdata) and torch.equal(a.int8_scales, b.int8_scales)
        assert torch.equal(a.int8_pre_scale, b.int8_pre_scale)


def test_the_int8_engine_equals_transformers_with_the_same_int8_linears_in_float32(tiny: Path,
                                                                                    tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model(Settings(model=str(tiny), dtype="float32", device="cpu", weights="int8", cache_dir=tmp_path))
    twin = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    cache = next((tmp_path / "int8").glob("*.safetensors"))
    assert quantize_int8(twin, tiny, loaded.tokenizer, cache) == 2 * 7
    prompts = [chat_ids(loaded.tokenizer, q) for q in QUESTIONS[:4]]
    ours = _greedy(loaded, prompts, 16)
    with torch.inference_mode():
        assert ours == [hf_greedy(twin, p, 16) for p in prompts]


def test_a_bad_cache_file_is_found_again(tiny: Path, tmp_path: Path) -> None:
    settings = Settings(model=str(tiny), dtype="float32", device="cpu", weights="int8", cache_dir=tmp_path)
    first = load_model(settings)
    cache = next((tmp_path / "int8").glob("*.safetensors"))
    cache.write_bytes(b"not a safetensors file")
    again = load_model(settings)
    assert torch.equal(_decoder_linears(first.model)[0].weight.qdata, _decoder_linears(again.model)[0].weight.qdata)
    assert cache.stat().st_size > 1000  # rewritten


def test_the_forward_is_the_int8_product(tiny: Path, tmp_path: Path) -> None:
    """An `Int8Linear` computes (x * pre_scale) @ int8^T * row scales: up to `KERNEL_MAX_ROWS` rows in
    the kernel (its input rounded to bfloat16), more through a dequantized copy in the model's dtype."""
    loaded = load_model(Settings(model=str(tiny), dtype="float32", device="cpu", weights="int8", cache_dir=tmp_path))
    linear = _decoder_linears(loaded.model)[0]
    for rows in (3, int8_weights.KERNEL_MAX_ROWS, int8_weights.KERNEL_MAX_ROWS + 1, 100):
        x = torch.randn(rows, linear.in_features)
        scaled = x * linear.int8_pre_scale
        if rows <= int8_weights.KERNEL_MAX_ROWS:
            scaled = scaled.to(torch.bfloat16).float()
        expected = scaled @ linear.weight.qdata.float().t() * linear.int8_scales.float()
        torch.testing.assert_close(linear(x), expected, rtol=2e-2, atol=2e-2)
    assert int8_weights.is_plain(torch.nn.Parameter(torch.zeros(1))) and not int8_weights.is_plain(linear.weight)


# --- the real default model: fidelity ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fidelity_text(loaded_fp32, hf_model) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """The fidelity prompts, the float32 model's continuations of them, and its logits on them."""
    tok = loaded_fp32.tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS] + [chat_ids(tok, q, LONG_SYSTEM) for q in QUESTIONS]
    continuations = reference_continuations(hf_model, prompts, NEW_TOKENS)
    return prompts, continuations, reference_logits(hf_model, prompts, continuations)


def _forced(loaded, text: tuple[list[list[int]], list[list[int]], list[torch.Tensor]]) -> Fidelity:
    prompts, continuations, reference = text
    core = EngineCore(loaded, Settings(dtype=loaded.dtype_name, num_blocks=512, debug_audit=True))
    return fidelity(forced_logits(core, prompts, continuations), reference)


@pytest.mark.model
def test_int8_agrees_with_full_precision_on_the_fidelity_prompts(fidelity_text) -> None:
    """In float32, where full weights are the reference itself (agreement 1)."""
    loaded = load_model(Settings(dtype="float32", weights="int8"))
    assert all(type(m) is Int8Linear for m in _decoder_linears(loaded.model))
    found = _forced(loaded, fidelity_text)
    print(f"float32 int8 against the float32 model: {found}")
    assert found.top1 >= 1 - INT8_DEFICIT
    assert found.error <= 16 * INT8_STEP * found.scale


@pytest.mark.model
def test_int8_in_the_auto_dtype_loses_little_more_than_the_dtype(fidelity_text) -> None:
    """In the dtype `auto` picks: where that is bfloat16, full weights already rank near-ties
    differently from float32; int8's agreement stays within `INT8_DEFICIT` of full weights'."""
    from chatcore.models.device import resolve_dtype

    if resolve_dtype("auto", "cpu") == torch.float32:
        pytest.skip("auto is float32 on this CPU: the test above is the auto dtype's")
    ours = _forced(load_model(Settings(dtype="auto", weights="int8")), fidelity_text)
    base = _forced(load_model(Settings(dtype="auto")), fidelity_text)
    print(f"auto dtype against the float32 model: int8 {ours}; full weights {base}")
    assert ours.top1 >= base.top1 - INT8_DEFICIT
    assert ours.error <= 16 * INT8_STEP * ours.scale


def test_int8_values_off_the_kernels_alignment_are_copied() -> None:
    """aten._weight_int8pack_mm faulted on int8 values at a safetensors file's 8-byte-aligned offsets."""
    linear = torch.nn.Linear(64, 32, bias=False)
    buffer = torch.zeros(32 * 64 + 8, dtype=torch.int8)
    qdata = buffer[8:].view(32, 64)
    qdata.copy_(torch.randint(-127, 128, (32, 64), dtype=torch.int8))
    assert qdata.data_ptr() % int8_weights.KERNEL_ALIGNMENT
    int8_weights._install(linear, qdata, torch.rand(32, 1), torch.ones(64))
    assert linear.weight.qdata.data_ptr() % int8_weights.KERNEL_ALIGNMENT == 0
    assert torch.equal(linear.weight.qdata, qdata)
    assert linear(torch.randn(5, 64)).shape == (5, 32)
