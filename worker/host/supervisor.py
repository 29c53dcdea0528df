"""A worker of several models (`[[models]]`): each loaded model runs in a worker process
of its own, under one memory budget, started when requests wait on its queue and stopped
when idle or to make room.

    host ──Popen──> mlxq worker (model a, queue a)      each an ordinary worker: its
         ──Popen──> mlxq worker (model b, queue b)      engine, batch, heartbeat, drain
         ──SET NX──> mlxq:loading:<queue>               one loader per demand in the fleet
         ──SET───> mlxq:hosts:<name>                    every model and its state

A process per model, not one engine thread taking turns: an unloaded model's memory goes
back to the system when its process exits (MLX keeps freed buffers otherwise), one
model's crash stays its own, and models step at once where the machine allows (on a Mac
the GPU interleaves their command buffers). The host itself touches no MLX and holds no
request: unloading is a child's ordinary drain (stop reading, finish what runs, hand back
the rest), so nothing it held is lost.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from redis.exceptions import RedisError

from client.connect import connect
from client.diagnose import redacted
from client.fleet import WorkerView, read_stream, read_workers
from client.heartbeat import ModelLoad
from client.hosts import HostedModel, HostRecord
from client.keys import BATCH_LANE, Keys
from worker.host import metrics as host_metrics
from worker.host.models_config import HOST_ONLY, child_settings, footprint_bytes, host_name
from worker.host.placement import Decision, Demand, Look, Model, Policy, decide, gb
from worker.host.publishing import HostKey
from worker.queue.retrying import describe
from worker.settings import Hosting, ModelEntry, ModelsConfigError, WorkerSettings

log = structlog.get_logger("mlxq.host")

# How often the host looks at its models and their queues: each look reads the fleet's
# heartbeats, so a fleet of hosts looking four times a second would load Redis for nothing.
MAX_TICK_S = 1.0
MAX_FAILURES = 3  # loads in a row that fail before a model is reported failed and left alone


@dataclass
class ModelProcess:
    """One configured model and its process, if it has one."""

    entry: ModelEntry
    settings: WorkerSettings  # its worker's
    footprint: int  # bytes estimated (`footprint_bytes`)
    state: ModelLoad = "available"
    process: subprocess.Popen[bytes] | None = None
    last_used: float = 0.0  # monotonic: when it last had work
    failures: int = 0
    failed: str | None = None  # why it is not loaded, once it failed MAX_FAILURES times
    refusing: bool = False  # its process answers its requests with `failed` (the `unavailable` setting)
    metrics_port: int | None = None  # where its worker serves metrics, when the host serves them
    measured: int = 0  # the most its worker has reported holding (MLX active + cached), kept for its next load

    def counted(self) -> int:
        """The bytes it is counted for: the estimate, or what it was seen to hold if more."""
        return max(self.footprint, self.measured)

    @property
    def queue(self) -> str:
        return str(self.entry.name)

    @property
    def consumer(self) -> str:
        return str(self.settings.consumer)

    def holds_memory(self) -> bool:
        return self.process is not None and not self.refusing

    def view(self) -> Model:
        """What placement knows of it."""
        return Model(self.queue, self.counted(), self.entry.pin, self.state, self.last_used, self.holds_memory(),
                     self.refusing, self.failed)


class Host:
    """Keeps the right models loaded, one process each; `run` until SIGTERM or SIGINT."""

    def __init__(self, settings: WorkerSettings, redis_url: str) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.keys = Keys(settings.prefix)
        self.name = host_name(settings)
        self.budget = settings.memory_budget_bytes()
        self.models = [self._hosted(entry) for entry in settings.models]
        self._check_budget()
        self.redis = connect(redis_url, socket_timeout=10)
        self.host_key = HostKey(self.redis, self.keys, self.name, settings.heartbeat_s)
        self._configs = Path(tempfile.mkdtemp(prefix="mlxq-host-"))  # each model's worker's settings
        self._stopping = False
        self._looks = 0  # ticks done, in its key: a reader can wait for the host to have looked again
        self._tick_s = min(MAX_TICK_S, settings.heartbeat_s / 2)
        self.policy = Policy(self.name, self.budget, settings.idle_unload_s, settings.scale_up_after_s, self._tick_s)

    def _hosted(self, entry: ModelEntry) -> ModelProcess:
        child = child_settings(self.settings, entry, f"{self.name}.{entry.name}")
        return ModelProcess(entry, child, footprint_bytes(entry, child))

    def _check_budget(self) -> None:
        for model in self.models:
            if model.footprint > self.budget:
                raise ModelsConfigError(f"models: {model.queue} needs {gb(model.footprint)} GB, more than "
                                        f"memory_budget_gb {gb(self.budget)}")
        pinned = sum(m.footprint for m in self.models if m.entry.pin)
        if pinned > self.budget:
            raise ModelsConfigError(f"models: the pinned models need {gb(pinned)} GB, more than memory_budget_gb "
                                    f"{gb(self.budget)}")

    # ---- the loop ---------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        claim = self.host_key.claim(HostRecord(self.name, pid=os.getpid()), lambda: self._stopping, self._tick_s)
        if claim == "stopped":
            log.info("stopped before Redis answered: nothing was started", redis=redacted(self.redis_url))
            return 0
        if claim == "taken":
            log.critical("worker exiting: another worker of several models runs under this name; give this one "
                         "another --consumer", name=self.name)
            return 2
        if self.settings.metrics_port is not None:
            try:
                host_metrics.serve(self.settings.metrics_host, self.settings.metrics_port, self._metrics_ports)
            except OSError as e:
                log.critical("worker exiting: the metrics port cannot be opened; choose another --metrics-port",
                             port=self.settings.metrics_port, error=str(e))
                return 2
        log.info("host ready", host=self.name, models=[m.queue for m in self.models], budget_gb=gb(self.budget))
        for model in self.models:
            if model.entry.pin:
                self._load(model)
        try:
            while not self._stopping:
                try:
                    self.tick()
                except RedisError as e:  # its model workers ride it out on their own; so does the host
                    log.warning("redis did not answer the host; trying again", error=describe(e))
                    time.sleep(1.0)
                time.sleep(self._tick_s)
        finally:
            self._stop_all()
        return 0

    def tick(self) -> None:
        """One look: take in what the fleet did, decide (`placement.decide`), carry it out."""
        now = time.monotonic()
        workers = read_workers(self.redis, self.keys)
        live = {w.name: w for w in workers if w.alive}
        for model in self.models:
            self._observe(model, live, now)
        look = self._look(now, workers)
        for model in self.models:
            if look.demand[model.queue].unread:
                model.last_used = now
        for decision in decide(self.policy, [m.view() for m in self.models], look):
            self._carry_out(decision, now)
        self._beat()

    def _look(self, now: float, workers: list[WorkerView]) -> Look:
        """What placement needs of Redis: each queue's demand, who else serves or loads it,
        and (only when a model may load here) the other hosts."""
        demand = {model.queue: self._demand(model) for model in self.models}
        served_elsewhere = frozenset(m.queue for w in workers if w.alive and w.name not in self._children()
                                     for m in w.heartbeat.models)
        wanted = [m for m in self.models if m.state == "available"
                  and (demand[m.queue].unread or demand[m.queue].pending)]
        loading_elsewhere = self.host_key.loaders_elsewhere([m.queue for m in wanted])
        return Look(now, demand, served_elsewhere, loading_elsewhere, self.host_key.other_hosts() if wanted else ())

    def _carry_out(self, decision: Decision, now: float) -> None:
        model = next(m for m in self.models if m.queue == decision.queue)
        if decision.action == "load":
            if self.host_key.take_load(model.queue):
                self._load(model)
        elif decision.action == "unload":
            if decision.why == "idle":
                log.info("unloading an idle model", model=model.queue, idle_s=round(now - model.last_used, 1))
            else:
                log.info("unloading a model to make room", model=model.queue)
            self._unload(model)
        elif decision.action == "refuse":
            self._refuse(model)
        else:
            model.failed = decision.why
            log.error("model left unloaded; its requests are answered model_unavailable until it is idle for "
                      "idle_unload_s", model=model.queue, reason=model.failed)

    def _observe(self, model: ModelProcess, live: dict[str, WorkerView], now: float) -> None:
        """Take in what its process did: started serving, exited, had work."""
        if model.process is None:
            return
        code = model.process.poll()
        if code is not None:
            self._exited(model, code)
            return
        beat = live.get(model.consumer)
        if beat is None:
            return
        if model.state == "loading" and beat.heartbeat.pid == model.process.pid:
            model.state, model.failures, model.last_used = "loaded", 0, now
            self.host_key.end_load(model.queue)
            log.info("answering its requests model_unavailable" if model.refusing else "model loaded",
                     model=model.queue, consumer=model.consumer)
        if beat.heartbeat.in_flight:
            model.last_used = now
        stats = beat.heartbeat.stats
        if stats is not None and not model.refusing:
            model.measured = max(model.measured, stats.memory_held)

    def _exited(self, model: ModelProcess, code: int) -> None:
        # A worker exits 0 only after a drain: ours, or one asked through Redis (the dashboard's unload).
        expected = model.state == "draining" or code == 0
        if model.state == "loading":
            self.host_key.end_load(model.queue)
        model.process, model.state = None, "available"
        if expected and model.refusing:  # idle: the next request tries to load it again
            model.refusing, model.failed, model.failures = False, None, 0
            return
        if expected:
            log.info("model unloaded", model=model.queue)
            return
        model.failures += 1
        log.error("a model's worker exited", model=model.queue, status=code, failures=model.failures)
        if model.failures >= MAX_FAILURES:
            model.failed = f"its worker exited {model.failures} times in a row (last status {code}); see its log"
            log.error("model left unloaded; its requests are answered model_unavailable until it is idle for "
                      "idle_unload_s", model=model.queue, reason=model.failed)

    def _demand(self, model: ModelProcess) -> Demand:
        """Its queue's (and its lanes') requests unread, and read but unfinished, and how
        long the oldest unread one has waited."""
        views = [read_stream(self.redis, self.keys, model.queue, lane) for lane in
                 [None, BATCH_LANE, *model.settings.lanes]]
        ages = [v.oldest_waiting_s for v in views if v.oldest_waiting_s is not None]
        return Demand(any(v.waiting for v in views), any(v.pending for v in views), max(ages, default=None))

    def _children(self) -> set[str]:
        return {m.consumer for m in self.models}

    # ---- processes --------------------------------------------------------------

    def _load(self, model: ModelProcess) -> None:
        log.info("loading a model", model=model.queue, path=model.entry.path, gb=gb(model.counted()))
        self._start(model)

    def _start(self, model: ModelProcess, refusal: str | None = None) -> None:
        model.metrics_port = None if self.settings.metrics_port is None else host_metrics.free_local_port()
        model.process = subprocess.Popen([sys.executable, "-m", "mlxq", "worker", "--config",
                                          str(self._child_config(model))], env=self._child_env(refusal))
        model.state = "loading"

    def _refuse(self, model: ModelProcess) -> None:
        """Answer its waiting requests with why it is not loaded: a worker that loads nothing
        and refuses each request (`unavailable`), so no request waits for it forever."""
        self._start(model, f"model {model.queue} ({model.entry.path}) could not be loaded on {self.name}: "
                           f"{model.failed}")
        model.refusing = True

    def _unload(self, model: ModelProcess) -> None:
        """Its worker drains: stops reading, finishes what runs, hands back the rest."""
        if model.process is not None:
            model.process.send_signal(signal.SIGTERM)
            model.state = "draining"

    def _child_env(self, refusal: str | None) -> dict[str, str]:
        """The host's environment without its MLXQ_* settings (the child's are all in its
        file), and what the host tells it (`Hosting`)."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_") or k.startswith("MLXQ_TEST_")}
        return {**inherited, **Hosting(os.getpid(), refusal).to_environment()}

    def _child_config(self, model: ModelProcess) -> Path:
        """Its worker's settings as a TOML file."""
        values = {name: value for name, value in model.settings.model_dump(mode="json").items()
                  if value is not None and name not in HOST_ONLY}
        values["redis_url"] = self.redis_url
        if model.metrics_port is not None:
            values.update(metrics_port=model.metrics_port, metrics_host="127.0.0.1")
        lines = [f"{name} = {_toml(value)}" for name, value in values.items()]
        path = self._configs / f"{model.queue}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _stop_all(self) -> None:
        running = [m for m in self.models if m.process is not None]
        loading = [m.queue for m in running if m.state == "loading"]
        for model in running:
            self._unload(model)
        deadline = time.monotonic() + self.settings.drain_timeout_s + 30
        for model in running:
            assert model.process is not None
            try:
                model.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("a model's worker did not stop; killing it", model=model.queue)
                model.process.kill()
        with contextlib.suppress(RedisError):  # else they expire
            self.host_key.release(loading)
        shutil.rmtree(self._configs, ignore_errors=True)
        log.info("host stopped", host=self.name)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stopping:
            return
        log.info("stop requested", signal=signal.Signals(signum).name)
        self._stopping = True

    # ---- what the fleet sees ------------------------------------------------------

    def _metrics_ports(self) -> dict[str, int]:
        """Called from the metrics server's thread: reads, never changes, the models."""
        return {m.queue: m.metrics_port for m in list(self.models)
                if m.state in ("loaded", "draining") and m.metrics_port is not None}

    def _free(self) -> int:
        return self.budget - sum(m.counted() for m in self.models if m.holds_memory())

    def _beat(self) -> None:
        models = tuple(HostedModel(m.queue, m.entry.path, "available" if m.refusing else m.state, m.counted(),
                                   m.entry.pin, m.failed, m.consumer) for m in self.models)
        self._looks += 1
        record = HostRecord(self.name, socket.gethostname(), os.getpid(), self.budget, self._free(), self._looks,
                            models)
        self.host_key.publish(record, [m.queue for m in self.models if m.state == "loading"])

def _toml(value: Any) -> str:
    """A setting's value in TOML: strings, numbers, booleans and lists of strings, as JSON
    writes them (TOML reads its strings and arrays), and TOML's own inf and nan."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    return json.dumps(value)
