"""The fused decoder layer (chatcore/models/fused_layer.py) and its pointwise kernels
(kernels/cpu_pointwise.py): each step computes what transformers' modules compute in bfloat16;
the engine decodes the same tokens through it as through the modules, at few rows and at many;
the original projections still compute what they did; a model whose modules it does not match,
float32 and int8 keep their modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

from chatcore.cache import audit
from chatcore.config import Settings
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams
from chatcore.kernels import cpu_linear, cpu_pointwise
from chatcore.kv.tensors import KVTensors
from chatcore.models import fused_layer, loader
from chatcore.models.fused_layer import FusedLayer, Projection
from chatcore.models.paged_attention import StepMeta
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX512-BF16 here: no few-row C linear")


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _mostly_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal but for rare last-bit differences (the sum's order, expf's last bit): each within one
    bfloat16 step of its value, or of the tensor's scale where a residual add cancelled (a last-bit
    difference in a large addend stays absolute in a small sum)."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    difference, size = (ours.float() - theirs.float()).abs(), theirs.float().abs()
    assert (difference <= size * 2**-7 + size.max() * 2**-8).all()
    assert (ours != theirs).float().mean() < 0.01


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (4, 64), (3, 1000)])
def test_rms_norm_is_llamas(rows: int, dim: int) -> None:
    norm = modeling_llama.LlamaRMSNorm(dim, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_random(dim, seed=1) + 1)
    x = _random(rows, dim) * 3
    with torch.inference_mode():
        _mostly_equal(cpu_pointwise.rms_norm(x, norm.weight.detach(), 1e-5), norm(x))


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_is_transformers_rotation_of_the_leading_heads_only(head_dim: int) -> None:
    rows, heads, untouched = 3, 5, 2 * head_dim
    x = _random(rows, heads * head_dim + untouched)
    angles = torch.arange(rows).unsqueeze(1) * torch.linspace(0.1, 1.0, head_dim // 2).repeat(2)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    as_heads = x[:, :heads * head_dim].view(rows, heads, head_dim).transpose(0, 1).unsqueeze(0)
    expected, _ = modeling_llama.apply_rotary_pos_emb(as_heads, as_heads, cos.unsqueeze(0), sin.unsqueeze(0))
    rotated = cpu_pointwise.rope_(x.clone(), cos, sin, heads, head_dim)
    ours = rotated[:, :heads * head_dim].view(rows, heads, head_dim).transpose(0, 1).unsqueeze(0)
    assert torch.equal(ours, expected)  # products and sums only: the same three roundings, bit for bit
    assert torch.equal(rotated[:, heads * head_dim:], x[:, heads * head_dim:])


def test_silu_mul_is_silu_of_gate_times_up() -> None:
    gate_up = _random(4, 2 * 1536) * 4
    gate, up = gate_up.split(1536, dim=-1)
    _mostly_equal(cpu_pointwise.silu_mul(gate_up), F.silu(gate) * up)


def test_linear_with_a_residual_rounds_twice_as_torch_does() -> None:
    weight, x, residual = _random(64, 96, seed=2), _random(3, 96, seed=3), _random(3, 64, seed=4)
    laid_out = cpu_linear.lay_out(weight)
    product = cpu_linear.linear(x, laid_out, 64, None)
    assert torch.equal(cpu_linear.linear(x, laid_out, 64, None, residual=residual), residual + product)


def test_a_residual_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="residual"):
        weight = _random(64, 96)
        cpu_linear.linear(_random(3, 96), cpu_linear.lay_out(weight), 64, None, residual=_random(2, 64))


def _decode(loaded: loader.LoadedModel, chats: int, tokens: int, repeat: int = 1, **settings: object) -> list[list[int]]:
    core = EngineCore(loaded, Settings(**{"dtype": "bfloat16", "num_blocks": 256, "debug_audit": True, **settings}))
    prompts = [loaded.tokenizer.encode(f"The quick brown fox {i} jumps over the lazy dog. " * repeat)
               for i in range(chats)]
    requests = [core.make_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)) for prompt in prompts]
    for request in requests:
        core.add(request)
    out: dict[str, list[int]] = {request.request_id: [] for request in requests}
    while core.has_work:
        for output in core.step():
            for delta in output.deltas:
                out[output.request_id].extend(delta.token_ids)
    report = audit(core.pool)
    assert report.ok and report.used == 0, report.format()
    return [out[request.request_id] for request in requests]


def _load(folder: Path, monkeypatch: pytest.MonkeyPatch, few_rows: bool) -> loader.LoadedModel:
    with monkeypatch.context() as patch:
        if not few_rows:
            patch.setattr(loader, "fuse_layers", lambda model: 0)
        return loader.load_model(Settings(model=str(folder), dtype="bfloat16", device="cpu"))


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_tiny_models_decode_the_same_tokens_as_through_their_modules(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str, overrides: dict[str, object]) -> None:
    folder = save_tiny_model(tmp_path / model_type, model_type, **overrides)
    fast, plain = _load(folder, monkeypatch, True), _load(folder, monkeypatch, False)
    assert all(isinstance(layer, FusedLayer) for layer in fast.model.model.layers)
    assert not any(isinstance(layer, FusedLayer) for layer in plain.model.model.layers)
    calls = {"fused": 0}
    original = FusedLayer._fused

    def counted(self: FusedLayer, *args: object) -> torch.Tensor:
        calls["fused"] += 1
        return original(self, *args)

    monkeypatch.setattr(FusedLayer, "_fused", counted)
    for chats in (1, 3, 6):  # six chats decode in steps of six rows: past the few-row linear
        calls["fused"] = 0
        assert _decode(fast, chats, 12) == _decode(plain, chats, 12), chats
        assert calls["fused"] >= 12 * len(fast.model.model.layers)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_chunked_prompts_and_other_kv_dtypes_decode_the_same_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kv_dtype: str) -> None:
    folder = save_tiny_model(tmp_path / "llama", "llama")
    fast, plain = _load(folder, monkeypatch, True), _load(folder, monkeypatch, False)
    options = {"kv_dtype": kv_dtype, "max_batch_tokens": 64}  # ~200-token prompts: four chunks each, then decode
    assert _decode(fast, 3, 10, repeat=6, **options) == _decode(plain, 3, 10, repeat=6, **options)


@pytest.fixture(scope="module")
def default_models(default_model_dir: Path) -> tuple[loader.LoadedModel, loader.LoadedModel]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _load(default_model_dir, monkeypatch, True), _load(default_model_dir, monkeypatch, False)


def test_the_default_model_decodes_one_chat_as_through_its_modules(default_models) -> None:
    fast, plain = default_models
    assert sum(isinstance(layer, FusedLayer) for layer in fast.model.model.layers) == 30
    assert _decode(fast, 1, 24) == _decode(plain, 1, 24)


@pytest.mark.parametrize("rows", [2, 4, 64])
def test_every_default_layer_computes_what_its_modules_compute(default_models, rows: int) -> None:
    """A decode step of `rows` chats with histories in the cache, layer by layer from the same input:
    the outputs and the keys and values written agree but for rare last bits (RMSNorm's sum order),
    which is why two chats' greedy tokens may part where the modules' top two logits nearly tie."""
    fast, plain = default_models
    block_size, blocks_per_seq = 16, 4
    lengths = torch.tensor([1 + (5 + 17 * row) % 63 for row in range(rows)], dtype=torch.int32)
    tables = torch.arange(rows * blocks_per_seq, dtype=torch.int32).view(rows, blocks_per_seq)
    slots = torch.tensor([int(tables[row, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for row, n in enumerate(lengths.tolist())])
    kv = {}
    for name in ("fast", "plain"):
        kv[name] = KVTensors(30, rows * blocks_per_seq, block_size, 3, 64, torch.bfloat16)
        kv[name].data.copy_(_random(*kv["fast"].data.shape, seed=5))
    hidden = _random(1, rows, 576, seed=6)
    with torch.inference_mode():
        position_embeddings = fast.model.model.rotary_emb(hidden, (lengths.long() - 1).unsqueeze(0))
        for index, (ours, theirs) in enumerate(zip(fast.model.model.layers, plain.model.model.layers)):
            outputs = []
            for layer, name in ((ours, "fast"), (theirs, "plain")):
                step = StepMeta(kv=kv[name], slot_mapping=slots, num_decode=rows, decode_block_tables=tables,
                                decode_context_lens=lengths, prefill=None)
                outputs.append(layer(hidden, position_embeddings=position_embeddings, chatcore_step=step))
            _mostly_equal(*outputs)
            _mostly_equal(kv["fast"].data[index], kv["plain"].data[index])


def test_the_original_projections_still_compute_theirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_tiny_model(tmp_path / "qwen2", "qwen2")  # q, k and v with biases
    fast, plain = _load(folder, monkeypatch, True), _load(folder, monkeypatch, False)
    for ours, theirs in zip(fast.model.model.layers, plain.model.model.layers):
        assert isinstance(ours.self_attn.q_proj, Projection) and isinstance(ours.mlp.up_proj, Projection)
        for rows in (1, 9):
            x = _random(rows, 64, seed=rows)
            with torch.inference_mode():
                for name in ("q_proj", "k_proj", "v_proj"):
                    assert torch.equal(getattr(ours.self_attn, name)(x), getattr(theirs.self_attn, name)(x))
                for name in ("gate_proj", "up_proj"):
                    assert torch.equal(getattr(ours.mlp, name)(x), getattr(theirs.mlp, name)(x))


def test_float32_and_modules_it_does_not_match_keep_their_forward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_tiny_model(tmp_path / "llama", "llama")
    fp32 = loader.load_model(Settings(model=str(folder), dtype="float32", device="cpu"))
    assert not any(isinstance(layer, FusedLayer) for layer in fp32.model.model.layers)

    def offset_norm(self: modeling_llama.LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return ((1 + self.weight.float()) * x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", offset_norm)  # a future version's norm, say
    changed = loader.load_model(Settings(model=str(folder), dtype="bfloat16", device="cpu"))
    assert not any(isinstance(layer, FusedLayer) for layer in changed.model.model.layers)
    assert fused_layer.fuse_layers(changed.model) == 0
