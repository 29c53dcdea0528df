"""Worker settings: CLI flags > MLXQ_* environment > TOML file > defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from support import ROOT

from worker.settings import WorkerSettings, load_settings


def test_defaults():
    """With nothing configured: embedded Redis, demo model, queue `default`."""
    settings = load_settings()
    assert settings.redis_url is None and settings.model is None and settings.queue == "default"
    assert settings.consumer is None and settings.worker_index is None  # the worker picks a free <host>-<n>


def test_precedence(tmp_path, monkeypatch):
    """A flag beats the environment, which beats the file, which beats the default."""
    config = tmp_path / "worker.toml"
    config.write_text('queue = "from-file"\nmax_num_seqs = 3\nprefetch = 5\nstream_interval = 2\n')
    monkeypatch.setenv("MLXQ_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("MLXQ_PREFETCH", "6")
    settings = load_settings(config, prefetch=9)
    assert settings.queue == "from-file"
    assert settings.max_num_seqs == 7
    assert settings.prefetch == 9
    assert settings.stream_interval == 2
    assert settings.default_max_tokens == WorkerSettings.model_fields["default_max_tokens"].default


def test_bad_settings_are_refused(tmp_path):
    """Unknown keys and out-of-range values in a config file are errors, not ignored."""
    config = tmp_path / "bad.toml"
    config.write_text("max_num_seq = 3\n")
    with pytest.raises(ValidationError, match="max_num_seq"):
        load_settings(config)
    with pytest.raises(ValidationError, match="max_num_seqs"):
        load_settings(max_num_seqs=0)
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")


@pytest.mark.parametrize("name", ["worker.toml", "mac-qwen3.toml"])
def test_shipped_configs_load(name):
    """The example configs in config/ are valid."""
    settings = load_settings(ROOT / "config" / name)
    assert settings.max_num_seqs >= 1


def test_every_setting_is_documented():
    """The README's settings table and config/worker.toml name every setting."""
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "config" / "worker.toml").read_text()
    for name in WorkerSettings.model_fields:
        assert f"| `{name}` |" in readme, name
        assert name in example, name
