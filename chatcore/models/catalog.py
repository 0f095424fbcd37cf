"""What the cache folder holds: each model's name, architecture, parameters, weights kind and size on disk.

Parameters and dtypes come from the safetensors headers (8 bytes of length, then JSON naming every
tensor's dtype and shape), so listing reads no weights.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from chatcore.config import DEFAULT_MODEL
from chatcore.models.fetch import DEFAULT_MODEL_NAME, is_converted

MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    architecture: str
    parameters: int
    weights: str  # the weight files' format and dtypes, e.g. "safetensors F32"
    size_bytes: int
    default: bool


def models_dir(cache_dir: Path) -> Path:
    return cache_dir / "models"


def cached_models(cache_dir: Path, model_setting: str) -> list[CachedModel]:
    """The complete model folders under `<cache_dir>/models`, by name; `default` marks the one `model` names."""
    folder = models_dir(cache_dir)
    if not folder.is_dir():
        return []
    chosen = _chosen(cache_dir, model_setting)
    found = []
    for path in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not (path / "config.json").is_file():
            continue
        if path.name == DEFAULT_MODEL_NAME and not is_converted(path):
            continue  # a conversion that did not finish
        parameters, dtypes = _safetensors(path)
        found.append(CachedModel(path.name, path, _architecture(path), parameters,
                                 f"safetensors {'/'.join(sorted(dtypes))}" if dtypes else _other_weights(path),
                                 sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                                 chosen is not None and path.resolve() == chosen))
    return found


def _chosen(cache_dir: Path, model_setting: str) -> Path | None:
    if model_setting == DEFAULT_MODEL:
        return (models_dir(cache_dir) / DEFAULT_MODEL_NAME).resolve()
    path = Path(model_setting).expanduser()
    return path.resolve() if path.exists() else None


def _architecture(path: Path) -> str:
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError:
        return "?"
    architectures = config.get("architectures") or []
    return str(architectures[0]) if architectures else str(config.get("model_type", "?"))


def _safetensors(path: Path) -> tuple[int, set[str]]:
    parameters, dtypes = 0, set()
    for weights in sorted(path.glob("*.safetensors")):
        with weights.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > MAX_HEADER_BYTES:
                continue
            header = json.loads(fh.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                parameters += math.prod(tensor["shape"])
                dtypes.add(tensor["dtype"])
    return parameters, dtypes


def _other_weights(path: Path) -> str:
    return "pytorch .bin" if any(path.glob("*.bin")) else "none"


def human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    exponent = min(3, int(math.log(size, 1024)))
    return f"{size / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def human_count(count: int) -> str:
    for divisor, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= divisor:
            return f"{count / divisor:.1f}{suffix}"
    return str(count)
