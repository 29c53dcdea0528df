"""Fault injection for the crash tests; does nothing unless its variables are set.

Read once, at start (`Faults.from_environment`), never on a request's path:
`MLXQ_TEST_EXIT_ON=<text>`: a request whose prompt contains the text makes the process
exit on the spot while it is prepared, as an out-of-memory kill would: no `except`, no
`finally`. `MLXQ_TEST_FATAL_ON_TOKEN=<id>`: a request whose prompt holds that token id
breaks the engine thread itself (not one step), which is fatal for its engine process.
`MLXQ_TEST_HANG_ON_TOKEN=<id>`: a request whose prompt holds that token id stops the
engine thread for good as it is admitted, as a hung Metal command buffer would.
`MLXQ_TEST_SLOW_ON_TOKEN=<id>`: while a request whose prompt starts with that token id
is in the batch, every step takes at least `SLOW_STEP_S`, so that request cannot reach
its length on any machine within a test's time; commands (a cancel) still apply at once.
`MLXQ_TEST_EXIT_DECODING_ON_TOKEN=<id>`: a request whose prompt holds that token id makes
the engine process exit on the spot (as a Metal abort would) in a decode step: once it has
made two tokens in that process and every row of the batch is past its prefill.
`MLXQ_TEST_ALWAYS_SPECULATE=1`: speculative decoding's gate always speculates, so that a
test of what speculation does never depends on which way this machine's timing favours.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

EXIT_STATUS = 70
SLOW_STEP_S = 0.25  # x the demo model's 2,048-token context: minutes for a held request


class InjectedFault(RuntimeError):
    """The engine failure `MLXQ_TEST_FATAL_ON_TOKEN` asks for."""


@dataclass(frozen=True)
class Faults:
    """The faults to inject; none by default."""

    exit_on: str | None = None
    fatal_token: int | None = None
    slow_token: int | None = None
    always_speculate: bool = False
    hang_token: int | None = None
    exit_decoding_token: int | None = None

    @classmethod
    def from_environment(cls) -> Faults:
        fatal, slow, hang, decoding = (os.environ.get(f"MLXQ_TEST_{name}_ON_TOKEN")
                                       for name in ("FATAL", "SLOW", "HANG", "EXIT_DECODING"))
        return cls(os.environ.get("MLXQ_TEST_EXIT_ON") or None, int(fatal) if fatal else None,
                   int(slow) if slow else None, os.environ.get("MLXQ_TEST_ALWAYS_SPECULATE") == "1",
                   int(hang) if hang else None, int(decoding) if decoding else None)

    @property
    def in_steps(self) -> bool:
        """Whether a fault is checked before each step (the loop checks none otherwise)."""
        return self.slow_token is not None or self.exit_decoding_token is not None

    def exit_if_marked(self, prompt: str | None) -> None:
        """Exit the process at once if the prompt carries the crash marker."""
        if self.exit_on and prompt and self.exit_on in prompt:
            os._exit(EXIT_STATUS)

    def fail_if_marked(self, prompt_tokens: list[int]) -> None:
        """Raise `InjectedFault` if the prompt holds the fatal marker token; never return
        if it holds the hang marker."""
        if self.fatal_token is not None and self.fatal_token in prompt_tokens:
            raise InjectedFault(f"injected engine failure (token {self.fatal_token})")
        if self.hang_token is not None and self.hang_token in prompt_tokens:
            threading.Event().wait()  # never set: this thread takes no step again

    def exit_if_decoding(self, rows: list[tuple[list[int], int | None]]) -> None:
        """Exit the process at once if a marked request has made two tokens while every
        row decodes. `rows`: each row's prompt and the tokens it made here (None: in its prefill)."""
        made = [tokens for prompt, tokens in rows if self.exit_decoding_token in prompt]
        if made and max(t or 0 for t in made) >= 2 and all(tokens is not None for _, tokens in rows):
            os._exit(EXIT_STATUS)

    def slows(self, prompt_tokens: list[int]) -> bool:
        """Whether a request with this prompt makes every step slow (`MLXQ_TEST_SLOW_ON_TOKEN`)."""
        return self.slow_token is not None and prompt_tokens[:1] == [self.slow_token]


NONE = Faults()
