"""Fault injection for the crash tests; does nothing unless its variables are set.

`MLXQ_TEST_EXIT_ON=<text>`: a request whose prompt contains the text makes the process
exit on the spot, as an out-of-memory kill would: no `except`, no `finally`.
`MLXQ_TEST_FATAL_ON_TOKEN=<id>`: a request whose prompt holds that token id breaks the
engine thread itself (not one step), which is fatal for the worker.
"""

from __future__ import annotations

import os

EXIT_STATUS = 70


def exit_if_marked(prompt: str | None) -> None:
    """Exit the process at once if the prompt carries the crash marker."""
    marker = os.environ.get("MLXQ_TEST_EXIT_ON")
    if marker and prompt and marker in prompt:
        os._exit(EXIT_STATUS)


class InjectedFault(RuntimeError):
    """The engine failure `MLXQ_TEST_FATAL_ON_TOKEN` asks for."""


def fail_if_marked(prompt_tokens: list[int]) -> None:
    """Raise `InjectedFault` if the prompt holds the fatal marker token."""
    token = os.environ.get("MLXQ_TEST_FATAL_ON_TOKEN")
    if token and int(token) in prompt_tokens:
        raise InjectedFault(f"injected engine failure (token {token})")
