"""Exceptions raised by the client SDK.

    MlxqError
    ├── RequestRejected      the request was invalid before it was sent
    ├── JobFailed            the worker answered with an `error` event (.code, .message)
    ├── JobCancelled         the request ended with finish_reason `cancelled`
    └── JobTimeout           no terminal event within the timeout (also a TimeoutError)
"""

from __future__ import annotations


class MlxqError(Exception):
    """Base class of every error the SDK raises."""


class RequestRejected(MlxqError, ValueError):
    """The request was invalid and was not sent."""


class JobFailed(MlxqError):
    """The worker answered the request with an `error` event."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed ({code}): {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class JobCancelled(MlxqError):
    """The request was cancelled before it finished; `done` holds what was produced."""

    def __init__(self, request_id: str, done: object) -> None:
        super().__init__(f"request {request_id} was cancelled")
        self.request_id = request_id
        self.done = done


class JobTimeout(MlxqError, TimeoutError):
    """No terminal event arrived within the timeout; the request may still run."""
