"""Errors in OpenAI's JSON shape, with the status each mlxq outcome deserves.

    400 invalid request    401 bad key       404 unknown model   413 too large
    429 queue full         503 no worker     504 timed out       500 the worker failed

The message is mlxq's own: the client's validation, or the worker's `error` event.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from client import ErrorCode, JobFailed, QueueFull, RequestRejected

TIMEOUT = "timeout"  # the gateway's own code: the request did not finish within its timeout
# A worker's error code -> (HTTP status, OpenAI error type); a code newer than this gateway is a 500.
_BY_CODE: dict[str, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout"),
    TIMEOUT: (504, "timeout"),
    ErrorCode.POISONED: (500, "server_error"),
    ErrorCode.MODEL_UNAVAILABLE: (503, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


class ApiError(Exception):
    """An HTTP error answered as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, "invalid_request_error", ErrorCode.INVALID_REQUEST.value, param)

    @classmethod
    def from_code(cls, code: str, message: str) -> ApiError:
        """The error for a worker's `error` event (or the gateway's own timeout)."""
        status, kind = _BY_CODE.get(code, (500, "server_error"))
        return cls(status, message, kind, str(code))

    @classmethod
    def from_mlxq(cls, error: Exception) -> ApiError:
        """The error for what the client raised at submission or while waiting."""
        if isinstance(error, QueueFull):
            return cls(429, str(error), "rate_limit_error", "queue_full", headers={"Retry-After": "1"})
        if isinstance(error, RequestRejected):
            return cls.from_code(error.code, str(error))
        if isinstance(error, JobFailed):
            return cls.from_code(error.code, error.message)
        raise TypeError(f"not an mlxq outcome: {error!r}")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
