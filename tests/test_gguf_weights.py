"""`weights=auto`: a GGUF model's own blocks as its linears' weights on the CPU (models/gguf_weights.py).

The default model: every linear it replaces (210 Q4_1 projections and the Q8_0 LM head tied to the
embedding) holds exactly the values transformers dequantized into the converted folder, rows in its
order (the q/k permutation undone); the fingerprint differs from weights=full's; fidelity against
transformers on the dequantized float32 weights, teacher-forced (issue 54): top-1 agreement >= 0.98
on the fidelity prompts x 48 tokens and every logit within 5% of its row's range, free-running
greedy agreement reported; a chat served through the
real server with the block audit clean. A tiny GGUF written with GGUFWriter: `--model PATH.gguf`
serves it, equal to transformers on the same file. Refusals, one line each: an unsupported
architecture or quantization type, a truncated file, a corrupt header.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from chatcore.cache import audit
from chatcore.config import Settings
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams
from chatcore.kernels import cpu_quant
from chatcore.models.fetch import GGUF_FILE
from chatcore.models.fetch import default_model_dir as model_folder
from chatcore.models.gguf_weights import QuantLinear, UnsupportedGGUF
from chatcore.models.loader import LoadedModel, load_model
from tests.engine_helpers import LONG_SYSTEM, QUESTIONS, chat_ids, hf_greedy, run_to_end, top1_agreement
from tests.inprocess_server import serve
from tests.server_helpers import hello, turn
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import save_tiny_model

AGREEMENT = 0.98  # teacher-forced top-1 (issue 54)
LOGIT_SHARE = 0.05  # a logit's error over its row's range (max - min) at most
NEW_TOKENS = 48


def _greedy(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # A step of the reference stand-in (kernels/cpu_quant.py before the C kernel) takes seconds on a
    # busy machine: no request may fail for its wait in the queue.
    core = EngineCore(loaded, Settings(dtype=loaded.dtype_name, num_blocks=512, debug_audit=True,
                                       max_queue_wait_s=3600))
    requests = [core.make_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    for req in requests:
        core.add(req)
    finals = run_to_end(core)
    assert all(finals[r.request_id].error is None for r in requests)
    report = audit(core.pool)
    assert report.ok and report.used == 0, report.format()
    return [finals[r.request_id].outputs[0].token_ids for r in requests]


def _quant_linears(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.fixture(autouse=True)
def _best_quant_path() -> Iterator[None]:
    """A test that forces a `quant_isa` leaves the best path to the next."""
    yield
    cpu_quant.use_isa("auto")


# --- settings ----------------------------------------------------------------------------------------


def test_a_quant_isa_this_cpu_lacks_is_refused_at_load_in_one_line() -> None:
    from chatcore.models.int8_weights import UnsupportedWeights
    from chatcore.models.loader import _use_quant_isa

    with pytest.raises(UnsupportedWeights, match=r"^quant_isa=avx9: this CPU and build run [^\n]*$"):
        _use_quant_isa("avx9")
    assert cpu_quant.isa() == (cpu_quant.supported_isas() or ("reference",))[0]


def test_auto_is_the_default_and_a_model_that_is_no_gguf_loads_as_full(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATCORE_WEIGHTS", raising=False)  # tests/conftest.py pins full for the other tests
    assert Settings().weights == "auto"
    folder = save_tiny_model(tmp_path / "llama", "llama")
    full = load_model(Settings(model=str(folder), device="cpu", weights="full"))
    for weights in ("auto", "gguf"):  # no GGUF to serve: loaded as full, and named full
        other = load_model(Settings(model=str(folder), device="cpu", weights=weights))
        assert not _quant_linears(other.model) and other.fingerprint == full.fingerprint and other.dtype == full.dtype
        assert other.weights == "full"


def test_auto_serves_the_blocks_where_the_cpu_lacks_native_bfloat16_and_gguf_everywhere(tmp_path: Path) -> None:
    """auto serves the default model's GGUF blocks exactly where `dtype=auto` is float32 (AVX2,
    AVX-512F); elsewhere (AVX512-BF16, AMX) full bfloat16 weights. A model given as a .gguf file
    serves its blocks under auto on every CPU (issue 54), as gguf does; gguf is refused on another
    device in one line."""
    from chatcore.models.device import resolve_dtype
    from chatcore.models.int8_weights import UnsupportedWeights, check_weights
    from chatcore.models.loader import serves_blocks

    cpu = torch.device("cpu")
    assert serves_blocks("auto", cpu) == (resolve_dtype("auto", cpu) == torch.float32)
    assert serves_blocks("gguf", cpu) and not serves_blocks("full", cpu) and not serves_blocks("gguf", torch.device("cuda"))
    assert serves_blocks("auto", cpu, bare_gguf=True) and not serves_blocks("auto", torch.device("cuda"), True)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", {})
    auto = load_model(Settings(model=str(path), device="cpu", weights="auto"))
    assert _quant_linears(auto.model) and auto.weights == "gguf" and auto.dtype == torch.float32
    with pytest.raises(UnsupportedWeights, match="weights=gguf runs on the CPU only"):
        check_weights("gguf", torch.device("cuda"))


# --- the default model --------------------------------------------------------------------------------


@pytest.mark.model
def test_model_fetch_keeps_the_gguf_as_it_is_in_a_folder_converted_without_it(tmp_path: Path,
                                                                             default_model_dir: Path) -> None:
    from chatcore.models.fetch import COMPLETE_MARKER, fetch_default_model, find_gguf

    folder = model_folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / COMPLETE_MARKER).write_text("complete\n")  # converted before the GGUF was kept
    assert fetch_default_model(tmp_path) == (folder, True)
    assert (folder / GGUF_FILE).read_bytes() == find_gguf().read_bytes()
    assert fetch_default_model(tmp_path) == (folder, False)
    assert sorted(p.name for p in folder.iterdir()) == sorted([COMPLETE_MARKER, GGUF_FILE])  # no staging left


@pytest.fixture(scope="module")
def gguf_fp32(default_model_dir: Path) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model(Settings(weights="gguf"))  # dtype=auto: float32 activations with GGUF blocks


@pytest.mark.model
def test_the_default_model_serves_its_gguf_blocks_as_transformers_dequantized_them(gguf_fp32, hf_model,
                                                                                   loaded_fp32) -> None:
    assert (gguf_fp32.path / GGUF_FILE).is_file()  # model fetch keeps it
    assert gguf_fp32.dtype == torch.float32
    linears = _quant_linears(gguf_fp32.model)
    assert len(linears) == 30 * 7 + 1
    assert {m.quant.qtype for name, m in linears.items() if name != "lm_head"} == {"Q4_1"}
    assert linears["lm_head"].quant.qtype == "Q8_0" and gguf_fp32.model.get_output_embeddings() is linears["lm_head"]
    reference = dict(hf_model.named_modules())
    for name, linear in linears.items():  # q and k rows in transformers' order; the head is the embedding's
        assert torch.equal(cpu_quant.dequantize(linear.quant), reference[name].weight), name
    embedding = gguf_fp32.model.get_input_embeddings().weight
    assert torch.equal(embedding, hf_model.get_input_embeddings().weight)  # a dequantized table to look rows up
    assert gguf_fp32.fingerprint != loaded_fp32.fingerprint  # other weights, other KV


def _teacher_forced_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits `model` gives for each of `tokens` after `prompt` and the tokens before it: the
    prompt in one forward, then one token a forward with transformers' cache, so every product after
    the prompt takes the few-row (decode) path, as the engine's decode rows do."""
    out = model(torch.tensor([prompt]), use_cache=True)
    logits = [out.logits[0, -1]]
    for token in tokens[:-1]:
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.model
def test_fidelity_against_transformers_on_the_dequantized_float32_weights(gguf_fp32, hf_model) -> None:
    """Teacher-forced (issue 54): both models read transformers' greedy text; the blocks' top-1 must
    agree on >= 0.98 of the tokens, and every logit stay within 5% of its row's range (the integer
    paths quantize each product's input to 8-bit blocks: measured 0.981 and 2.9% on avx512vnni,
    2026-12-07). Free-running greedy output through the engine is reported, not required equal."""
    tok = gguf_fp32.tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS] + [chat_ids(tok, q, LONG_SYSTEM) for q in QUESTIONS]
    model, attention = gguf_fp32.model, gguf_fp32.model.config._attn_implementation
    agree, total, worst, worst_share = 0, 0, 0.0, 0.0
    try:
        model.config._attn_implementation = "sdpa"  # transformers' own attention: no step metadata here
        with torch.inference_mode():
            for prompt in prompts:
                text = hf_greedy(hf_model, prompt, NEW_TOKENS)
                expected = hf_model(torch.tensor([prompt + text[:-1]])).logits[0, len(prompt) - 1:]
                ours = _teacher_forced_logits(model, prompt, text)
                agree, total = agree + int((ours.argmax(-1) == expected.argmax(-1)).sum()), total + len(text)
                error = (ours - expected).abs().amax(-1)
                worst = max(worst, float(error.max()))
                worst_share = max(worst_share, float((error / (expected.amax(-1) - expected.amin(-1))).max()))
    finally:
        model.config._attn_implementation = attention
    outputs = _greedy(gguf_fp32, prompts, NEW_TOKENS)
    free_running, _ = top1_agreement(hf_model, prompts, outputs)
    with torch.inference_mode():  # transformers stops at EOS, which the engine ignored: equal up to there
        references = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts[:8]]
    equal = sum(ref == out[:len(ref)] for ref, out in zip(references, outputs[:8], strict=True))
    print(f"GGUF blocks ({cpu_quant.isa()}): teacher-forced top-1 agreement {agree / total:.4f} over {total} tokens, "
          f"max |logit error| {worst:.3f} ({worst_share:.2%} of its row's range); free-running through the engine: "
          f"transformers agrees with {free_running:.4f} of its tokens, greedy equal on {equal} of 8")
    assert agree / total >= AGREEMENT
    assert worst_share <= LOGIT_SHARE


