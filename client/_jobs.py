"""What the sync and async clients share: building a submission and following a job's events."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ._errors import JobFailed, JobTimeout, MlxqError, QueueFull, RequestRejected
from .keys import GROUP, Keys
from .pooling import validate_any_body
from .protocol import (
    MAX_NESTING_DEPTH,
    Delta,
    Done,
    Encoding,
    Event,
    check_values,
    decode_event,
    encode_request,
)
from .replies import StreamEntry

BLOCK_MS = 1000  # each blocking read stays well below the clients' 10 s socket timeout
OUTAGE_S = 60.0  # a job's reads ride out a Redis restart or failover this long (or to its timeout)
RETRY_S = 0.25
BOUND_TTL_S = 5.0  # a queue's published bound is read again after this long

# Add the entries, all or none: none if they would make the stream hold more than
# `max_len` requests nobody has read yet (its length minus those pending in the group).
# One key: fine on a cluster; one call: a worker blocked on the stream reads them together.
# KEYS: the request stream. ARGV: group, max_len (0: none), then per entry its field
# count and its fields and values.
ENQUEUE = """
local bound, added = tonumber(ARGV[2]), {}
if bound > 0 then
  local waiting, count, i = redis.call('XLEN', KEYS[1]), 0, 3
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1])
  if type(pending) == 'table' and not pending.err then waiting = waiting - pending[1] end
  while i <= #ARGV do count, i = count + 1, i + tonumber(ARGV[i]) + 1 end
  if waiting + count > bound then return redis.error_reply('QUEUEFULL ' .. waiting) end
end
local i = 3
while i <= #ARGV do
  local width = tonumber(ARGV[i])
  added[#added + 1] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + width))
  i = i + width + 1
end
return added
"""


class JobCancelled(MlxqError):
    """The request was cancelled before it finished; `done` holds what was produced."""

    def __init__(self, request_id: str, done: Done) -> None:
        super().__init__(f"request {request_id} was cancelled")
        self.request_id = request_id
        self.done = done


@dataclass(frozen=True)
class Submission:
    """A validated request, ready to XADD."""

    id: str
    stream: str
    fields: dict[str, bytes | str]
    output: str
    queue: str


class Bounds:
    """The bounds workers published for their queues (`mlxq:limits:<queue>`), each read
    again after `BOUND_TTL_S`; 0 or none published: no bound."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[float, int]] = {}

    def cached(self, queue: str) -> int | None:
        """The bound if read lately, else None (read it and `remember` it)."""
        known = self._known.get(queue)
        return known[1] if known and time.monotonic() - known[0] < BOUND_TTL_S else None

    def remember(self, queue: str, raw: bytes | str | None) -> int:
        try:
            bound = max(0, int(raw or 0))
        except ValueError:
            bound = 0
        self._known[queue] = (time.monotonic(), bound)
        return bound


def enqueue_args(submissions: list[Submission], bound: int) -> list[Any]:
    """ARGV of `ENQUEUE` for submissions to one stream, added together or not at all
    (`bound` 0: no bound): per entry, its field count and its fields."""
    args: list[Any] = [GROUP, bound]
    for submission in submissions:
        args += [2 * len(submission.fields), *(item for pair in submission.fields.items() for item in pair)]
    return args


def queue_full(error: Exception, submission: Submission, bound: int) -> Exception:
    """`QueueFull` if `ENQUEUE` refused the entry, else the error itself."""
    text = str(error)
    if text.startswith("QUEUEFULL"):
        return QueueFull(submission.stream, int(text.split()[1]), bound)
    return error


def build_submission(keys: Keys, queue: str, request_id: str | None, encoding: Encoding,
                     body: dict[str, Any], lane: str | None = None) -> Submission:
    """Validate `body` as the worker will and lay out the entry (on `lane` of the queue,
    if given); raise `RequestRejected`."""
    body = {k: v for k, v in body.items() if v is not None}
    request_id = request_id or uuid.uuid4().hex
    try:
        check_values(body, MAX_NESTING_DEPTH)
        validate_any_body(body)
        fields = encode_request(request_id, body, encoding)
    except RequestRejected:
        raise
    except (TypeError, ValueError) as e:  # a value the encoding cannot carry
        raise RequestRejected(f"the request cannot be encoded as {encoding}: {e}") from e
    reply_to = body.get("reply_to")
    problem = None if reply_to is None else keys.reply_to_problem(queue, reply_to)
    if problem:
        raise RequestRejected(problem)
    output = reply_to or keys.output(queue, request_id)
    stream = keys.queue(queue) if lane is None else keys.lane(queue, lane)
    return Submission(request_id, stream, fields, output, queue)


class Cursor:
    """Follows one request's events on its output stream (shared streams hold others too)."""

    def __init__(self, request_id: str, output: str) -> None:
        self.request_id = request_id
        self.output = output
        self.last_id = "0-0"
        self.next_seq = 0
        self.terminal: Event | None = None

    def feed(self, entries: list[StreamEntry]) -> list[Event]:
        """This request's events among newly read entries; remembers the terminal one."""
        events = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            if fields is None or self.terminal is not None:
                continue
            event = decode_event(fields)
            if event.id != self.request_id:
                continue
            if isinstance(event, Delta):
                if event.seq < self.next_seq:  # written again after a failover rewound the output: seen
                    continue
                self.next_seq = event.seq + 1
            events.append(event)
            if not isinstance(event, Delta):
                self.terminal = event
        return events

    def outcome(self) -> Done:
        """The final output; raises if the request failed or was cancelled."""
        event = self.terminal
        if isinstance(event, Done):
            if event.finish_reason == "cancelled":
                raise JobCancelled(self.request_id, event)
            return event
        assert event is not None and not isinstance(event, Delta)
        raise JobFailed(self.request_id, event.code, event.message)


class Outage:
    """How long a job's reads have failed to reach Redis: they keep trying through a
    restart or a Sentinel failover (the output stream is still there afterwards), and
    give up after `OUTAGE_S` of failures in a row (or at the job's timeout)."""

    def __init__(self) -> None:
        self.since: float | None = None

    def failed(self, error: Exception) -> float:
        """Seconds to wait before reading again; raises `error` once the outage is too long."""
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since > OUTAGE_S:
            raise error
        return RETRY_S

    def ended(self) -> None:
        self.since = None


class Deadline:
    """A timeout turned into the next blocking read's length."""

    def __init__(self, request_id: str, timeout: float | None) -> None:
        self.request_id = request_id
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def block_ms(self) -> int:
        """How long the next read may block; raises `JobTimeout` once time is up."""
        if self.at is None:
            return BLOCK_MS
        left = self.at - time.monotonic()
        if left <= 0:
            raise JobTimeout(self.request_id, self.timeout)
        return max(1, min(BLOCK_MS, int(left * 1000)))

    def left(self) -> float:
        """Seconds until the timeout (a long time without one)."""
        return float("inf") if self.at is None else max(0.0, self.at - time.monotonic())
