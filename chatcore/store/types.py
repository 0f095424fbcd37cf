"""Column types that behave the same on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    """The current time as an aware UTC datetime: the only kind the store accepts."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every backend.

    Binding a naive datetime raises `ValueError`: the store never guesses a zone.
    Aware values are converted to UTC. SQLite keeps no zone, so the value is stored
    as naive UTC there and marked UTC again when read; PostgreSQL stores
    `timestamp with time zone` and returns it converted to UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: the store accepts aware datetimes only")
        value = value.astimezone(UTC)
        return value if dialect.name != "sqlite" else value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
