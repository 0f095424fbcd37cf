"""`chatcore model pull`: a model into the cache folder, from the Hugging Face hub, a local folder or a GGUF file.

Each lands in `<cache_dir>/models/NAME` through `fetch.provision` (a staging folder renamed into
place under the cache's lock), so a failed or interrupted pull leaves nothing half written: a hub
id `ORG/NAME` as `ORG--NAME`, a folder under its own name, a `.gguf` file converted to safetensors
under its stem. A name that is no model name (`fetch.is_model_name`: `.`, `..`, empty, hidden, a
separator), or a link where the folder would go, is refused before anything is written or removed. A
GGUF file is read and its header checked (`gguf_check`) before it is converted.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from chatcore.models.catalog import models_dir
from chatcore.models.errors import ModelNotFound
from chatcore.models.fetch import convert_gguf, is_model_name, provision
from chatcore.models.gguf_check import check_declared, read_gguf
from chatcore.models.hub import DOWNLOAD_PATTERNS, is_hub_id


def pull(cache_dir: Path, source: str) -> tuple[Path, bool]:
    """The model's folder in the cache, and whether this call put it there; `ModelNotFound` in one line."""
    local = Path(source).expanduser()
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise ModelNotFound(f"{local}: a file to pull must be a .gguf file")
        return _provision(cache_dir, local.stem, lambda staging: _convert(local.resolve(), staging))
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFound(f"{local}: not a Hugging Face model folder (no config.json)")
        return _provision(cache_dir, local.resolve().name, lambda staging: _copy(local, staging))
    if "/" in source and is_hub_id(source):
        return _provision(cache_dir, source.replace("/", "--"), lambda staging: _download(source, staging))
    raise ModelNotFound(f"{source}: neither a local folder, a .gguf file nor a hub id (ORG/NAME)")


def _provision(cache_dir: Path, name: str, write: Callable[[Path], None]) -> tuple[Path, bool]:
    if not is_model_name(name):
        raise ModelNotFound(f"{name!r} cannot name a model folder (empty, '.' or '..', a leading dot or a path "
                            "separator); rename the source")
    target = models_dir(cache_dir) / name
    if target.is_symlink():
        raise ModelNotFound(f"{target} is a symbolic link; pull writes only folders of its own (remove the link)")
    return target, provision(target, write)


def _convert(gguf: Path, staging: Path) -> None:
    """The GGUF file checked (`gguf_check`: one line for a malformed or lying one), then converted; a
    failure of the conversion itself is one line too."""
    check_declared(read_gguf(gguf), gguf)
    try:
        convert_gguf(gguf, staging)
    except Exception as exc:  # transformers' GGUF loader fails in many ways on a file it cannot take
        why = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise ModelNotFound(f"{gguf}: transformers cannot convert this GGUF file ({type(exc).__name__}: {why})") \
            from None


def _copy(folder: Path, staging: Path) -> None:
    shutil.copytree(folder, staging, dirs_exist_ok=True)


def _download(repo_id: str, staging: Path) -> None:
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(f"cannot fetch {repo_id} from the Hugging Face hub: offline (HF_HUB_OFFLINE is set)")
    try:
        snapshot_download(repo_id, local_dir=staging, allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as exc:  # no network, an unknown or gated repo: all one line
        raise ModelNotFound(f"cannot fetch {repo_id} from the Hugging Face hub ({type(exc).__name__}): offline, "
                            "or no such (public) model") from None
    if not (staging / "config.json").is_file():
        raise ModelNotFound(f"{repo_id} on the Hugging Face hub has no config.json: not a model chatcore can load")
    shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's download bookkeeping
