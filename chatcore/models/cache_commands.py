"""`chatcore model list | rm | pull`: the cache folder's models, printed, removed and added."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from chatcore.models.catalog import cached_models, human_bytes, human_count, models_dir
from chatcore.models.errors import ModelUnavailable
from chatcore.models.fetch import conversion_lock, is_model_name
from chatcore.models.in_use import InUse, exclusive
from chatcore.models.pull import pull

COLUMNS = ("NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "SIZE", "DEFAULT")


def list_command(cache_dir: Path, model_setting: str) -> int:
    models = cached_models(cache_dir, model_setting)
    if not models:
        print(f"no models in {models_dir(cache_dir)} (`chatcore model fetch` installs the default one)")
        return 0
    rows = [COLUMNS] + [(m.name, m.architecture, human_count(m.parameters), m.weights, human_bytes(m.size_bytes),
                         "*" if m.default else "") for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def rm_command(cache_dir: Path, name: str) -> int:
    folder = models_dir(cache_dir) / name
    if not is_model_name(name) or not folder.is_dir():
        known = ", ".join(m.name for m in cached_models(cache_dir, "")) or "none"
        print(f"chatcore: no model {name!r} in {models_dir(cache_dir)} (there: {known})", file=sys.stderr)
        return 2
    if folder.is_symlink():  # rm removes what pull wrote, never what a link points to
        print(f"chatcore: {folder} is a symbolic link, not a folder the cache wrote; remove the link itself",
              file=sys.stderr)
        return 2
    try:
        with conversion_lock(folder.parent), exclusive(folder):
            shutil.rmtree(folder)
    except InUse:
        print(f"chatcore: model {name} is in use by a running process (a server, generate or bench); "
              "stop it first", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"chatcore: cannot remove {folder}: {exc.strerror or type(exc).__name__}", file=sys.stderr)
        return 2
    print(f"removed {folder}")
    return 0


def pull_command(cache_dir: Path, source: str) -> int:
    try:
        path, made = pull(cache_dir, source)
    except ModelUnavailable as exc:
        print(f"chatcore: {exc}", file=sys.stderr)
        return 2
    print(f"{'pulled' if made else 'already in the cache:'} {path} (serve it with --model {path})")
    return 0
