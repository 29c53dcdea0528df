"""Worker settings: CLI flags > `MLXQ_*` environment > TOML file (`--config`) > defaults."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from client.keys import BATCH_LANE, DEFAULT_PREFIX, DEFAULT_QUEUE
from client.protocol import Task
from client.which_redis import EMBEDDED_PORT
from common.settings_layers import LayeredSettings, check_redis_url, load_layered
from common.settings_layers import SettingsError as SettingsError  # where the worker command and tests look

ENV_PREFIX = "MLXQ_"
# MLXQ_* variables that are not worker settings: the crash tests' faults, the gateway's, the BLAS re-exec's.
OTHER_VARIABLES = ("MLXQ_TEST_", "MLXQ_GATEWAY_", "MLXQ_BLAS", "MLXQ_HOSTED_")
HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)?")


class ModelEntry(BaseModel):
    """One `[[models]]` table: its name (its queue), where it loads from, and any worker
    setting of its own."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", description="the model's name: its queue is mlxq:q:<name>")
    path: str = Field(min_length=1, description="a local directory or a Hugging Face id")
    pin: bool = Field(False, description="loaded at start and never unloaded")
    memory_gb: float | None = Field(None, gt=0, description="what it holds loaded, if the estimate is wrong: "
                                    "weights x 1.2 plus its prefix cache budget")

    def overrides(self) -> dict[str, Any]:
        """Its worker settings (everything in its table but the keys above)."""
        return dict(self.model_extra or {})


