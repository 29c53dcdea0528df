"""Worker settings: CLI flags > MLXQ_* environment > TOML file > defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from support import ROOT

from worker.settings import SettingsError, WorkerSettings, load_settings


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


def test_bad_settings_are_refused(tmp_path, monkeypatch):
    """Unknown keys (in the file or the environment), TOML syntax errors and out-of-range
    values are errors that name the file or variable and the closest known setting."""
    config = tmp_path / "bad.toml"
    config.write_text("max_num_seq = 3\n")
    with pytest.raises(SettingsError, match=rf"^config file {config}: unknown setting 'max_num_seq' "
                                            r"\(did you mean max_num_seqs\?\)$"):
        load_settings(config)
    config.write_text('queue = "unterminated\n')
    with pytest.raises(SettingsError, match=rf"^config file {config}: TOML syntax error: .*line 1"):
        load_settings(config)
    with pytest.raises(ValidationError, match="max_num_seqs"):
        load_settings(max_num_seqs=0)
    with pytest.raises(SettingsError, match="config file not found"):
        load_settings(tmp_path / "missing.toml")
    monkeypatch.setenv("MLXQ_MAX_NUM_SEQ", "3")
    with pytest.raises(SettingsError, match=r"^environment variable MLXQ_MAX_NUM_SEQ is not a worker setting "
                                            r"\(did you mean MLXQ_MAX_NUM_SEQS\?\); unset it$"):
        load_settings()


def test_a_model_path_that_does_not_exist_is_refused(tmp_path):
    """A path is checked at once, not looked up on Hugging Face; an id is left to the loader."""
    with pytest.raises(ValidationError, match=f"{tmp_path}/nope does not exist; give a model directory"):
        load_settings(model=str(tmp_path / "nope"))
    assert load_settings(model="mlx-community/Qwen3-0.6B-8bit").model == "mlx-community/Qwen3-0.6B-8bit"
    assert load_settings(model=str(tmp_path)).model == str(tmp_path)


@pytest.mark.parametrize("url", ["localhost:6379", "127.0.0.1", "http://host:6379"])
def test_a_redis_url_without_a_redis_scheme_is_refused(url):
    with pytest.raises(ValidationError, match=r"is not a Redis URL: write redis://"):
        load_settings(redis_url=url)


@pytest.mark.parametrize("name", ["worker.toml", "mac-qwen3.toml", "mac-several-models.toml"])
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


def test_a_password_in_a_redis_url_is_never_printed():
    from client.diagnose import redacted
    from mlxq.errors import unreachable

    assert redacted("redis://mlxq-worker:s3cret@10.0.0.1:6379/0") == "redis://mlxq-worker:***@10.0.0.1:6379/0"
    assert redacted("rediss://:s3cret@cache.internal?ssl_ca_certs=/ca.pem") == \
        "rediss://:***@cache.internal?ssl_ca_certs=/ca.pem"
    assert redacted("redis://127.0.0.1:6390") == "redis://127.0.0.1:6390"
    assert "s3cret" not in unreachable("redis://u:s3cret@h:1", ConnectionRefusedError(), False)
