"""A Hugging Face hub id as the model (`CHATCORE_MODEL=org/name`), resolved to a snapshot folder.

The local Hugging Face cache (`HF_HUB_CACHE`, or `HF_HOME`/hub) is looked in first, without any
network. Only when the id is not there, and `HF_HUB_OFFLINE` is not set, is the snapshot
downloaded into that cache (its config, tokenizer and safetensors files). A failure is one line
(`ModelNotFound`) naming the id and the cache folder looked in.
"""

from __future__ import annotations

import re
from pathlib import Path

from chatcore.models.errors import ModelNotFound

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def is_hub_id(name: str) -> bool:
    return HUB_ID.fullmatch(name) is not None


def resolve_hub_id(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache, downloaded there if absent and online."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    try:
        return _model_folder(repo_id, Path(snapshot_download(repo_id, local_files_only=True)), where)
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(f"model {repo_id}: not in {where}, and HF_HUB_OFFLINE is set")
    try:
        folder = snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as exc:  # no network, an unknown or gated repo: all one line
        raise ModelNotFound(f"model {repo_id}: not in {where}, and downloading it failed "
                            f"({type(exc).__name__})") from exc
    return _model_folder(repo_id, Path(folder), where)


def _model_folder(repo_id: str, folder: Path, where: str) -> Path:
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"model {repo_id}: its snapshot in {where} has no config.json")
    return folder
