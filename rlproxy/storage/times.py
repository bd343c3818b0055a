"""Times read back from the store: SQLite hands timezone-aware columns back naive (and a view's or
an aggregate's as text); rlproxy writes UTC only."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, TypeVar

_Time = TypeVar("_Time", datetime, datetime | None)


def aware(t: _Time) -> _Time:
    """`t` with UTC as its zone when it has none."""
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


def iso(v: Any, text: bool = False) -> Any:
    """A time as ISO 8601 in UTC, anything else as it is; with `text`, also a time SQLite hands
    back as text (a view's or an aggregate's column)."""
    if text and isinstance(v, str) and len(v) >= 19 and v[4] == "-" and v[10] in " T":
        try:
            v = datetime.fromisoformat(v)
        except ValueError:
            return v
    return aware(v).astimezone(UTC).isoformat() if isinstance(v, datetime) else v
