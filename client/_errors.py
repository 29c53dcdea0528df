"""Exceptions raised by the client SDK (and, for a request, by the worker's validation).

    MlxqError
    ├── RequestRejected      the request is invalid (.code, e.g. invalid_request, too_large);
    │   │                    the client raises it before sending anything
    │   └── Undeliverable    an entry without a readable id: the worker dead-letters it
    ├── QueueFull            the queue's backlog is at its bound; nothing was sent (.queue, .waiting, .max_len)
    ├── JobFailed            the worker answered with an `error` event (.code, .message)
    ├── JobCancelled         the request ended with finish_reason `cancelled` (.done)
    ├── JobTimeout           no terminal event within the timeout (also a TimeoutError)
    ├── RedisFailed          Redis refused a command (NOPERM, OOM, ...; also redis-py's ResponseError)
    └── RedisUnavailable     Redis could not be reached or did not answer in time (also
                             redis-py's ConnectionError and TimeoutError)

redis-py's errors become these where the client calls Redis (`redis_errors`), the one
boundary: a caller catches `MlxqError` alone, and code written against redis-py's
exceptions still catches them.

Every one carries `request_id` where there is one. `ErrorCode` lives here too: the codes
of `error` events, which a rejection carries before anything is sent. (`JobCancelled`,
which carries the request's `Done`, is `client._jobs`': it stands above the protocol.)
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from redis import exceptions as redis_exceptions


class ErrorCode(str, enum.Enum):
    """The `code` of an `error` event (a str, so it compares and encodes as its value)."""

    INVALID_REQUEST = "invalid_request"
    TOO_LARGE = "too_large"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    POISONED = "poisoned"
    MODEL_UNAVAILABLE = "model_unavailable"  # the queue's model failed to load where it was to run
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value


class MlxqError(Exception):
    """Base class of every error the SDK raises."""


class RequestRejected(MlxqError, ValueError):
    """The request is invalid; `code` says how (`invalid_request`, `too_large`)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class Undeliverable(RequestRejected):
    """A request entry without a readable id: nobody can be answered, so it is dead-lettered."""


class QueueFull(MlxqError):
    """The queue holds as many waiting requests as its workers accept (`max_queue_len`);
    the request was not sent. Retry later, with backoff."""

    def __init__(self, stream: str, waiting: int, max_len: int) -> None:
        super().__init__(f"{stream} is full: {waiting} requests waiting, the workers accept at most {max_len}; "
                         "retry later")
        self.stream = stream
        self.waiting = waiting
        self.max_len = max_len


class JobFailed(MlxqError):
    """The worker answered the request with an `error` event."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed ({code}): {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class JobTimeout(MlxqError, TimeoutError):
    """No terminal event arrived within the timeout; the request may still run."""

    def __init__(self, request_id: str, timeout: float | None) -> None:
        super().__init__(f"request {request_id}: no result within {timeout} s")
        self.request_id = request_id
        self.timeout = timeout


class RedisFailed(MlxqError, redis_exceptions.ResponseError):
    """Redis refused a command (an ACL's NOPERM, OOM, a wrong type); `__cause__` is redis-py's."""


class RedisUnavailable(MlxqError, redis_exceptions.ConnectionError, redis_exceptions.TimeoutError):
    """Redis could not be reached, or did not answer within the socket timeout."""


@contextlib.contextmanager
def redis_errors() -> Iterator[None]:
    """Around the client's Redis calls: redis-py's errors raised as `RedisFailed` or
    `RedisUnavailable` (an MlxqError already, such as QueueFull, passes as it is)."""
    try:
        yield
    except MlxqError:
        raise
    except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError) as e:
        raise RedisUnavailable(f"Redis did not answer: {e}") from e
    except redis_exceptions.RedisError as e:
        raise RedisFailed(f"Redis refused: {e}") from e
