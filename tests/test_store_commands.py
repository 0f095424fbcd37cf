"""`chatcore migrate` and `chatcore keys create`, run as real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from chatcore.store.commands import masked_url
from chatcore.store.db import create_engine, create_sessionmaker
from chatcore.store.repos import ApiKeyRepo
from tests.pg_helpers import fresh_database_url, postgres_available
from tests.test_store_support import sqlite_url


def _chatcore(data_dir: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CHATCORE_DATABASE_URL"}
    env["CHATCORE_DATA_DIR"] = str(data_dir)
    result = subprocess.run([sys.executable, "-m", "chatcore.cli", *args], env=env, capture_output=True, text=True)
    assert result.returncode == expect, result.stderr
    return result


def test_migrate_creates_the_database(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    result = _chatcore(data_dir, "migrate")
    assert (data_dir / "chatcore.db").is_file()
    lines = result.stdout.splitlines()
    assert str(data_dir / "chatcore.db") in lines[0] and "upgrading from an empty database to " in lines[0]
    head = lines[0].rsplit(" ", 1)[1]
    assert lines[1].startswith("  0001: initial schema") and lines[-2].startswith(f"  {head}: ")
    assert lines[-1].endswith(f"is at the newest schema ({head})")
    again = _chatcore(data_dir, "migrate")  # idempotent
    assert again.stdout.strip().endswith(f"({head}); nothing to do")


async def test_keys_create_prints_a_working_key_once(tmp_path: Path) -> None:
    result = _chatcore(tmp_path, "keys", "create", "--tenant", "t", "--admin")
    key = result.stdout.strip()
    assert result.stdout == key + "\n" and key.startswith("cc_")
    assert "only once" in result.stderr

    engine = create_engine(sqlite_url(tmp_path))
    try:
        async with create_sessionmaker(engine)() as db:
            found = await ApiKeyRepo(db).authenticate(key)
    finally:
        await engine.dispose()
    assert found is not None and found[0].name == "t" and found[1] is True


# URLs the review printed with a secret in clear; each secret is spelt `s3cret...`.
HOSTILE_URLS = {
    "postgresql+asyncpg://chat:s3cret@db.example/chatcore": "postgresql+asyncpg://chat:***@db.example/chatcore",
    "postgresql+asyncpg://chat@db.example/chatcore?password=s3cretQ&ssl=require":
        "postgresql+asyncpg://chat@db.example/chatcore?password=***&ssl=require",
    "postgresql://chat@db.example/chatcore?sslmode=verify-full&sslpassword=s3cretS&client_secret=s3cretC":
        "postgresql://chat@db.example/chatcore?client_secret=***&sslmode=verify-full&sslpassword=***",
    "postgresql+asyncpg://chat:p@s3cret@w0rdC@db.example/chatcore": "postgresql+asyncpg://***@db.example/chatcore",
    "postgresql+asyncpg://chat:s3/cret@w@db.example/chatcore": "postgresql+asyncpg://***@db.example/chatcore",
    "postgresql+asyncpg://chat:s3?cret@w@db.example/chatcore": "postgresql+asyncpg://***",
    "postgresql://chat:pw@h/d?password=s3cret1&password=s3cret2": "postgresql://chat:***@h/d?password=***",
}

LEAKED = re.compile(r"s3|w0rd|(?<!se)cret")  # any piece of a secret above (`client_secret` is a name)


@pytest.mark.parametrize("url", list(HOSTILE_URLS))
def test_masked_url_hides_passwords(url: str) -> None:
    """A password, a query value named like a secret (`password`, `sslpassword`, `client_secret`),
    and a password with unescaped `@`, `/` or `?` in it, which splits the URL where no parser can tell."""
    masked = masked_url(url)
    assert not LEAKED.search(masked), masked
    assert masked == HOSTILE_URLS[url]


@pytest.mark.skipif(not postgres_available(), reason="needs PostgreSQL (make services)")
def test_migrate_prints_a_url_without_its_password_in_the_query(request: pytest.FixtureRequest) -> None:
    """`chatcore migrate` on PostgreSQL with the password given as `?password=`: it connects, and
    none of the lines it prints holds the password."""
    url = make_url(fresh_database_url(request.config, "masked"))
    password = url.password
    assert password
    query_url = url.set(password=None).update_query_dict({"password": password}).render_as_string(hide_password=False)
    env = {**os.environ, "CHATCORE_DATABASE_URL": query_url}
    result = subprocess.run([sys.executable, "-m", "chatcore.cli", "migrate"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "?password=***" in result.stdout and "is at the newest schema" in result.stdout, result.stdout
    assert str(password) not in result.stdout + result.stderr


def test_keys_list_and_revoke(tmp_path: Path) -> None:
    alpha = _chatcore(tmp_path, "keys", "create", "--tenant", "alpha").stdout.strip()
    beta = _chatcore(tmp_path, "keys", "create", "--tenant", "beta", "--admin").stdout.strip()
    lines = _chatcore(tmp_path, "keys", "list").stdout.splitlines()
    assert len(lines) == 2 and all(line.endswith("active") for line in lines)
    assert "alpha" in lines[0] and "user" in lines[0] and "beta" in lines[1] and "admin" in lines[1]
    assert alpha not in "\n".join(lines) and beta not in "\n".join(lines)  # only prefixes: keys are not stored
    assert f"{alpha[:8]}..." in lines[0]
    alpha_id = lines[0].split()[0]
    _chatcore(tmp_path, "keys", "revoke", alpha_id)
    listed = _chatcore(tmp_path, "keys", "list", "--tenant", "alpha").stdout.splitlines()
    assert len(listed) == 1 and "revoked" in listed[0]
    refused = _chatcore(tmp_path, "keys", "revoke", alpha_id, expect=2)  # already revoked
    assert len(refused.stderr.strip().splitlines()) == 1 and "no active key" in refused.stderr
    _chatcore(tmp_path, "keys", "revoke", "no-such-id", expect=2)
