"""Every Redis key and channel name mlxq uses, built in one place.

Per-request keys carry the id inside `{}`: a Redis Cluster hash tag, so that all keys
of one request live in one slot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUP = "workers"
DEFAULT_PREFIX = "mlxq"
DEFAULT_QUEUE = "default"
BATCH_LANE = "batch"  # the low lane of every queue: batches' lines, read after the queue itself
REPLY_NAME = re.compile(r"[A-Za-z0-9_.:{}\-]{1,128}")  # braces allowed: a Redis Cluster hash tag


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes to place `key`: the text between its first '{' and the
    next '}' when that is not empty, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else key


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (default `mlxq`)."""

    prefix: str = DEFAULT_PREFIX

    def queue(self, queue: str) -> str:
        """The request stream of `queue`; its consumer group is `workers`."""
        return f"{self.prefix}:q:{queue}"

    def lane(self, queue: str, lane: str) -> str:
        """A priority lane of `queue`: workers configured with it read it before the queue."""
        return f"{self.prefix}:q:{queue}:{lane}"

    def batch_lane(self, queue: str) -> str:
        """The low lane of `queue`: every worker reads it after the queue itself, and only
        into free slots, so batches soak up idle capacity behind interactive requests."""
        return self.lane(queue, BATCH_LANE)

    def dead(self, queue: str) -> str:
        """Where entries that cannot be served go, with the reason."""
        return f"{self.prefix}:q:{queue}:dead"

    def affinity_lane(self, queue: str, consumer: str) -> str:
        """The requests placed on one worker of `queue` because its prefix cache holds
        their prompt's start: it reads them first; any worker takes them after
        `affinity_wait_ms`, or at once when it is gone."""
        return f"{self.prefix}:q:{queue}:at:{consumer}"

    def affinity_lanes(self, queue: str) -> str:
        """Set: the workers of `queue` that have a placement lane (`affinity_lane`)."""
        return f"{self.prefix}:affinity:{queue}"

    def digest(self, queue: str, consumer: str) -> str:
        """What one worker's prefix cache holds, as a msgpack list of prefix-chain hashes."""
        return f"{self.prefix}:digest:{queue}:{consumer}"

    # A request's own keys are under its queue: a producer confined to its queue by an ACL
    # line (`%R~mlxq:out:<queue>:*`, ...) reads, cancels and names as `reply_to` only what
    # belongs to its queue. A worker's queue name has no ':' (its settings refuse one), so
    # no queue's pattern matches another queue's keys.

    def output(self, queue: str, request_id: str) -> str:
        """The default output stream of one request."""
        return f"{self.prefix}:out:{queue}:{{{request_id}}}"

    def cancel_flag(self, queue: str, request_id: str) -> str:
        """Set (with a TTL) by whoever cancels a request."""
        return f"{self.prefix}:cancel:{queue}:{{{request_id}}}"

    def cancel_channel(self, queue: str) -> str:
        """Pub/sub channel carrying ids of `queue`'s requests to cancel, so running work stops at once."""
        return f"{self.prefix}:cancel:{queue}"

    def done(self, queue: str, request_id: str) -> str:
        """Marks an id whose terminal event was written, so a repeat is not computed."""
        return f"{self.prefix}:done:{queue}:{{{request_id}}}"

    def progress(self, queue: str, request_id: str, output: str | None = None) -> str:
        """The publishing fence of one request (which entry and which taking of it writes its
        output, and how many events are written), in the slot of the stream it writes:
        `<prefix>:progress:<queue>:{<id>}` beside its own output,
        `<prefix>:progress:<queue>:{<tag>}:<id>` beside a shared `reply_to` stream whose
        Redis Cluster hash tag is `<tag>`."""
        if output is None or output == self.output(queue, request_id):
            return f"{self.prefix}:progress:{queue}:{{{request_id}}}"
        return f"{self.prefix}:progress:{queue}:{{{hash_tag(output)}}}:{request_id}"

    def crashes(self, queue: str, request_id: str) -> str:
        """The open attempts at preparing this request (a set): those left open are workers
        that died in the middle, its poison count."""
        return f"{self.prefix}:crashes:{queue}:{{{request_id}}}"

    def reply(self, queue: str, name: str) -> str:
        """A shared output stream of `queue` that many of its requests may name as `reply_to`."""
        return f"{self.prefix}:reply:{queue}:{name}"

    def reply_to_problem(self, queue: str, key: str) -> str | None:
        """Why a request of `queue` may not send its output to `key`, or None if it may. Only
        `<prefix>:reply:<queue>:<name>` is allowed: the worker writes nothing outside its
        prefix (one ACL pattern confines it), nothing outside the request's queue (one
        pattern per queue confines a producer), and never into another request's output."""
        name = key.removeprefix(self.reply(queue, ""))
        shown = ascii(key[:80]) + ("..." if len(key) > 80 else "")
        if name == key or not REPLY_NAME.fullmatch(name):
            return (f"reply_to: {shown} is not a shared reply stream of queue {queue!r}; use "
                    f"'{self.reply(queue, '<name>')}' with a name of 1-128 of A-Za-z0-9_.:-{{}}")
        if "}" in hash_tag(key):
            return (f"reply_to: {shown}: braces in a reply name must form one Redis Cluster hash tag, "
                    "'{' then a non-empty name then '}'")
        return None

    def worker(self, consumer: str) -> str:
        """One worker's heartbeat: its load and what it serves, with a TTL."""
        return f"{self.prefix}:workers:{consumer}"

    def stats(self, consumer: str) -> str:
        """One worker's totals and last heartbeat (a hash), kept for days after it stops."""
        return f"{self.prefix}:stats:{consumer}"

    def drain(self, consumer: str) -> str:
        """A request that one worker drain and stop (its process instance, with a TTL): the
        dashboard's drain and unload buttons, which reach a worker on any machine."""
        return f"{self.prefix}:drain:{consumer}"

    @property
    def timeline(self) -> str:
        """What each worker served, a sample every `timeline_s` (a stream, trimmed to the last
        `TIMELINE_KEEP_S` by entry id): the dashboard's charts."""
        return f"{self.prefix}:timeline"

    def dashboard_session(self, token_hash: str) -> str:
        """One signed-in dashboard session (JSON: the key it was opened with, its CSRF token), with a TTL."""
        return f"{self.prefix}:dashboard:session:{token_hash}"

    @property
    def fleet(self) -> str:
        """Every worker seen lately (a sorted set: consumer name, scored by when last seen)."""
        return f"{self.prefix}:fleet"

    def host(self, name: str) -> str:
        """A worker of several models (`[[models]]`): its budget and each model's state, with a TTL."""
        return f"{self.prefix}:hosts:{name}"

    @property
    def hosts(self) -> str:
        """Every such worker seen lately (a sorted set: its name, scored by when last seen)."""
        return f"{self.prefix}:hostset"

    def loading(self, queue: str) -> str:
        """The lease of the one worker loading `queue`'s model for the fleet (its name, with a TTL)."""
        return f"{self.prefix}:loading:{queue}"

    def batch(self, batch_id: str) -> str:
        """One batch's state (a hash: status, counts, times, its queue and endpoint)."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_part(self, batch_id: str, part: str) -> str:
        """A batch's other keys, in its slot: `lines` (a list), `results` and `errors` (hashes by
        line), `lease` (who drives it, with a TTL)."""
        return f"{self.prefix}:batch:{{{batch_id}}}:{part}"

    def batch_replies(self, queue: str, batch_id: str) -> str:
        """The `reply_to` stream of every line of a batch on `queue`, in the batch's slot."""
        return self.reply(queue, f"{{{batch_id}}}")

    @property
    def batches(self) -> str:
        """Every batch (a sorted set: its id, scored by when it was created)."""
        return f"{self.prefix}:batches"

    @property
    def active_batches(self) -> str:
        """The batches not yet ended (a set), which drivers look for."""
        return f"{self.prefix}:batches:active"

    def file(self, file_id: str) -> str:
        """One uploaded file (a hash: its fields and `data`, the content)."""
        return f"{self.prefix}:file:{{{file_id}}}"

    @property
    def files(self) -> str:
        """Every uploaded file (a sorted set: its id, scored by when it was uploaded)."""
        return f"{self.prefix}:files"

    def tenant(self, tenant: str, part: str) -> str:
        """A tenant's own keys, in its slot: `files` and `batches` (sorted sets of its ids,
        scored by creation), `bytes` (a hash: what it stores against its files budget),
        `active` (a sorted set: its batches not yet ended, scored by when they expire)."""
        return f"{self.prefix}:tenant:{{{tenant}}}:{part}"

    def response(self, response_id: str) -> str:
        """A stored Responses API response: its record (JSON: the response, its input and
        conversation items, its tenant), with a TTL."""
        return f"{self.prefix}:response:{{{response_id}}}"

    @property
    def api_keys(self) -> str:
        """The gateways' API keys (a hash: sha256 of a key -> its record as JSON)."""
        return f"{self.prefix}:apikeys"

    def in_flight(self, key_id: str) -> str:
        """The requests one API key has in flight (a sorted set scored by when its lease ends)."""
        return f"{self.prefix}:apikey:{{{key_id}}}:inflight"

    @property
    def rate_limits(self) -> str:
        """The prefix of the gateways' rate-limit windows (kept by the `limits` library)."""
        return f"{self.prefix}:ratelimit"

    def adapters(self, queue: str) -> str:
        """The LoRA adapters loaded at runtime for `queue`'s workers (a hash: name -> path;
        an empty path unloads an adapter the workers' settings name)."""
        return f"{self.prefix}:adapters:{queue}"

    def limits(self, queue: str) -> str:
        """What the workers of `queue` accept (a hash; `max_len`: the most requests waiting
        in each of its streams before producers are refused with QueueFull)."""
        return f"{self.prefix}:limits:{queue}"