class AdapterEntry(BaseModel):
    """One `[[adapters]]` table (or `--adapter NAME=PATH`): a LoRA adapter of the model,
    served under its name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$", description="what requests call it (`adapter`)")
    path: str = Field(min_length=1, description="its directory, as mlx_lm.lora writes it")


class ModelsConfigError(ValueError):
    """A `[[models]]` list that cannot be served; the message is one line naming the model."""


def check_names(entries: list[ModelEntry]) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise ModelsConfigError(f"models: the name {entry.name!r} is given twice (each name is a queue)")
        seen.add(entry.name)



class WorkerSettings(LayeredSettings):
    """Everything a worker can be told. Field descriptions are the CLI help and the README table."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    redis_url: str | None = Field(None, description="Redis URL; unset starts or reuses the embedded Valkey")
    embedded_port: int = Field(EMBEDDED_PORT, description="port of the embedded Valkey when redis_url is unset")
    embedded_dir: Path | None = Field(None, description="data directory of the embedded Valkey (AOF on)")
    queue: str = Field(DEFAULT_QUEUE, pattern=r"^[A-Za-z0-9_.\-]+$", description="queue name: reads mlxq:q:<queue>")
    lanes: list[str] = Field(default_factory=list, description="priority lanes, read before the queue itself "
                             "and in this order: mlxq:q:<queue>:<lane>")
    prefix: str = Field(DEFAULT_PREFIX, description="key prefix")
    consumer: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:\-]{1,128}$", description="consumer name in the "
                                 "group, refused while a live worker holds it; unset: <host>-<worker_index>")
    worker_index: int | None = Field(None, ge=0, description="names the worker <host>-<index>; unset: the lowest "
                                     "index no live worker on this host holds")
    model: str | None = Field(None, description="local path or Hugging Face id; unset uses the demo model")
    task: Literal["auto"] | Task = Field(
        "auto", description="what the model's queue serves: generation, embeddings or rerank scores; auto: "
        "embed for a sentence-transformers model (modules.json), rerank for a sequence classifier, else "
        "generate (a generative reranker such as Qwen3-Reranker needs rerank)")
    matryoshka_dimensions: list[int] | None = Field(
        None, description="sizes an embedding model's vectors may be cut to with a request's dimensions (0: any "
        "size up to its own), for a model trained for it whose config does not say so (Qwen3-Embedding); unset: "
        "its config's is_matryoshka or matryoshka_dimensions, else none")
    max_num_seqs: int = Field(16, ge=1, description="requests running at once")
    prefill_batch_size: int = Field(8, ge=1, description="prompts prefilled together")
    completion_batch_size: int = Field(32, ge=1, description="sequences decoded together")
    prefill_step_size: int = Field(512, ge=1, description="prompt tokens per prefill chunk; running streams "
                                   "get a token between chunks")
    max_step_tokens: int = Field(256, ge=1, description="tokens one engine step may process while streams run, "
                                 "prompts and running streams together (vLLM's max_num_batched_tokens): new "
                                 "prompts are prefilled in chunks that fit beside the running streams, so their "
                                 "pace holds")
    max_kv_size: int | None = Field(None, ge=16, description="most tokens each sequence's KV cache keeps (a "
                                    "rotating window: older tokens drop out, so a generation may run longer than "
                                    "memory would allow, attending only to the last max_kv_size tokens); text "
                                    "models only; unset: the whole sequence")
    kv_bits: Literal[4, 8] | None = Field(None, description="store each sequence's keys and values quantized "
                                          "to this many bits (mx.quantize, groups of kv_group_size along each "
                                          "head): about 1/2 (8) or 1/4 (4) of the KV memory per sequence, at "
                                          "some cost per step; served through mlx-vlm's batch, text models "
                                          "too; unset: the model's dtype")
    kv_group_size: Literal[32, 64, 128] = Field(64, description="values sharing one scale and bias in the "
                                                "quantized KV cache; must divide the model's head dimension")
    quantized_kv_start: int = Field(0, ge=0, description="with kv_bits: the running batch keeps keys and values "
                                    "in the model's dtype until its longest sequence holds this many positions, "
                                    "then all its rows (and rows joining it) are quantized; short conversations "
                                    "keep full precision; 0: quantized from the first token")
    prompt_lookup_max: int = Field(0, ge=0, le=32, description="speculative decoding by prompt lookup (vLLM's "
                                   "ngram): a greedy request's draft is what followed the last earlier match of "
                                   "its last n tokens (n up to this) in its prompt and output, verified in the "
                                   "running batch, so its output is unchanged; text models on mlx-lm's batch; "
                                   "0: off")
    draft_model: str | None = Field(None, description="speculative decoding by a draft model (a local path or a "
                                    "Hugging Face id, with the model's tokenizer): it drafts for the greedy rows, "
                                    "the model verifies them in the running batch, so their output is unchanged; "
                                    "text models on mlx-lm's batch; unset: off")
    adapters: list[AdapterEntry] = Field(default_factory=list, description="LoRA adapters of the model, served "
                                         "in the same batch as its own requests (NAME=PATH, or [[adapters]] "
                                         "tables with name and path); more can be loaded at runtime (mlxq adapters)")
    max_loras: int = Field(8, ge=0, description="distinct adapters one running batch may mix (a request whose "
                           "adapter finds no free slot waits); 0: no adapters")
    max_lora_rank: int = Field(64, ge=1, description="the largest adapter rank served")
    max_loaded_adapters: int = Field(32, ge=1, description="adapters kept read in memory, the least recently "
                                     "used read again from disk when next asked for")
    distributed: Literal["tensor", "pipeline"] | None = Field(
        None, description="a worker group: the model sharded over the processes mlx.launch starts (each runs "
        "`mlxq worker` with the same settings; rank 0 is the only Redis client): tensor or pipeline parallel, as "
        "mlx-lm shards the model's family; unset: one process")
    group_port: int = Field(47150, ge=1, le=65535, description="in a worker group, the port rank 0's engine "
                            "process listens on for the other ranks (each step's plan, and their watchdog)")
    group_stall_s: float = Field(30.0, gt=0, description="in a worker group, how long a rank waits for another "
                                 "before the group stops (collectives never time out): joining, a step, a "
                                 "silent rank 0")
    num_draft_tokens: int = Field(4, ge=1, le=16, description="most draft tokens a sequence proposes per step")
    cache_memory_mb: int | None = Field(None, ge=0, description="prefix cache budget in MB (0: off); "
                                        "unset: cache_memory_percent of RAM")
    cache_memory_percent: float = Field(10.0, ge=0, le=90, description="prefix cache budget, % of RAM")
    cache_max_entries: int = Field(256, ge=0, description="most prompt caches kept")
    prefix_placement: bool = Field(True, description="placement by prefix: publish what the prefix cache holds, "
                                   "and move a request read from the queue to a live worker whose cache holds more "
                                   "of its prompt, unless it holds a whole batch more (its placement lane); false: "
                                   "serve what is read (this worker's lane is still read, and others' still taken "
                                   "after affinity_wait_ms)")
    affinity_wait_ms: int = Field(1000, ge=0, description="how long a request placed on a worker may wait for it "
                                  "before any worker with a free slot takes it (at once when that worker is gone or "
                                  "draining)")
    ssd_cache_dir: Path | None = Field(None, description="the prefix cache's SSD tier: every block it stores is "
                                       "also written here (off the engine thread) and read back on a hit, across "
                                       "restarts; files are keyed by the model's weights; each worker on a host "
                                       "uses a slot of its own (slot-N); served through mlx-vlm's batch, text "
                                       "models too; unset: off")
    ssd_cache_max_gb: float = Field(10.0, gt=0, description="most GB one worker's SSD tier keeps; the oldest "
                                    "files are evicted past it")
    priority_aging_s: float = Field(10.0, gt=0, description="waiting this long counts as one priority level "
                                    "better, so low priorities are not starved")
    stream_interval: int = Field(1, ge=1, description="tokens per delta unless the request says")
    flush_interval_ms: float = Field(10.0, ge=0, le=1000, description="while streams run, how long new tokens may wait "
                                     "to go out together: each write then carries several steps' tokens, one "
                                     "delta per request (a small model's steps are shorter than a write); first "
                                     "deltas and ends go out at once; 0: every step")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_body_bytes: int = Field(8_388_608, ge=1, description="largest request body (json or msgpack field), "
                                "images included")
    max_prompt_tokens: int | None = Field(None, ge=1, description="longest prompt in tokens; unset: the context")
    max_stop_strings: int = Field(16, ge=0, description="most stop strings a request may give")
    max_stop_length: int = Field(256, ge=1, description="longest stop string, in characters")
    max_metadata_bytes: int = Field(16_384, ge=0, description="largest metadata, encoded")
    max_nesting_depth: int = Field(32, ge=2, le=1000, description="deepest nesting of maps and lists in a body "
                                   "(metadata included)")
    max_images: int = Field(4, ge=0, description="most images in one request (vision models)")
    max_image_pixels: int = Field(16_777_216, ge=1, description="largest image, width x height as sent "
                                  "(the model's processor resizes it after)")
    max_videos: int = Field(1, ge=0, description="most videos in one request (models that take video)")
    default_video_fps: float = Field(2.0, gt=0, le=60, description="frames sampled per second of video when a "
                                     "request does not say (video_fps)")
    max_video_frames: int = Field(128, ge=1, description="most frames sampled from one request's videos; a "
                                  "request's max_video_frames may ask for fewer")
    max_video_seconds: float = Field(3600.0, gt=0, description="longest video, by its container's frame count "
                                     "and rate, checked before decoding")
    max_audios: int = Field(1, ge=0, description="most audio clips in one request (models that take audio)")
    max_audio_seconds: float = Field(600.0, gt=0, description="longest audio clip, by its header, checked "
                                     "before decoding")
    media_decode_timeout_s: float = Field(60.0, gt=0, description="how long the decoder of one request's video "
                                          "or audio may run, in a decoder process, before it is killed")
    media_decode_memory_mb: int = Field(4096, ge=1024, description="address space of each decoder process "
                                        "(its decoders take about 600 MB of it)")
    vision_cache_mb: int = Field(256, ge=0, description="vision-embedding cache budget in MB (0: off)")
    result_ttl_s: int = Field(3600, ge=1, description="output streams expire this long after their last write")
    dedupe_ttl_s: int = Field(86400, ge=1, description="how long a finished id is remembered and not recomputed")
    prefetch: int = Field(2, ge=0, description="entries read beyond free room, to hide Redis latency "
                          "(a prefill group while the queue has a backlog; 0: never)")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long running requests may finish")
    block_ms: int = Field(1000, ge=1, le=4000, description="XREADGROUP block; below the 10 s socket timeout")
    heartbeat_s: float = Field(5.0, gt=0, description="how often the heartbeat and the leases on running "
                               "requests are renewed; silent for 3x this, a worker's requests are taken over")
    timeline_s: float = Field(10.0, ge=0.1, description="how often this worker adds what it served to the fleet's "
                              "timeline (mlxq:timeline, the last hour: the dashboard's charts)")
    reclaim_interval_s: float = Field(2.0, gt=0, description="how often to look for requests of workers that died")
    max_deliveries: int = Field(5, ge=1, description="deliveries after which an entry is dead-lettered (poisoned)")
    max_crashes: int = Field(2, ge=1, description="workers that may die while preparing one request (decoding, "
                             "validating, tokenizing), and engine processes while they hold it, before it is "
                             "dead-lettered (poisoned)")
    engine_stall_s: float = Field(120.0, gt=0, description="an engine process that takes no step for this long "
                                  "while it has work is killed, and its requests count a crash")
    dead_letter_maxlen: int = Field(1000, ge=1, description="the dead-letter stream is trimmed to about this many "
                                    "entries")
    max_queue_len: int = Field(10_000, ge=0, description="most requests waiting in each stream of the queue: "
                               "producers are refused with QueueFull above it (0: no bound); the last worker "
                               "to start publishes it in mlxq:limits:<queue>")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics and /healthz "
                                     "on this port (unset: off)")
    metrics_host: str = Field("127.0.0.1", description="address the metrics port listens on (0.0.0.0: every "
                              "interface)")
    log_format: Literal["console", "json"] = Field("console", description="log lines for people or for machines")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="least severe level logged")
    models: list[ModelEntry] = Field(default_factory=list, description="several models, each on its own queue "
                                     "([[models]] tables: name, path, pin, memory_gb and any setting of its "
                                     "own), each run in a worker process of its own, loaded when requests wait "
                                     "and unloaded when idle or to make room; unset: the one `model`")
    memory_budget_gb: float | None = Field(None, gt=0, description="what the models loaded at once may hold "
                                           "(weights, KV, caches); unset: memory_budget_percent of RAM")
    memory_budget_percent: float = Field(75.0, gt=0, le=100, description="the models' budget, % of RAM, when "
                                         "memory_budget_gb is unset")
    idle_unload_s: float = Field(600.0, gt=0, description="a model (not pinned) with nothing running or "
                                 "waiting for this long is unloaded")
    scale_up_after_s: float = Field(30.0, gt=0, description="a model whose queue's oldest unread request has "
                                    "waited this long is loaded here too, beside the workers serving it, if it "
                                    "fits (an extra copy, the first unloaded when room is needed)")

    _redis_url = field_validator("redis_url")(check_redis_url)

    @field_validator("model", "draft_model")
    @classmethod
    def _model_exists(cls, model: str | None) -> str | None:
        """A path that does not exist is refused here, rather than looked up on Hugging Face."""
        if model is None or model.startswith("sim:") or Path(model).expanduser().exists():
            return model
        if model.startswith(("/", ".", "~")) or not HF_ID.fullmatch(model):
            raise ValueError(f"{model} does not exist; give a model directory or a Hugging Face id such as "
                             "mlx-community/Qwen3-0.6B-8bit")
        return model

    @model_validator(mode="after")
    def _models_or_model(self) -> WorkerSettings:
        if self.models and self.model is not None:
            raise ValueError("model and [[models]]: give one model, or a list of them")
        check_names(self.models)
        return self

    @model_validator(mode="after")
    def _one_speculative_method(self) -> WorkerSettings:
        if self.prompt_lookup_max and self.draft_model is not None:
            raise ValueError("prompt_lookup_max and draft_model: choose one way to draft (one of them unset)")
        return self

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapters_from_flags(cls, given: Any) -> Any:
        """`NAME=PATH` strings (the flag, the environment) as tables."""
        if not isinstance(given, list):
            return given
        tables = []
        for item in given:
            if isinstance(item, str):
                name, equals, path = item.partition("=")
                if not equals:
                    raise ValueError(f"{item!r}: give an adapter as NAME=PATH")
                item = {"name": name, "path": path}
            tables.append(item)
        return tables

    @model_validator(mode="after")
    def _adapter_names_once(self) -> WorkerSettings:
        names = [adapter.name for adapter in self.adapters]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"adapters: {', '.join(twice)} given twice")
        return self

    @model_validator(mode="after")
    def _group_on_the_plain_batch(self) -> WorkerSettings:
        if self.distributed is None:
            return self
        refused = [name for name, given in (("prompt_lookup_max", self.prompt_lookup_max),
                                            ("draft_model", self.draft_model), ("kv_bits", self.kv_bits),
                                            ("ssd_cache_dir", self.ssd_cache_dir), ("adapters", self.adapters),
                                            ("max_kv_size", self.max_kv_size), ("models", self.models)) if given]
        if refused:
            raise ValueError(f"distributed with {', '.join(refused)}: a worker group runs mlx-lm's plain batch of "
                             "one model (no speculation, quantized or rotating KV, disk tier, adapters or "
                             "several models yet); unset one of them")
        return self

    @model_validator(mode="after")
    def _adapters_on_the_plain_batch(self) -> WorkerSettings:
        if self.adapters and (self.prompt_lookup_max or self.draft_model or self.kv_bits):
            given = "speculative decoding" if self.prompt_lookup_max or self.draft_model else "kv_bits"
            raise ValueError(f"adapters and {given}: adapters are batched on mlx-lm's plain batch, not with {given} "
                             "yet; unset one of them")
        if self.adapters and not self.max_loras:
            raise ValueError("adapters with max_loras 0: allow at least one adapter in the batch")
        return self

    @model_validator(mode="after")
    def _start_needs_bits(self) -> WorkerSettings:
        if self.quantized_kv_start and self.kv_bits is None:
            raise ValueError("quantized_kv_start is where KV quantization starts: set kv_bits (4 or 8) too, or "
                             "unset quantized_kv_start")
        return self

    @field_validator("matryoshka_dimensions")
    @classmethod
    def _sizes_positive(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or any(size < 0 for size in sizes) or (0 in sizes and len(sizes) > 1)):
            raise ValueError("sizes of 1 or more, or 0 alone for any size")
        return sizes

    @field_validator("lanes")
    @classmethod
    def _lane_names(cls, lanes: list[str]) -> list[str]:
        for lane in lanes:
            if not re.fullmatch(r"[A-Za-z0-9_.\-]+", lane) or lane in ("dead", BATCH_LANE):
                raise ValueError(f"lane {lane!r}: use A-Za-z0-9_.- (and not 'dead', the dead-letter stream, nor "
                                 f"'{BATCH_LANE}', the batch lane every worker reads last)")
        return lanes

    def memory_budget_bytes(self) -> int:
        """What the models loaded at once may hold."""
        if self.memory_budget_gb is not None:
            return int(self.memory_budget_gb * 1024 ** 3)
        return int(_ram_bytes() * self.memory_budget_percent / 100)

    def cache_budget_bytes(self) -> int:
        """The prefix cache's byte budget."""
        if self.cache_memory_mb is not None:
            return self.cache_memory_mb * 1024 * 1024
        return int(_ram_bytes() * self.cache_memory_percent / 100)


