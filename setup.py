"""The one build step pyproject.toml cannot declare: ship the repository's root folders that the
code reads at run time inside the `chatcore` package (chatcore/resources.py finds them there).

`web/` and `migrations/` stay at the repository's root, so a wheel carries a copy of each under
`chatcore/_data/`; an editable install keeps reading them from the checkout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("web", "migrations", "deploy/nginx.conf")  # relative to the root; MANIFEST.in lists them for sdists
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        root = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "chatcore" / "_data"
        for relative in SHIPPED:
            source, dest = root / relative, target / relative
            dest.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, dest, ignore=IGNORED, dirs_exist_ok=True)
            else:
                shutil.copy2(source, dest)


setup(cmdclass={"build_py": BuildPyWithData})
