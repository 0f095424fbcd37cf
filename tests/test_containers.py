"""Dockerfile and docker-compose.yml: PostgreSQL, a one-shot set-up, two replicas and nginx.

Where a docker daemon and `docker compose` answer, the compose file is built, started, and one chat
turn goes through nginx. Everywhere, the files are checked against the repository without docker:
every path they name exists (and is in the build context), every `CHATCORE_*` variable they set is
a setting with a valid value, the ports agree with nginx's rendered configuration, and
deploy/compose-nginx.sh renders deploy/nginx.conf into a configuration a real nginx runs.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from chatcore.config import Settings
from chatcore.ops.nginx import nginx_binary
from tests.server_helpers import free_port

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
ENV_PREFIX = "CHATCORE_"
MARKER = re.compile(r"@[A-Z]+@")
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` as compose reads it with NAME unset."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined and comment lines dropped."""
    logical: list[str] = []
    pending = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, args in _dockerfile():
        if instruction == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def _service_env(name: str) -> dict[str, str]:
    """What a service's process sees: the image's ENV (for chatcore's image), then compose's environment."""
    service = SERVICES[name]
    env = _image_env() if "build" in service else {}
    raw = service.get("environment") or {}
    pairs = dict(item.split("=", 1) for item in raw) if isinstance(raw, list) else raw
    env.update({key: _interpolate(str(value)) for key, value in pairs.items()})
    return env


def _replicas() -> list[str]:
    return [name for name, service in SERVICES.items() if service.get("command") == ["chatcore", "serve"]]


def _upstreams() -> list[tuple[str, int]]:
    hosts = _service_env("nginx")["NGINX_UPSTREAMS"].split()
    return [(host, int(port)) for host, port in (item.rsplit(":", 1) for item in hosts)]


def _port(env: dict[str, str]) -> int:
    return int(env.get("CHATCORE_PORT", Settings.model_fields["port"].default))


def _dockerignored(relative: str) -> bool:
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    parts = PurePosixPath(relative).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
               for pattern in patterns for prefix in prefixes)


