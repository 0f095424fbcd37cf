"""Secrets the store hands out once and keeps only as sha256 hex digests."""

from __future__ import annotations

import hashlib
import hmac
import secrets

API_KEY_PREFIX = "cc_"


def digest(secret: str) -> str:
    """The sha256 hex digest stored in place of `secret`."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_digest: str) -> bool:
    """Whether `secret` hashes to `stored_digest`, compared in constant time."""
    return hmac.compare_digest(digest(secret), stored_digest)


def new_api_key() -> str:
    """`cc_` followed by 256 random bits, url-safe."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def new_resume_token() -> str:
    """256 random bits, url-safe."""
    return secrets.token_urlsafe(32)


def new_session_id() -> str:
    """128 random bits as 22 url-safe characters."""
    return secrets.token_urlsafe(16)
