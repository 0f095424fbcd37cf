"""Model files from outside (issue 53): names derived from paths, GGUF headers that lie, GGUFs without their
weights, and links in the cache. Each refusal is one line on the real CLI (`python -m chatcore.cli`, a
subprocess), exit 2, no traceback, and nothing in the cache folder is removed or changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatcore.models.gguf_check import UnsupportedGGUF, check_declared, read_gguf
from tests.tiny_gguf import HIDDEN, write_tiny_gguf

CLI = [sys.executable, "-m", "chatcore.cli"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("CHATCORE_")}
LYING = {"block_count": 48, "embedding_length": 9216, "feed_forward_length": 65536}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=ENV)


def one_line_refusal(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (the lock file pull creates left out), with a file's contents."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*")) if p.name != ".convert.lock"}


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache folder holding a model and a file of its own, beside the models folder."""
    root = tmp_path / "cache"
    (root / "models" / "kept").mkdir(parents=True)
    (root / "models" / "kept" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (root / "models" / "kept" / ".chatcore-complete").write_text("complete\n")
    (root / "other.txt").write_text("not chatcore's")
    return root


@pytest.mark.parametrize("file_name", ["..gguf", "...gguf", ".gguf", ".hidden.gguf"])
def test_pull_refuses_a_name_that_is_no_model_name_and_deletes_nothing(tmp_path: Path, cache: Path,
                                                                       file_name: str) -> None:
    source = tmp_path / "x"
    source.mkdir()
    write_tiny_gguf(source / file_name)  # a valid GGUF: only its name is wrong
    before = snapshot(cache)
    line = one_line_refusal(run("model", "pull", str(source / file_name), "--cache-dir", str(cache)))
    assert "cannot name a model folder" in line or "must be a .gguf file" in line, line
    assert snapshot(cache) == before


def test_pull_refuses_a_link_where_its_folder_would_go(tmp_path: Path, cache: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (cache / "models" / "tiny").symlink_to(outside, target_is_directory=True)
    line = one_line_refusal(run("model", "pull", str(write_tiny_gguf(tmp_path / "tiny.gguf")), "--cache-dir",
                                str(cache)))
    assert "symbolic link" in line
    assert (outside / "precious.txt").read_text() == "keep me" and sorted(os.listdir(outside)) == ["precious.txt"]


def test_rm_of_a_linked_folder_is_one_line_and_removes_nothing(tmp_path: Path, cache: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (cache / "models" / "linked").symlink_to(outside, target_is_directory=True)
    before = snapshot(cache)
    line = one_line_refusal(run("model", "rm", "linked", "--cache-dir", str(cache)))
    assert "symbolic link" in line
    assert snapshot(cache) == before and (outside / "config.json").is_file()


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 100])
def test_pull_of_a_malformed_gguf_is_one_line_and_leaves_nothing(tmp_path: Path, cache: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    before = snapshot(cache)
    assert "truncated or corrupt" in one_line_refusal(run("model", "pull", str(bad), "--cache-dir", str(cache)))
    assert snapshot(cache) == before


@pytest.mark.parametrize("header, said", [
    (LYING, "declares embedding_length 9216, but token_embd.weight is"),
    ({"block_count": 48}, "declares 48 layers, but has no tensors for 46 of them"),
    ({"block_count": 1}, "declares 1 layers, but holds tensors of layer 1"),
    ({"feed_forward_length": 65536}, "blk.0.ffn_gate.weight is"),
])
def test_a_header_its_tensors_do_not_bear_out_is_refused_before_the_model_is_built(
        tmp_path: Path, cache: Path, header: dict[str, int], said: str) -> None:
    lying = write_tiny_gguf(tmp_path / "lying.gguf", header=header)
    for args in (("generate", "--model", str(lying), "--device", "cpu", "--prompt", "hi"),
                 ("model", "pull", str(lying), "--cache-dir", str(cache))):
        assert said in one_line_refusal(run(*args))
    assert not (cache / "models" / "lying").exists()


def test_a_gguf_without_its_weight_tensors_is_refused(tmp_path: Path, cache: Path) -> None:
    empty = write_tiny_gguf(tmp_path / "empty.gguf", weights=False)
    for weights in ("gguf", "full"):
        line = one_line_refusal(run("generate", "--model", str(empty), "--device", "cpu", "--weights", weights,
                                    "--prompt", "hi"))
        assert "no token_embd.weight: its weight tensors are missing" in line
    assert "weight tensors are missing" in one_line_refusal(run("model", "pull", str(empty), "--cache-dir",
                                                                str(cache)))


def test_the_float32_model_must_fit_in_the_memory_available(tmp_path: Path) -> None:
    honest = write_tiny_gguf(tmp_path / "honest.gguf")
    reader = read_gguf(honest)
    weights = sum(int(t.n_elements) for t in reader.tensors) + HIDDEN * int(reader.tensors[0].shape[1])
    check_declared(reader, honest, available_bytes=weights * 4)  # exactly fits
    with pytest.raises(UnsupportedGGUF, match=f"declares {weights} weights.*of memory is available"):
        check_declared(reader, honest, available_bytes=weights * 4 - 1)
