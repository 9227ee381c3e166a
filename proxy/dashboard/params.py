"""Query parameters the dashboard's endpoints share: moments (ISO 8601; a time without a zone is UTC) and
the sessions table's opaque page cursor (the last listed session's creation time and id)."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime

from proxy.errors import OpenAIError
from storage.dashboard.sessions import PagePosition


def aware(moment: datetime | None, param: str = "time") -> datetime | None:
    """`moment` in UTC; one without a zone is taken as UTC. A 400 naming `param` for a moment that has
    no UTC equivalent (the first or last hours of year 1 or 9999 in a far zone)."""
    if moment is None:
        return None
    try:
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except OverflowError as exc:
        raise OpenAIError(400, f"{param} is out of range.", "invalid_request_error", param=param) from exc


def text_param(value: str | None, param: str) -> str | None:
    """A text filter as given; a 400 naming `param` for one with a NUL (no database stores it)."""
    if value is not None and "\x00" in value:
        raise OpenAIError(400, f"{param} may not contain a NUL character.", "invalid_request_error",
                          param=param)
    return value


def encode_cursor(position: PagePosition | None) -> str | None:
    if position is None:
        return None
    text = json.dumps([position.created_at.isoformat(), position.id], separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> PagePosition | None:
    """The position a cursor names; a 400 naming `cursor` when it is not one this API wrote."""
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, session_id = json.loads(raw)
        moment = datetime.fromisoformat(created_at)
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
        if not isinstance(session_id, str) or "\x00" in session_id:
            raise ValueError("not a cursor")
    except (ValueError, TypeError, OverflowError, binascii.Error, UnicodeDecodeError) as exc:
        raise OpenAIError(400, "Invalid cursor: pass back a `next_cursor` this API returned.",
                          "invalid_request_error", param="cursor", code="invalid_cursor") from exc
    return PagePosition(created_at=moment, id=session_id)
