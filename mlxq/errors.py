"""Failures of a command, said in one line: what went wrong and what to do."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from client.diagnose import describe, redacted

EX_TEMPFAIL = 75  # sysexits.h: try again later (a full queue)


class CommandError(Exception):
    """Ends a command with its message on stderr and `status`."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def unreachable(url: str, error: BaseException, embedded_default: bool) -> str:
    """Why Redis at `url` did not answer, and what to try."""
    reason, url = describe(error), redacted(url)
    if embedded_default and "refused" in reason:
        return (f"cannot reach Redis at {url}: nothing serves it; start a worker (`{on_path('mlxq')} worker`, "
                f"which starts the embedded Valkey) or `{on_path('mlxq')} redis`, or give --redis-url "
                "(MLXQ_REDIS_URL)")
    return f"cannot reach Redis at {url}: {reason}; check --redis-url (MLXQ_REDIS_URL)"


def on_path(command: str) -> str:
    """`command` as a user can type it: bare if the shell finds this very one, else its path
    (`.venv/bin/mlxq` when started by `make run`)."""
    here = Path(sys.executable).parent / command
    found = shutil.which(command)
    if not here.exists() or (found and Path(found).resolve() == here.resolve()):
        return command
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)