def _ram_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_settings(config_file: Path | None = None, **overrides: Any) -> WorkerSettings:
    """Settings from `overrides` (CLI flags), the environment, then `config_file` (TOML).
    Raises `SettingsError` for a file that cannot be read or an unknown setting (file key
    or `MLXQ_*` variable), and pydantic's `ValidationError` for a bad value."""
    return load_layered(WorkerSettings, config_file, OTHER_VARIABLES, "worker setting", **overrides)


@dataclass(frozen=True)
class Hosting:
    """What a worker of several models tells a model's worker process it starts, beside
    its settings (none of the user's): the host's pid (the child drains and exits once that
    process is gone), and a refusal (answer every request with it, error model_unavailable,
    loading nothing: the queue of a model that failed to load)."""

    host_pid: int | None = None
    refusal: str | None = None

    @classmethod
    def from_environment(cls) -> Hosting:
        pid = os.environ.get("MLXQ_HOSTED_BY_PID", "")
        return cls(int(pid) if pid.isdigit() else None, os.environ.get("MLXQ_HOSTED_REFUSAL") or None)

    def to_environment(self) -> dict[str, str]:
        return {**({"MLXQ_HOSTED_BY_PID": str(self.host_pid)} if self.host_pid else {}),
                **({"MLXQ_HOSTED_REFUSAL": self.refusal} if self.refusal else {})}
