"""Gateway settings: CLI flags > `MLXQ_GATEWAY_*` environment > TOML file (`--config`) > defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from client.keys import DEFAULT_PREFIX
from client.which_redis import default_url
from common.settings_layers import LayeredSettings, check_redis_url, load_layered

ENV_PREFIX = "MLXQ_GATEWAY_"


class GatewaySettings(LayeredSettings):
    """Everything a gateway can be told. Field descriptions are the CLI help."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    redis_url: str = Field(default_factory=default_url,
                           description="Redis URL of the workers' queues (unset: $MLXQ_REDIS_URL, else the "
                           "embedded Valkey's at $MLXQ_EMBEDDED_PORT or 6390)")
    prefix: str = Field(DEFAULT_PREFIX, description="key prefix of the workers")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    api_keys: list[SecretStr] = Field(default_factory=list, description="admin keys accepted on /v1, beside "
                                      "the keys `mlxq keys create` stores in Redis (none of either: open to anyone "
                                      "who can connect). Give them in MLXQ_GATEWAY_API_KEYS or the TOML, not on "
                                      "the command line, where `ps` shows them")
    models: dict[str, str] = Field(default_factory=dict, description="model name -> queue (TOML table, or JSON "
                                   "in the variable); unset names: the models live workers serve, and queue names")
    request_timeout_s: float = Field(600.0, gt=0, description="longest a request may take, queue wait included; "
                                     "then it is cancelled and answered 504")
    keepalive_s: float = Field(10.0, gt=0, description="a stream whose request has no output yet starts after "
                                "this long and then gets an SSE comment every this long, so that proxies keep it "
                                "and a gone client is noticed")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1, description="largest HTTP request body (base64 images "
                                "included); larger ones are answered 413")
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1, description="largest file /v1/files takes (OpenAI's "
                                "batch limit: 200 MB); larger ones are answered 413")
    files_budget_bytes: int = Field(2 * 1024**3, ge=1, description="bytes one tenant's uploaded files and "
                                    "batch lines may hold in Redis together (a key's files_budget_bytes overrides "
                                    "it); an upload or batch past it is answered 413")
    max_batches: int = Field(100, ge=1, description="batches one tenant may have in progress at once (a key's "
                             "max_batches overrides it); one more is answered 429")
    file_ttl_s: int = Field(7 * 86400, ge=60, description="an uploaded file is deleted this long after upload")
    batch_lease_s: float = Field(10.0, gt=0, description="a batch whose driver (a gateway, `mlxq batch`) stops "
                                 "is taken over by another this long after")
    batch_window: int = Field(512, ge=1, description="a batch's lines in the queue or running at once, at most")
    response_ttl_s: int = Field(30 * 86400, ge=60, description="a stored response (/v1/responses with store, the "
                                "default) is deleted this long after it was made, as OpenAI keeps them 30 days")
    max_stored_responses: int = Field(10_000, ge=1, description="stored responses one tenant keeps; past it "
                                      "its oldest are deleted")
    log_format: Literal["console", "json"] = Field("console", description="log lines for people or for machines")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="least severe level logged")

    _redis_url = field_validator("redis_url")(check_redis_url)

    @field_validator("models")
    @classmethod
    def _queue_names(cls, models: dict[str, str]) -> dict[str, str]:
        for model, queue in models.items():
            if not queue or not all(c.isalnum() or c in "_.-" for c in queue):
                raise ValueError(f"model {model!r}: queue {queue!r} is not a queue name (A-Za-z0-9_.-)")
        return models


def load_gateway_settings(config_file: Path | None = None, **overrides: Any) -> GatewaySettings:
    """Settings from `overrides` (CLI flags), the environment, then `config_file` (TOML)."""
    return load_layered(GatewaySettings, config_file, (), "gateway setting", **overrides)
