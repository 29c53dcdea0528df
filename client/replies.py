"""Normalise redis-py's stream replies, whose shape depends on the RESP version.

RESP2 answers XREAD/XREADGROUP with `[[key, [(id, fields), ...]], ...]`; RESP3 with
`{key: [[(id, fields), ...]]}`. Everything that reads a stream goes through here.
"""

from __future__ import annotations

from typing import Any

StreamEntry = tuple[str, dict[bytes, bytes] | None]


def as_text(value: bytes | str) -> str:
    """A reply value as text (replies are bytes unless the client decodes them)."""
    return value.decode() if isinstance(value, bytes) else value


def stream_entries(reply: Any) -> list[StreamEntry]:
    """The entries of an XREAD / XREADGROUP reply over one or more streams, in order."""
    return [(entry_id, fields) for _, entry_id, fields in keyed_stream_entries(reply)]


def keyed_stream_entries(reply: Any) -> list[tuple[str, str, dict[bytes, bytes] | None]]:
    """The entries of an XREAD / XREADGROUP reply, each with the key of its stream."""
    if not reply:
        return []
    groups = reply.items() if isinstance(reply, dict) else reply
    entries: list[tuple[str, str, dict[bytes, bytes] | None]] = []
    for key, items in groups:
        if items and isinstance(items[0], list):  # RESP3 wraps the entries once more
            items = items[0]
        entries.extend((as_text(key), as_text(entry_id), fields) for entry_id, fields in items)
    return entries
