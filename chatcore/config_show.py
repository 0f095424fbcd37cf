"""`chatcore config show`: every effective setting and where it came from, secrets redacted.

The output is TOML (a value, then its source as a comment), so it can seed a `chatcore.toml`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from chatcore.config import Config

REDACTED = "[redacted]"
KEY_LIKE = re.compile(r"(?:^|_)(?:key|secret|password|token|credentials?)$")


def redact(name: str, value: Any) -> Any:
    """`value` safe to print: key-like fields hidden whole, passwords in URLs masked."""
    if value is None:
        return None
    if KEY_LIKE.search(name):
        return REDACTED
    if isinstance(value, str) and "://" in value:
        from sqlalchemy.exc import ArgumentError

        from chatcore.store.commands import masked_url

        try:
            return masked_url(value)
        except ArgumentError:  # not a URL SQLAlchemy reads: hide it rather than guess where a password is
            return REDACTED
    return value


def render(config: Config) -> str:
    where = f"file {config.file}" if config.file else "no config file"
    lines = [f"# chatcore settings, highest first: flag, env, file, default ({where})"]
    for name, value in config.settings.model_dump().items():
        source = config.sources[name]
        origin = f"env CHATCORE_{name.upper()}" if source == "env" else source
        shown = redact(name, value)
        if shown is None:
            lines.append(f"# {name} is unset  # {origin}")
        else:
            lines.append(f"{name} = {json.dumps(str(shown) if isinstance(shown, Path) else shown)}  # {origin}")
    return "\n".join(lines)
