"""`mlxq dead`'s text: a queue's dead letters as lines (client/dead_letters.py reads,
requeues and purges them)."""

from __future__ import annotations

import json
import time

from client.dead_letters import DeadLetter


def render_list(letters: list[DeadLetter]) -> str:
    """One line per dead letter."""
    if not letters:
        return "(no dead letters)"
    lines = []
    for letter in letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(letter.died_at))
        lines.append(f"{letter.entry_id}  {when}  {letter.request_id or '(no id)'}  {letter.text('reason')[:100]}")
    return "\n".join(lines)


def render_one(letter: DeadLetter) -> str:
    """Every field; a JSON body pretty-printed, a binary one by its size."""
    lines = [f"dead letter {letter.entry_id}"]
    for name, value in letter.fields.items():
        if name == "field:json":
            try:
                shown = json.dumps(json.loads(value), ensure_ascii=False, indent=2)
            except ValueError:
                shown = value.decode(errors="replace")
        elif name == "field:msgpack":
            shown = f"<{len(value)} bytes of msgpack>"
        else:
            shown = value.decode(errors="replace")
        lines.append(f"{name}: {shown}")
    return "\n".join(lines)
