"""Where the files that are not Python live: the browser UI (`web/`), the Alembic scripts
(`migrations/`) and the nginx template (`deploy/nginx.conf`).

They stay at the repository's root, where a checkout (and an editable install) finds them next to
`chatcore/`. A wheel cannot install files outside its packages where code finds them again, so
setup.py's build step copies them into the package, under `chatcore/_data/`, keeping their
relative paths. The installed copy wins; the checkout is the fallback (an editable install has
no `_data`).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent / "_data"
CHECKOUT = Path(__file__).resolve().parents[1]


def resource(relative: str) -> Path:
    """The path of `relative` (e.g. "web"), inside the installed package if shipped there, else in the checkout."""
    installed = PACKAGE_DATA / relative
    return installed if installed.exists() else CHECKOUT / relative


WEB_DIR = resource("web")
MIGRATIONS_DIR = resource("migrations")
NGINX_TEMPLATE = resource("deploy/nginx.conf")
