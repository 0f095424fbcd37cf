"""How big each KV tier is: `auto` budgets from the machine, and what a budget holds.

* The device pool (`kv_cache_gb=auto`): on the CPU, `CPU_RAM_SHARE` of the memory available
  when the server starts (MemAvailable: free plus reclaimable page cache); on CUDA,
  `gpu_memory_fraction` of the GPU memory free once the model is loaded (the rest is left to
  the step's activations and the allocator).
* The disk tier (`kv_disk_gb=auto`): `DISK_SHARE` of the free space on the filesystem that
  holds `kv_disk_dir`, at least `DISK_FLOOR_BYTES` (never more than half the free space) and
  at most `DISK_CAP_BYTES`.
A number in either setting is used as is; `kv_disk_gb=0` turns the disk tier off.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

CPU_RAM_SHARE = 0.25
DISK_SHARE = 0.20
DISK_FLOOR_BYTES = 1 << 30
DISK_CAP_BYTES = 64 << 30
SESSION_SIZES = (1024, 4096)


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo, or the physical memory where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_pool_bytes(kv_cache_gb: float | str, device: torch.device, gpu_memory_fraction: float) -> int:
    if kv_cache_gb != "auto":
        return int(float(kv_cache_gb) * (1 << 30))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(gpu_memory_fraction * free)
    return int(CPU_RAM_SHARE * available_ram_bytes())


def disk_budget_bytes(kv_disk_gb: float | str, kv_disk_dir: Path) -> int:
    if kv_disk_gb != "auto":
        return int(float(kv_disk_gb) * (1 << 30))
    existing = kv_disk_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    share = max(DISK_SHARE * free, min(DISK_FLOOR_BYTES, free / 2))
    return int(min(share, DISK_CAP_BYTES))


def holds(budget_bytes: int, bytes_per_token: int) -> dict[str, Any]:
    """What a tier of `budget_bytes` holds: tokens, and whole sessions of 1k and 4k tokens."""
    tokens = budget_bytes // bytes_per_token if bytes_per_token else 0
    return {"bytes": budget_bytes, "tokens": tokens,
            **{f"sessions_{size // 1024}k": tokens // size for size in SESSION_SIZES}}


def describe(name: str, tier: dict[str, Any]) -> str:
    """One phrase for the startup log line."""
    return (f"{name} {tier['bytes'] / (1 << 30):.2f} GiB = {tier['tokens']:,} tokens "
            f"({tier['sessions_1k']:,} sessions of 1k, {tier['sessions_4k']:,} of 4k)")
