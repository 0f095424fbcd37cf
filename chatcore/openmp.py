"""One OpenMP team in a serving process: the engine thread's.

torch's CPU wheels run their parallel ops on GNU OpenMP (libgomp), and every thread that enters a
parallel region keeps a team of worker threads for the next one. Once libgomp's threads outnumber
the CPUs, it stops spin-waiting in every team, and each parallel region then wakes its workers
through the kernel. With the model loaded on the main thread, the same engine steps run on another
thread then take far longer, using one CPU instead of two (docs/measurements.md, "One OpenMP team").
That was every step of `chatcore serve`, whose engine has its own thread.

So a thread that ran parallel ops and will not compute again hands its team back
(`release_team`: the model's loader and the engine's builder do), and threads that touch tensors
beside the engine run their ops on one thread (`single_threaded`: the disk tier's workers, and the
server's event loop after the load). Where torch does not run on libgomp, both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp that torch loaded, or None (another OpenMP runtime, or none)."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}
    if len(paths) != 1:
        return None
    library = ctypes.CDLL(paths.pop())
    return library if hasattr(library, "omp_pause_resource_all") else None


def release_team() -> None:
    """End the calling thread's OpenMP workers; its next parallel op starts a new team."""
    library = _libgomp()
    if library is not None:
        library.omp_pause_resource_all(OMP_PAUSE_SOFT)


def single_threaded() -> None:
    """Run the calling thread's torch ops on itself alone, from now on; other threads keep theirs.

    `torch.set_num_threads` would change every thread's count: this sets only the calling
    thread's OpenMP count, after torch has set it up for this thread (which it does once)."""
    library = _libgomp()
    if library is not None:
        torch.get_num_threads()
        release_team()
        library.omp_set_num_threads(1)
