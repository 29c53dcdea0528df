"""Failures of a command, said in one line: what went wrong and what to do."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from client.diagnose import describe, redacted

EX_TEMPFAIL = 75  # sysexits.h: try again later (a full queue)


S = TypeVar("S")


class CommandError(Exception):
    """Ends a command with its message on stderr and `status`."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def settings_for_command(load: Callable[[], S]) -> S:
    """Settings for a command (`load()`): what is wrong with them ends as one line (status 2)."""
    from pydantic import ValidationError

    from client.protocol import describe_validation_error
    from common.settings_layers import SettingsError

    try:
        return load()
    except SettingsError as e:
        raise CommandError(str(e), status=2) from e
    except ValidationError as e:
        raise CommandError(f"invalid settings: {describe_validation_error(e)}", status=2) from e


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
