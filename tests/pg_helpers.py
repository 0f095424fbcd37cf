"""A throw-away PostgreSQL cluster for the tests: started on first use, once per test process.

It runs Debian's binaries (`chatcore.ops.postgres.pg_bin_dir`: PATH, else /usr/lib/postgresql/<v>/bin)
in a temporary directory, on a free loopback port, with durability off, and is stopped and
removed when pytest exits. Each caller gets its own fresh database, whose URL carries the
cluster's generated password (`Postgres.url`).
"""

from __future__ import annotations

import itertools
import shutil

import pytest

from chatcore.ops.postgres import Postgres, pg_bin_dir, throwaway_postgres

_cluster: Postgres | None = None
_names = itertools.count()


def postgres_available() -> bool:
    return pg_bin_dir() is not None


def postgres_cluster(config: pytest.Config) -> Postgres:
    """The process-wide cluster; the first call starts it and registers its removal."""
    global _cluster
    if _cluster is None:
        cluster = throwaway_postgres()

        def remove() -> None:
            global _cluster
            cluster.stop()
            shutil.rmtree(cluster.root, ignore_errors=True)
            _cluster = None

        config.add_cleanup(remove)
        _cluster = cluster
    return _cluster


def fresh_database_url(config: pytest.Config, prefix: str = "test") -> str:
    """The URL of a new, empty database in the shared cluster."""
    return postgres_cluster(config).create_database(f"{prefix}_{next(_names)}")
