"""One configuration: flags over the environment over the config file over the defaults, a flag for
every setting, and `chatcore config show` with each value's source and no secrets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from chatcore.cli import build_parser, main
from chatcore.config import CONFIG_ENV, Settings, load_config
from tests.test_store_commands import HOSTILE_URLS, LEAKED


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No CHATCORE_* from the caller, and a working directory without a chatcore.toml."""
    import os

    for name in [n for n in os.environ if n.startswith("CHATCORE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def _show(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, str]:
    """`config show`'s lines as name -> 'value  # source'."""
    assert main([*argv]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    return {line.split(" = ")[0]: line.split(" = ", 1)[1] for line in lines if not line.startswith("#")}


def test_flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "chatcore.toml").write_text('port = 7001\nblock_size = 32\nmax_num_seqs = 8\nmodel = "from-file"\n')
    monkeypatch.setenv("CHATCORE_BLOCK_SIZE", "64")
    monkeypatch.setenv("CHATCORE_MAX_NUM_SEQS", "9")
    shown = _show(capsys, "config", "show", "--max-num-seqs", "10")
    assert shown["max_num_seqs"] == "10  # flag"
    assert shown["block_size"] == "64  # env CHATCORE_BLOCK_SIZE"
    assert shown["port"] == "7001  # file"
    assert shown["host"] == '"127.0.0.1"  # default'
    config = load_config({"max_num_seqs": 10})
    assert (config.settings.max_num_seqs, config.settings.block_size, config.settings.port,
            config.settings.model, config.settings.host) == (10, 64, 7001, "from-file", "127.0.0.1")
    assert config.file == Path("chatcore.toml")


def test_the_file_is_named_by_flag_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "chatcore.toml").write_text("port = 7001\n")
    (tmp_path / "by-env.toml").write_text("port = 7002\n")
    (tmp_path / "by-flag.toml").write_text("port = 7003\n")
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "by-env.toml"))
    assert _show(capsys, "config", "show")["port"] == "7002  # file"
    assert _show(capsys, "--config", str(tmp_path / "by-flag.toml"), "config", "show")["port"] == "7003  # file"


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_unknown_key_or_a_bad_value_is_one_line_and_exit_2(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "chatcore.toml").write_text("port = 7001\nblock_sise = 32\n")
    assert "unknown setting(s) block_sise" in _refused(capsys, "config", "show")
    (tmp_path / "chatcore.toml").write_text('port = "eighty"\n')
    assert "port (file chatcore.toml)" in _refused(capsys, "config", "show")
    (tmp_path / "chatcore.toml").write_text("port = \n")
    assert "not valid TOML" in _refused(capsys, "config", "show")
    assert "not found" in _refused(capsys, "--config", str(tmp_path / "absent.toml"), "config", "show")


def test_show_redacts_database_passwords_and_key_like_values(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from chatcore.config_show import redact

    (tmp_path / "chatcore.toml").write_text('database_url = "postgresql+asyncpg://chat:s3cret@db.example/chatcore"\n')
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and '"postgresql+asyncpg://chat:***@db.example/chatcore"  # file' in out
    assert redact("admin_api_key", "cc_live_abc") == "[redacted]"
    assert redact("max_message_tokens", 4096) == 4096


@pytest.mark.parametrize("url", list(HOSTILE_URLS))
def test_show_masks_every_secret_a_database_url_can_hold(url: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`config show` prints the URL as `masked_url` does (what `migrate` and `cluster up` print):
    no query secret, and no part of a password with an unescaped `@`, `/` or `?`."""
    monkeypatch.setenv("CHATCORE_DATABASE_URL", url)
    shown = _show(capsys, "config", "show")["database_url"]
    assert not LEAKED.search(shown), shown
    assert shown == f"{json.dumps(HOSTILE_URLS[url])}  # env CHATCORE_DATABASE_URL"


def test_every_setting_is_a_flag_with_its_description() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = {action.dest: action for action in serve._actions if action.dest in Settings.model_fields}
    assert set(flags) == set(Settings.model_fields)
    for name, action in flags.items():
        description = Settings.model_fields[name].description
        assert description and action.help.startswith(description.replace("%", "%%")), name
        assert f"CHATCORE_{name.upper()}" in action.help
    assert isinstance(flags["debug_audit"], argparse.BooleanOptionalAction)


def test_flags_parse_by_the_setting_type(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-gb", "2.5", "--allowed-origins", "http://a.test,http://b.test",
                                      "--no-debug-audit", "--dtype", "bfloat16", "--max-context", "512"])
    assert (args.kv_cache_gb, args.allowed_origins, args.debug_audit, args.dtype, args.max_context) == (
        2.5, ["http://a.test", "http://b.test"], False, "bfloat16", 512)
    args = build_parser().parse_args(["serve", "--kv-cache-gb", "auto", "--allowed-origins", '["http://c.test"]'])
    assert (args.kv_cache_gb, args.allowed_origins) == ("auto", ["http://c.test"])
    assert not hasattr(args, "port")  # not given: the environment and the file still count
    args = build_parser().parse_args(["--data-dir", "/srv/chat", "migrate", "--database-url", "sqlite+aiosqlite://"])
    assert (args.data_dir, args.database_url) == (Path("/srv/chat"), "sqlite+aiosqlite://")
    for bad in (["--kv-cache-gb", "lots"], ["--dtype", "int8"], ["--port", "http"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    capsys.readouterr()


def test_batch_limits_auto_picks_the_devices_and_a_setting_wins(monkeypatch) -> None:
    import torch

    from chatcore.engine.batch_limits import CPU_LIMITS, CUDA_LIMITS, BatchLimits, batch_limits

    assert batch_limits(Settings(), torch.device("cpu")) == CPU_LIMITS == BatchLimits(512, 64)
    assert batch_limits(Settings(), torch.device("cuda")) == CUDA_LIMITS == BatchLimits(8192, 256)
    monkeypatch.setenv("CHATCORE_MAX_NUM_SEQS", "8")
    assert batch_limits(Settings(max_batch_tokens=1024), torch.device("cuda")) == BatchLimits(1024, 8)
