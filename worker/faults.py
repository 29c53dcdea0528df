"""Fault injection for the crash tests; does nothing unless `MLXQ_TEST_EXIT_ON` is set.

A request whose prompt contains that marker makes the worker process exit on the spot,
as an out-of-memory kill would: no `except`, no `finally`, nothing written.
"""

from __future__ import annotations

import os

EXIT_STATUS = 70


def exit_if_marked(prompt: str | None) -> None:
    """Exit the process at once if the prompt carries the crash marker."""
    marker = os.environ.get("MLXQ_TEST_EXIT_ON")
    if marker and prompt and marker in prompt:
        os._exit(EXIT_STATUS)
