"""Files that chatcore writes or reads while it may run as root: never through a link that
someone else planted (the cluster's state file holds the database password; PostgreSQL's
password file is given to its OS user)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from chatcore.ops.errors import ClusterError


def write_private(path: Path, text: str, owner: tuple[int, int] | None = None) -> None:
    """Replace `path` with a new file holding `text`, readable by its owner only (0600), given to
    `owner` (uid, gid) when one is named.

    The file is created under a fresh name in `path`'s folder (mkstemp: O_CREAT|O_EXCL|O_NOFOLLOW,
    mode 0600, whatever the umask), given away with `fchown` on its descriptor, and renamed over
    `path`: a symbolic or hard link planted at `path` is replaced, never followed or written through."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            if owner is not None:
                os.fchown(out.fileno(), *owner)
            out.write(text)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def read_no_link(path: Path) -> str:
    """`path`'s text, refusing a symbolic link in its place (O_NOFOLLOW): run as root, chatcore must
    not read a file someone else pointed it at. FileNotFoundError when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ClusterError(f"{path} is a symbolic link, which chatcore does not follow: someone else may have "
                               f"made it; remove it and run again") from None
        raise
    with os.fdopen(fd) as src:
        return src.read()
