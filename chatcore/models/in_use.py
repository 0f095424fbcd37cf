"""Which models in the cache folder a running process uses: a shared lock each user holds for its life.

A process that loads a model from `<cache_dir>/models/NAME` holds a shared `flock` on
`<cache_dir>/models/.in-use-NAME.lock` until it exits (the kernel drops it then, crashes included);
`chatcore model rm NAME` takes the exclusive lock without waiting, so it refuses a model a server,
`generate` or a benchmark is using, and a process starting meanwhile waits for the removal to finish.
Lock files are never deleted (another process could lock a file just unlinked).
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

_held: list[IO[str]] = []  # open for the process's life: closing one would drop its lock


def lock_file(folder: Path) -> Path:
    return folder.parent / f".in-use-{folder.name}.lock"


def hold(folder: Path, cache_dir: Path) -> None:
    """Hold `folder` in use for this process's life, if it is a model of the cache folder `cache_dir`."""
    if folder.resolve().parent != (cache_dir / "models").resolve():
        return
    handle = open(lock_file(folder.resolve()), "a")  # noqa: SIM115 - kept open on purpose
    fcntl.flock(handle, fcntl.LOCK_SH)
    _held.append(handle)


class InUse(Exception):
    """The model is loaded by a running process."""


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """Hold `folder` against every user while the block runs; `InUse` if a process uses it now."""
    with open(lock_file(folder), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InUse(folder.name) from None
        yield