def _wheel_inputs() -> list[str]:
    """What `pip wheel .` reads: pyproject.toml, setup.py, the readme, the packages, MANIFEST.in's folders."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    manifest = [line.split()[1] for line in (REPO / "MANIFEST.in").read_text().splitlines()
                if line.split()[:1] in (["graft"], ["include"])]
    return ["pyproject.toml", "setup.py", "MANIFEST.in", project["project"]["readme"], *packages, *manifest]


def test_every_path_the_files_name_exists_in_the_build_context() -> None:
    copied = [src for instruction, args in _dockerfile() if instruction == "COPY" and "--from" not in args
              for src in args.split()[:-1]]
    assert copied, "the Dockerfile copies nothing from the context"
    for relative in [*copied, *_wheel_inputs()]:
        assert (REPO / relative).exists(), relative
        assert relative == "." or not _dockerignored(relative), f"{relative} is excluded by .dockerignore"
    for name, service in SERVICES.items():
        if "build" in service:
            assert service["build"] == ".", name
        mounted = {}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (REPO / source).is_file(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in COMPOSE["volumes"], f"{name} mounts an undeclared volume {source}"
            mounted[target] = source
        for word in service.get("command", []):
            if word.startswith("/"):
                assert word in mounted, f"{name} runs {word}, which nothing mounts"


def test_every_chatcore_variable_is_a_setting_with_a_valid_value() -> None:
    environments = {"Dockerfile": _image_env(), **{name: _service_env(name) for name in SERVICES}}
    assert any(ENV_PREFIX + "DATABASE_URL" in env for env in environments.values())
    for where, env in environments.items():
        chatcore = {k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX)}
        unknown = set(chatcore) - set(Settings.model_fields)
        assert not unknown, f"{where} sets CHATCORE_ variables that are no setting: {sorted(unknown)}"
        Settings(**chatcore)  # raises on a value the setting refuses


def test_ports_agree_with_nginx_conf() -> None:
    image = _image_env()
    exposed = [int(port) for instruction, args in _dockerfile() if instruction == "EXPOSE" for port in args.split()]
    assert exposed == [_port(image)]
    upstreams = _upstreams()
    assert sorted(host for host, _ in upstreams) == sorted(_replicas())
    assert len(upstreams) >= 2
    nginx = SERVICES["nginx"]
    for host, port in upstreams:
        assert _port(_service_env(host)) == port, host
        (health_url,) = [w for w in SERVICES[host]["healthcheck"]["test"][-1].split("'") if w.startswith("http")]
        assert urlsplit(health_url).port == port, host
        assert nginx["depends_on"][host]["condition"] == "service_healthy"
    (published,) = nginx["ports"]
    assert _interpolate(published).rsplit(":", 1)[1] == _service_env("nginx")["NGINX_LISTEN"]
    template = (REPO / "deploy" / "nginx.conf").read_text()
    script = (REPO / "deploy" / "compose-nginx.sh").read_text()
    assert set(MARKER.findall(template)) == set(MARKER.findall(script)) == {"@PREFIX@", "@LISTEN@", "@SERVERS@"}


def test_replicas_share_postgres_the_disk_tier_and_the_model_cache() -> None:
    postgres = _service_env("postgres")
    envs = {name: _service_env(name) for name in [*_replicas(), "setup"]}
    for name, env in envs.items():
        url = urlsplit(env["CHATCORE_DATABASE_URL"])
        assert url.scheme == "postgresql+asyncpg", name
        assert (url.hostname, url.username, url.password, url.path.lstrip("/")) == (
            "postgres", postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"]), name
        assert SERVICES[name]["depends_on"]  # the replicas wait for set-up, set-up for PostgreSQL
    assert SERVICES["setup"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in _replicas():
        assert SERVICES[name]["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    for key in ("CHATCORE_KV_DISK_DIR", "CHATCORE_CACHE_DIR"):
        assert len({env[key] for env in envs.values()}) == 1, key
    replicas = [envs[name] for name in _replicas()]
    for key in ("CHATCORE_REPLICA_ID", "CHATCORE_DATA_DIR"):
        assert len({env[key] for env in replicas}) == len(replicas), f"replicas share {key}"
    for name in _replicas():
        mounts = {v.split(":")[1] for v in SERVICES[name]["volumes"]}
        for key in ("CHATCORE_KV_DISK_DIR", "CHATCORE_CACHE_DIR", "CHATCORE_DATA_DIR"):
            assert any(Path(envs[name][key]).is_relative_to(m) for m in mounts), f"{name}: {key} is on no volume"


@pytest.mark.skipif(nginx_binary() is None, reason="needs nginx (make services)")
def test_compose_nginx_script_renders_a_working_configuration(tmp_path: Path) -> None:
    """The script, run with the compose file's upstream ports on loopback where nothing listens:
    nginx starts, and tries each upstream in turn (its `X-Chatcore-Upstream` names them all)."""
    dead = [f"127.0.0.1:{free_port()}" for _ in _upstreams()]
    port = free_port()
    env = {**os.environ, "NGINX_TEMPLATE": str(REPO / "deploy" / "nginx.conf"), "NGINX_PREFIX": str(tmp_path),
           "NGINX_LISTEN": f"127.0.0.1:{port}", "NGINX_UPSTREAMS": " ".join(dead),
           "PATH": f"{Path(str(nginx_binary())).parent}:{os.environ['PATH']}"}
    log = (tmp_path / "out.log").open("wb")
    proc = subprocess.Popen(["sh", str(REPO / "deploy" / "compose-nginx.sh")], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, (tmp_path / "out.log").read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
            except urllib.error.HTTPError as err:
                assert err.code == 502
                assert sorted(err.headers["X-Chatcore-Upstream"].split(", ")) == sorted(dead)
                break
            except OSError:
                assert time.monotonic() < deadline, "nginx never listened"
                time.sleep(0.1)  # polling for the port to open
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(timeout=10)
        log.close()


def _docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    checks = (["docker", "info"], ["docker", "compose", "version"])
    return all(subprocess.run(c, capture_output=True, check=False, timeout=30).returncode == 0 for c in checks)


@pytest.mark.skipif(not _docker_compose(), reason="needs a docker daemon and docker compose")
@pytest.mark.timeout(2400)
def test_compose_answers_a_chat_turn_through_nginx(tmp_path: Path) -> None:
    port = free_port()
    compose = ["docker", "compose", "-p", f"chatcore-test-{os.getpid()}", "-f", str(REPO / "docker-compose.yml")]
    env = {**os.environ, "NGINX_PORT": str(port)}

    def run(*args: str, timeout: float = 120) -> str:
        return subprocess.run([*compose, *args], env=env, capture_output=True, text=True, check=True,
                              timeout=timeout).stdout

    try:
        run("up", "-d", "--build", timeout=2100)  # returns once nginx started, after the replicas were healthy
        key = run("exec", "-T", "replica-1", "cat", "/var/lib/chatcore/data/admin.key").strip()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
            data=b'{"model":"SmolLM2-135M-Instruct","max_tokens":4,"temperature":0,'
                 b'"messages":[{"role":"user","content":"Say hello."}]}',
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert resp.status == 200
            assert resp.headers["X-Chatcore-Upstream"].rsplit(":", 1)[1] == str(_upstreams()[0][1])
            assert b'"completion_tokens"' in resp.read()
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], env=env, capture_output=True, check=False,
                       timeout=300)
