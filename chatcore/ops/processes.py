"""Process supervision for the cluster's parts: a free loopback port, waiting until a process
answers its health URL (or explaining why it did not), and stopping exactly a process we started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from chatcore.ops.errors import LOG_TAIL_LINES, ClusterError, log_tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, alive: object = None) -> None:
    """Poll `url` until it answers 200, with a deadline; `alive()` False aborts early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(alive) and not alive():
            raise RuntimeError(f"the process behind {url} exited")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)  # polling a port that is not open yet
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def wait_started(what: str, url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """`wait_http` for a process we started; when it exits first, or never answers, a
    `ClusterError` with its exit code and the tail of `log`."""
    try:
        wait_http(url, timeout_s, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError):
        code = proc.poll()
        how = f"exited with code {code}" if code is not None else f"did not answer {url} within {timeout_s:.0f} s"
        raise ClusterError(f"{what} {how}; the last {LOG_TAIL_LINES} lines of {log}:\n{log_tail(log)}") from None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def stop_pid(pid: int, sig: int = signal.SIGTERM, timeout_s: float = 30.0, expect: str = "") -> bool:
    """Signal one process we started (checked against its command line), wait, then SIGKILL."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    if expect and expect not in cmdline:
        return False  # the pid was reused by something else
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)  # waiting for the process to exit, with a deadline
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True
