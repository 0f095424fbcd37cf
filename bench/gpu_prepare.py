"""`make gpu-prepare`: stage what a lent GPU machine needs for `make gpu-check`, into .gpu/ (git-ignored).

    .gpu/whl/     cp312 manylinux wheels, at requirements.lock's versions, of the packages the engine path
                  imports that the machine's image lacks (its torch, triton and transformers are used as they are)
    .gpu/model/   the default model's config and tokenizer files (its weights do not travel: the check makes
                  random weights of the same shapes there)
    .gpu/commit   the commit staged (the machine gets the working tree without .git)

Run here, where the network and the converted default model are; pass `.gpu` to the device tool's `carry`.
Wheels already in .gpu/whl at the locked version are kept, so a second run needs no network.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from chatcore.bench.gpu_model import copy_model_files
from chatcore.environment import LOCK_NAME, Pin, read_lock

ROOT = Path(__file__).resolve().parent.parent
# What the engine path (chatcore.config, the engine, the models, xgrammar for response formats) imports
# beyond the image's packages. typing-extensions is there, but pydantic needs a newer one than torch brought.
CARRIED = ("pydantic", "pydantic-core", "pydantic-settings", "annotated-types", "typing-inspection",
           "python-dotenv", "typing-extensions", "xgrammar", "apache-tvm-ffi", "msgspec")
PYTHON_VERSION = "3.12"
# pip matches manylinux tags exactly: every glibc level a wheel of these packages was seen built for.
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)))
MAX_STAGED_MIB = 48  # the device tool carries 64 MiB with the working tree


def carried_pins(lock: Path) -> list[Pin]:
    pins = {pin.name: pin for pin in read_lock(lock)}
    missing = [name for name in CARRIED if name not in pins]
    if missing:
        raise SystemExit(f"gpu-prepare: {LOCK_NAME} does not pin {', '.join(missing)}")
    return [pins[name] for name in CARRIED]


def _wheel_name(pin: Pin) -> str:
    return pin.name.replace("-", "_") + "-"


def _wheels_of(folder: Path, pin: Pin) -> list[Path]:
    return [w for w in folder.glob("*.whl") if w.name.lower().startswith(_wheel_name(pin))]


def stage_wheels(folder: Path, pins: list[Pin]) -> list[str]:
    """One wheel per pin in `folder`: another version of a package is removed (two stop the install)."""
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    for pin in pins:
        have = _wheels_of(folder, pin)
        if any(f"-{pin.version}-" in w.name for w in have):
            continue
        for stale in have:
            stale.unlink()
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", str(folder),
                        f"{pin.name}=={pin.version}"], check=True)
    return sorted(w.name for w in folder.glob("*.whl"))


def stage_commit(path: Path) -> str:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    path.write_text(head + ("-dirty" if dirty else "") + "\n")
    return path.read_text().strip()


def default_model_source() -> Path:
    from chatcore.config import Settings
    from chatcore.models.fetch import fetch_default_model

    return fetch_default_model(Settings().cache_dir)[0]


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--no-wheels", action="store_true", help="stage the model files and commit only")
    args = parser.parse_args(argv)
    out: Path = args.out
    model = copy_model_files(default_model_source(), out / "model")
    wheels = [] if args.no_wheels else stage_wheels(out / "whl", carried_pins(ROOT / LOCK_NAME))
    staged = stage_commit(out / "commit")
    total = size_mib(out)
    print(f"gpu-prepare: {out}: {len(wheels)} wheels, model files {', '.join(model)}, commit {staged}; "
          f"{total:.1f} MiB")
    if total > MAX_STAGED_MIB:
        print(f"gpu-prepare: more than {MAX_STAGED_MIB} MiB staged: the working tree and .gpu must stay under "
              "the device tool's 64 MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
