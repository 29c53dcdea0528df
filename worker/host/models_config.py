"""`[[models]]` in a worker's TOML: the models one worker serves, each on its own queue,
and the settings each model's own worker process runs with (DESIGN.md, "Several models
on one worker")."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import ValidationError

from worker.settings import ModelEntry, ModelsConfigError, WorkerSettings

# Settings of the host alone: a model's worker process is not given them.
HOST_ONLY = frozenset({"models", "memory_budget_gb", "memory_budget_percent", "idle_unload_s", "scale_up_after_s",
                       "worker_index", "embedded_port", "embedded_dir", "metrics_port"})
# Settings of the worker as a whole, which a model's table cannot set.
WHOLE_WORKER = HOST_ONLY | {"model", "queue", "consumer", "redis_url", "prefix"}
WEIGHTS_HEADROOM = 1.2  # activations and a running batch's KV beside the weights, in the estimate


def child_settings(host: WorkerSettings, entry: ModelEntry, consumer: str) -> WorkerSettings:
    """The settings of `entry`'s own worker process: the host's, its table's, its name and path."""
    for key in entry.overrides():
        if key in WHOLE_WORKER or key not in WorkerSettings.model_fields:
            why = "is the whole worker's, not one model's" if key in WHOLE_WORKER else "is not a worker setting"
            raise ModelsConfigError(f"models: {entry.name}: {key!r} {why}")
    shared = {k: v for k, v in host.model_dump().items() if k not in WHOLE_WORKER}
    try:
        return WorkerSettings(**{**shared, **entry.overrides(), "model": entry.path, "queue": entry.name,
                                 "consumer": consumer, "prefix": host.prefix})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ModelsConfigError(f"models: {entry.name}: {where}: {first['msg']}") from None


def footprint_bytes(entry: ModelEntry, settings: WorkerSettings) -> int:
    """What the model holds loaded, estimated: `memory_gb` where given, else its weights'
    bytes with headroom plus its prefix cache budget."""
    if entry.memory_gb is not None:
        return int(entry.memory_gb * 1024 ** 3)
    return int(weights_bytes(entry.path) * WEIGHTS_HEADROOM) + settings.cache_budget_bytes()


def weights_bytes(path: str) -> int:
    """The bytes of a model's safetensors: on disk for a directory, else from Hugging Face's listing."""
    local = Path(path).expanduser()
    if local.is_dir():
        return sum(f.stat().st_size for f in local.rglob("*.safetensors") if f.parent == local)
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(path, files_metadata=True)
        return sum(s.size or 0 for s in info.siblings or [] if s.rfilename.endswith(".safetensors"))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo: one message for all
        raise ModelsConfigError(f"models: {path}: its size is unknown ({type(e).__name__}); give memory_gb in its "
                                "table") from None


def host_name(settings: WorkerSettings) -> str:
    """The name the worker's model processes are named after: `consumer`, else the host's name."""
    return settings.consumer or socket.gethostname().split(".")[0]
