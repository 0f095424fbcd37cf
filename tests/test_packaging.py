"""A newcomer's check: the wheel, installed outside the checkout, serves the UI, migrates its database
and answers a chat turn over HTTP and over the WebSocket, without triton.

The wheel is built from a copy of the files a clone would have (tracked, plus untracked files git
does not ignore), then installed with `--no-deps` into a fresh venv. That venv sees the
dependencies already installed here (Hugging Face's `kernels` among them, which transformers
imports) through a `.pth` file naming a folder of links to this environment's site-packages, less
chatcore itself and triton: nothing is downloaded, and only the installed wheel can provide
`chatcore`, `chatcore.kernels`, `web/` and `migrations/`. The wheel installs `chatcore` and no other
top-level name.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from alembic.script import ScriptDirectory
from packaging.requirements import Requirement

from tests.server_helpers import LiveServer, free_port, recv_until

REPO = Path(__file__).resolve().parents[1]
HIDDEN = ("chatcore", "__editable__", "triton")  # site-packages entries the venv must not see
STARTUP_TIMEOUT_S = 60

pytestmark = pytest.mark.model


@dataclass
class Installed:
    source: Path  # the tree the wheel was built from
    wheel: Path
    venv: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"


def _run(args: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, check=True, timeout=120, **kwargs)


def _clone_files(dest: Path) -> None:
    """Copy what a fresh clone (plus new, unignored files) holds, links as links: no build outputs, no venv."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # chatcore/kernels and chatcore/bench, as git keeps them
            (dest / name).symlink_to(os.readlink(source))
        elif source.is_file():
            (dest / name).write_bytes(source.read_bytes())


def _dependency_links(dest: Path) -> None:
    """Links to this environment's installed distributions, except chatcore's own and triton's."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(HIDDEN):
            (dest / entry.name).symlink_to(entry)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    (root / "src").mkdir()
    _clone_files(root / "src")
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root / "dist", root / "src"])
    (wheel,) = (root / "dist").glob("chatcore-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    _run([*pip, "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index", "-q", wheel])
    _dependency_links(root / "deps")
    purelib = _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (Path(purelib.stdout.strip()) / "chatcore-test-deps.pth").write_text(f"{root / 'deps'}\n")
    return Installed(root / "src", wheel, venv)


def _outside_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "CHATCORE_DATA_DIR": str(data_dir), "CHATCORE_HOST": "127.0.0.1",
            "CHATCORE_KV_CACHE_GB": "0.25", "CHATCORE_KV_DISK_GB": "0.1"}


def test_wheel_requires_triton_only_on_linux(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        metadata_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    (triton,) = [Requirement(r) for r in metadata.get_all("Requires-Dist") if Requirement(r).name == "triton"]
    assert triton.marker is not None
    assert triton.marker.evaluate({"platform_system": "Linux", "extra": ""})
    assert not triton.marker.evaluate({"platform_system": "Darwin", "extra": ""})
    assert not triton.marker.evaluate({"platform_system": "Windows", "extra": ""})


def test_the_wheel_installs_one_top_level_name_that_no_other_distribution_provides(installed: Installed,
                                                                                    tmp_path: Path) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        top = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert {name for name in top if not name.endswith(".dist-info")} == {"chatcore"}
    probe = ("import importlib.metadata as m, json; "
             "print(json.dumps({n: d for n, d in m.packages_distributions().items() if 'chatcore' in d}))")
    out = _run([installed.bin / "python", "-c", probe], cwd=tmp_path, env=_outside_env(tmp_path)).stdout
    assert json.loads(out) == {"chatcore": ["chatcore"]}


def test_the_venv_runs_the_installed_package(installed: Installed, tmp_path: Path) -> None:
    probe = ("import importlib.util, pathlib, chatcore, chatcore.resources as r; "
             "from chatcore.kernels import dispatch as kernels; "
             "c_source = pathlib.Path(kernels.__file__).with_name('cpu_decode.c'); "
             "print(chatcore.__file__, kernels.__file__, c_source, r.WEB_DIR, r.MIGRATIONS_DIR, r.NGINX_TEMPLATE, "
             "sep='\\n'); "
             "print(importlib.util.find_spec('triton'))")
    out = _run([installed.bin / "python", "-c", probe], cwd=tmp_path, env=_outside_env(tmp_path)).stdout.split("\n")
    *paths, triton = filter(None, out)
    for path in paths:
        assert Path(path).is_relative_to(installed.venv), path
        assert Path(path).exists(), path
    assert triton == "None"


def _wait_healthy(server: LiveServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"chatcore serve exited with {server.proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.base_url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)  # polling for the port to open
    raise AssertionError(f"chatcore serve did not answer /healthz within {STARTUP_TIMEOUT_S} s:\n{server.log()}")


async def _ws_turn(server: LiveServer) -> dict[str, Any]:
    """One turn over the WebSocket: its `done` frame, after at least one token of text."""
    async with server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": None}))
        await recv_until(ws, "session")
        await ws.send(json.dumps({"type": "user", "id": "q1", "content": "Say hello.",
                                  "params": {"max_tokens": 4, "temperature": 0}}))
        frames = await recv_until(ws, "done")
    assert "".join(f["text"] for f in frames if f["type"] == "token").strip(), frames
    return frames[-1]


def _get_bytes(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


def test_installed_serve_outside_the_checkout(installed: Installed, tmp_path: Path, default_model_dir: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    env = {**_outside_env(data_dir), "CHATCORE_PORT": str(port)}
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([installed.bin / "chatcore", "serve"], cwd=tmp_path, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", data_dir, proc, env, log_path)
    try:
        _wait_healthy(server)
        web = installed.source / "web"
        assert _get_bytes(server.base_url + "/") == (web / "index.html").read_bytes()
        assert _get_bytes(server.base_url + "/static/js/app.js") == (web / "js" / "app.js").read_bytes()

        status, created = server.request("POST", "/v1/sessions", {"title": "from the wheel"})
        assert status == 201, created
        status, reply = server.request("POST", "/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]})
        assert status == 200, reply
        (choice,) = reply["choices"]
        assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"].strip(), reply
        assert reply["usage"]["completion_tokens"] > 0
        done = asyncio.run(_ws_turn(server))
        assert done["finish_reason"] in ("stop", "length"), done
    finally:
        server.stop(signal.SIGTERM)
    assert proc.returncode in (0, -signal.SIGTERM), server.log()  # uvicorn re-raises the signal it handled

    head = ScriptDirectory(str(installed.source / "migrations")).get_current_head()
    with sqlite3.connect(data_dir / "chatcore.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]
        # the one made over HTTP, and the WebSocket turn's (untitled)
        assert sorted(db.execute("SELECT title FROM sessions").fetchall()) == [("",), ("from the wheel",)]
