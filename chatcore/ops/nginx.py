"""nginx in front of the replicas: its configuration, rendered from deploy/nginx.conf, and its
process, in the foreground of its own process group, on loopback."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from chatcore.ops.errors import ClusterError
from chatcore.ops.processes import wait_started
from chatcore.resources import NGINX_TEMPLATE


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def render_nginx_conf(prefix: Path, listen: str, upstreams: list[str], fail_timeout_s: int = 5) -> str:
    """deploy/nginx.conf with its markers replaced."""
    servers = "\n".join(f"        server {u} max_fails=1 fail_timeout={fail_timeout_s}s;" for u in upstreams)
    lines = []
    for line in NGINX_TEMPLATE.read_text().splitlines():
        if not line.lstrip().startswith("#"):  # the header's comments name the markers
            line = line.replace("@PREFIX@", str(prefix)).replace("@LISTEN@", listen)
            line = servers if line.strip() == "@SERVERS@" else line
        lines.append(line)
    return "\n".join(lines) + "\n"


def start_nginx(prefix: Path, port: int, upstreams: list[str]) -> subprocess.Popen[bytes]:
    """nginx in the foreground of its own process group, on 127.0.0.1:`port`; returns once it listens."""
    binary = nginx_binary()
    if binary is None:
        raise ClusterError("nginx is not installed: apt-get install nginx (or `make services`)")
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(prefix, f"127.0.0.1:{port}", upstreams))
    base = [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    check = subprocess.run([*base, "-t"], check=False, capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise ClusterError(f"nginx rejected {conf}:\n{check.stderr}")
    with (prefix / "stderr.log").open("ab") as log:
        proc = subprocess.Popen([*base, "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_started("nginx", f"http://127.0.0.1:{port}/healthz", proc, prefix / "error.log", 60)
    except ClusterError:
        proc.kill()
        proc.wait()
        raise
    return proc
