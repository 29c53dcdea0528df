"""Settings in layers, for the worker and the gateway alike: CLI flags > environment
variables under a prefix > a TOML file > defaults. A setting nobody knows (a file key, or
a variable under the prefix) is an error with a suggestion, never silently nothing.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import tomllib
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from client.diagnose import redis_url_problem

S = TypeVar("S", bound="LayeredSettings")


class SettingsError(ValueError):
    """A settings file or variable that cannot be used; the message names it and what to do."""


class LayeredSettings(BaseSettings):
    """Base of a settings model read from flags, the environment and a TOML file, in that order."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)


def load_layered(kind: type[S], config_file: Path | None, others: tuple[str, ...] = (), what: str = "setting",
                 **overrides: Any) -> S:
    """`kind` from `overrides` (None: not given), the environment, then `config_file`.
    Raises `SettingsError` for a file that cannot be read or an unknown setting (a file
    key, or a variable under the prefix that does not start with one of `others`), and
    pydantic's `ValidationError` for a bad value."""
    prefix = kind.model_config.get("env_prefix", "")
    if config_file is not None:
        _check_file(kind, Path(config_file))
    _check_environment(kind, os.environ, prefix, others, what)

    class FromFile(kind):  # type: ignore[valid-type, misc]
        model_config = SettingsConfigDict(toml_file=config_file)

    settings: S = FromFile(**{k: v for k, v in overrides.items() if v is not None})
    return settings


def check_redis_url(url: str | None) -> str | None:
    """A settings validator: the URL, or ValueError saying what is wrong with it."""
    problem = None if url is None else redis_url_problem(url)
    if problem:
        raise ValueError(problem)
    return url


def _check_file(kind: type[BaseSettings], path: Path) -> None:
    try:
        table = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file not found: {path}") from None
    except OSError as e:
        raise SettingsError(f"config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {path}: TOML syntax error: {e}") from e
    for key in table:
        if key not in kind.model_fields:
            raise SettingsError(f"config file {path}: unknown setting {key!r}{_suggest(kind, key)}")


def _check_environment(kind: type[BaseSettings], environ: Mapping[str, str], prefix: str, others: tuple[str, ...],
                       what: str) -> None:
    """Variables under the prefix must name settings: a misspelt one would silently do nothing."""
    for variable in environ:
        name = variable.removeprefix(prefix).lower()
        if variable.startswith(prefix) and name not in kind.model_fields and not variable.startswith(others):
            raise SettingsError(f"environment variable {variable} is not a {what}{_suggest(kind, name, prefix)}; "
                                "unset it")


def _suggest(kind: type[BaseSettings], name: str, prefix: str = "") -> str:
    close = difflib.get_close_matches(name.lower(), list(kind.model_fields), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0].upper() if prefix else close[0]}?)" if close else ""
