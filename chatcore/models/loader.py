"""Loading a Hugging Face causal LM with our paged attention.

`settings.model` is "default" (the converted SmolLM2 folder, its GGUF in it), a path to a local
folder that transformers can load as a causal LM, a local .gguf file (transformers builds the model
from it; `gguf_weights.py` serves its blocks with `weights=gguf`, or `auto` where `serves_blocks` picks them), or a hub id (`org/name`) resolved through the local
Hugging Face cache (`hub.py`). After loading, one probe forward checks that the paged path
reproduces the model's attention (`support.py`): a model it would not is refused with one line.
The attention dimensions and the context come from that probe, not from config names.
The fingerprint identifies the weights and config: every persisted KV block carries it, so
KV computed by another model is never reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatcore import openmp
from chatcore.config import DEFAULT_MODEL, Settings
from chatcore.kernels import cpu_quant
from chatcore.models import in_use, paged_attention, support
from chatcore.models.fused_layer import fuse_layers
from chatcore.models.device import resolve_device, resolve_dtype
from chatcore.models.errors import ModelNotFound, UnsupportedModel
from chatcore.models.hub import is_hub_id, resolve_hub_id
from chatcore.models.fetch import GGUF_FILE
from chatcore.models.gguf_weights import check_quantization, gguf_fingerprint, install_blocks, open_gguf
from chatcore.models.int8_weights import UnsupportedWeights, cache_file, check_weights, quantize_int8
from chatcore.models.weight_layout import (
    pack_bfloat16_linears,
    store_linears_transposed,
)

FINGERPRINT_HEAD_BYTES = 1 << 20
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    stop_token_ids: frozenset[int]
    weights: str  # the weights as served: "gguf" (a GGUF's own blocks), "full" or "int8"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_model_path(settings: Settings) -> Path:
    if settings.model == DEFAULT_MODEL:
        from chatcore.models.fetch import fetch_default_model

        return fetch_default_model(settings.cache_dir)[0]
    path = Path(settings.model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"model {path}: no such GGUF file")
        return path
    if not path.exists() and is_hub_id(settings.model):
        return resolve_hub_id(settings.model)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"model {path}: not a Hugging Face model folder (no config.json)")
    return path


def model_fingerprint(path: Path) -> str:
    """A digest of the config and the head of every weight file (their headers name every tensor); of
    a GGUF file, its own (`gguf_weights.gguf_fingerprint`)."""
    if path.is_file():
        return gguf_fingerprint(path)
    digest = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        digest.update(weights.name.encode())
        digest.update(weights.stat().st_size.to_bytes(8, "little"))
        with weights.open("rb") as fh:
            digest.update(fh.read(FINGERPRINT_HEAD_BYTES))
    return digest.hexdigest()[:32]


def weights_fingerprint(fingerprint: str, weights: str) -> str:
    """The fingerprint of the weights as served (`full`, `int8`, or `gguf` for a GGUF's own blocks):
    int8 weights and GGUF blocks compute other KV than the full ones, so their blocks (in the pool's
    hashes and on disk) must never be taken for each other's."""
    if weights == "full":
        return fingerprint
    return hashlib.sha256(f"{fingerprint}/weights={weights}".encode()).hexdigest()[:32]


def _stop_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load_model(settings: Settings) -> LoadedModel:
    """The model on `settings.device`; raises `DeviceUnavailable`, or `UnsupportedWeights` for
    `weights=int8` where it cannot run, before reading any weights. With a GGUF's blocks to serve
    (`serves_blocks`, `gguf_weights.py`) the file is checked first (`UnsupportedGGUF`) and its
    blocks replace the linears transformers loaded; `dtype=auto` is float32 then. With `weights=int8`
    the decoder layers' linears are quantized first (`int8_weights.py`); the layout passes then leave
    them be. After the probe, a Llama-family bfloat16 layer on the CPU is fused (`fused_layer.py`),
    then bfloat16 linears are packed (`weight_layout.py`)."""
    device = resolve_device(settings.device)
    check_weights(settings.weights, device)
    path = resolve_model_path(settings)
    in_use.hold(path, settings.cache_dir)  # `chatcore model rm` refuses it while this process lives
    if path.is_file() and settings.weights == "int8":
        raise UnsupportedWeights(f"weights=int8 needs a Hugging Face model folder; {path.name} serves with "
                                 "weights=gguf (its own blocks) or full")
    blocks = _gguf_blocks(settings, path, device)
    if blocks is not None:
        _use_quant_isa(settings.quant_isa)
    dtype = torch.float32 if blocks is not None and settings.dtype == "auto" else resolve_dtype(settings.dtype, device)
    model, tokenizer = _from_pretrained(path, dtype)
    model.to(device)
    model.eval()
    if blocks is not None:
        count = install_blocks(model, blocks[1], blocks[0])
        log.info("weights=%s: %d linears serve %s's blocks (cpu_quant: %s)", settings.weights, count, blocks[0].name, cpu_quant.isa())
    if settings.weights == "int8":
        started = time.perf_counter()
        count = quantize_int8(model, path, tokenizer, cache_file(settings.cache_dir, model_fingerprint(path)))
        log.info("weights=int8: %d linears quantized in %.1f s", count, time.perf_counter() - started)
    store_linears_transposed(model)
    profile = _profile(model, settings.model)
    fuse_layers(model)
    pack_bfloat16_linears(model)
    openmp.release_team()  # the engine may compute on another thread (chatcore/openmp.py)
    served = "gguf" if blocks is not None else "full" if settings.weights in ("auto", "gguf") else settings.weights
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        fingerprint=weights_fingerprint(model_fingerprint(path), served),
        dtype=dtype,
        device=device,
        num_layers=model.config.num_hidden_layers,
        num_heads=profile.num_heads,
        num_kv_heads=profile.num_kv_heads,
        head_dim=profile.head_dim,
        max_context=profile.max_context,
        stop_token_ids=_stop_ids(model, tokenizer),
        weights=served,
    )