@pytest.mark.model
async def test_the_server_serves_a_chat_from_the_gguf_blocks(gguf_fp32, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, weights="gguf", dtype="float32", num_blocks=128, kv_disk_gb=0,
                        debug_audit=True)
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    async with serve(settings, gguf_fp32) as server:  # on leaving: the engine's block audit must hold
        async with server.connect() as ws:
            await hello(ws, system_prompt="You are a concise geography tutor.")
            text, first = await turn(ws, QUESTIONS[0], params)
            _, second = await turn(ws, "And of Italy?", params)
    assert text.strip() and first["usage"]["completion_tokens"] == 8
    history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["cached_tokens"] >= history // 16 * 16 > 0  # the first turn's blocks reused


# --- a tiny GGUF of our own: --model PATH.gguf ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_gguf_file_serves_its_blocks_equal_to_transformers_on_the_same_file(tiny_gguf: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from chatcore import cli

    # the float products (exact weights, float32 activations): a tiny random model's top logits nearly
    # tie, so greedy equality is asked of them; the integer paths' fidelity is the default model's test
    float_path = next((p for p in cpu_quant.supported_isas() if p not in cpu_quant.INTEGER_ISAS), "reference")
    loaded = load_model(Settings(model=str(tiny_gguf), device="cpu", weights="gguf", quant_isa=float_path))
    linears = _quant_linears(loaded.model)
    assert {m.quant.qtype for m in linears.values()} == {"Q4_0", "Q4_1", "Q8_0"} and "lm_head" in linears
    full = load_model(Settings(model=str(tiny_gguf), device="cpu", weights="full", dtype="float32"))
    assert not _quant_linears(full.model) and full.fingerprint != loaded.fingerprint
    twin = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    prompts = [chat_ids(loaded.tokenizer, q) for q in QUESTIONS[:3]]
    ours = _greedy(loaded, prompts, 12)
    with torch.inference_mode():  # transformers stops at EOS, which the engine ignored: equal up to there
        references = [hf_greedy(twin.eval(), p, 12) for p in prompts]
    assert all(ref and ref == out[:len(ref)] for ref, out in zip(references, ours, strict=True))
    assert cli.main(["generate", "--model", str(tiny_gguf), "--device", "cpu", "--weights", "gguf",
                     "--quant-isa", float_path, "--prompt", QUESTIONS[0], "--max-tokens", "12", "--temperature",
                     "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["token_ids"] == ours[0]


def _refusal(path: Path, capsys, weights: str = "gguf") -> str:
    """The one line `chatcore generate` prints for `path`, which must exit 2."""
    from chatcore import cli

    assert cli.main(["generate", "--model", str(path), "--device", "cpu", "--weights", weights,
                     "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_unsupported_quantization_type_is_refused_where_blocks_would_serve(tmp_path: Path, capsys) -> None:
    path = write_tiny_gguf(tmp_path / "q5.gguf", {"ffn_up": "Q5_0"})
    line = _refusal(path, capsys)
    assert "blk.0.ffn_up.weight is Q5_0" in line and "supported: Q4_0, Q4_1, Q8_0" in line, line
    full = load_model(Settings(model=str(path), device="cpu", weights="full"))  # transformers dequantizes it
    assert not _quant_linears(full.model)


def test_an_unsupported_architecture_is_refused(tmp_path: Path, capsys) -> None:
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    for weights in ("gguf", "auto", "full"):
        line = _refusal(path, capsys, weights)
        assert "architecture gpt2 is not supported (supported: llama)" in line, line


@pytest.mark.model
def test_a_truncated_or_corrupt_gguf_is_refused_at_load(tmp_path: Path, capsys, default_model_dir: Path) -> None:
    real = (default_model_dir / GGUF_FILE).read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(real[: len(real) // 2])
    assert "is truncated or corrupt" in _refusal(truncated, capsys)
    flipped = tmp_path / "flipped.gguf"
    flipped.write_bytes(real[:1] + bytes([real[1] ^ 0xFF]) + real[2:])  # the magic "GGUF"
    assert "is truncated or corrupt (ValueError: GGUF magic invalid" in _refusal(flipped, capsys)
    with pytest.raises(UnsupportedGGUF, match="truncated or corrupt"):
        load_model(Settings(model=str(truncated), device="cpu", weights="full"))  # never half-served either way