def _use_quant_isa(name: str) -> None:
    """The `quant_isa` setting applied to `cpu_quant`; a path this CPU lacks is `UnsupportedWeights`."""
    try:
        cpu_quant.use_isa(name)
    except ValueError as error:
        raise UnsupportedWeights(str(error)) from None


def serves_blocks(weights: str, device: torch.device, bare_gguf: bool = False) -> bool:
    """Whether a GGUF model serves its own blocks: `weights=gguf` on the CPU; `weights=auto` on the CPU
    for a model given as a .gguf file (`--model X.gguf`, issue 54: its blocks on every CPU), and for
    the default model on a CPU whose `dtype=auto` is float32 (no native bfloat16 matmuls: AVX2,
    AVX-512F), where the blocks read 5.6x fewer bytes a token than full float32 weights. On an
    AVX512-BF16/AMX CPU the default model's auto stays full bfloat16: its prefill is 2-4x faster than
    float32 over the blocks (docs/kernels.md), and the integer dot products' decode gain was not
    measured reliably on the loaded machine (docs/kernels.md, "Integer dot products")."""
    if device.type != "cpu":
        return False
    return weights == "gguf" or (weights == "auto" and (bare_gguf or resolve_dtype("auto", device) == torch.float32))


def _gguf_blocks(settings: Settings, path: Path, device: torch.device) -> tuple[Path, Any] | None:
    """The GGUF file whose blocks serve the linears, and its checked reader; None for weights as loaded:
    where `serves_blocks` says no, or a model that is no GGUF (the default
    model's GGUF is kept in its folder, `fetch.keep_gguf`). A bare .gguf file is checked either way."""
    bare = path.is_file()
    serves = serves_blocks(settings.weights, device, bare)
    if not bare and not (serves and settings.model == DEFAULT_MODEL):
        return None
    gguf = path if bare else path / GGUF_FILE
    reader = open_gguf(gguf)
    if not serves:
        return None
    check_quantization(reader, gguf)
    return gguf, reader


def _from_pretrained(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """transformers' model (its attention the paged one) and tokenizer, from a folder or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = paged_attention.register()
    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if path.is_file() \
        else {"pretrained_model_name_or_path": path}
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype, attn_implementation=name)
    return model, tokenizer


def _profile(model: Any, name: str) -> support.AttentionProfile:
    """The probe's profile of the loaded model, or `UnsupportedModel` naming the model."""
    positions = int(getattr(model.config, "max_position_embeddings", None) or 4096)
    try:
        profile = support.check(model, support.probe(model), positions)
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"model {name} is refused: {exc}") from exc
    if profile.max_context < positions:
        log.warning("model %s: sliding window of %d tokens; its context is capped there (from %d), where the "
                    "window masks nothing", name, profile.max_context, positions)
    return profile
