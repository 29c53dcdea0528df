"""Request bodies read within a limit while they arrive: a chunked body (no
Content-Length) or one that lies about its length is stopped at the limit, never read
whole first; a multipart upload stops being written to disk there too."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import Message

from .errors import ApiError

TooLarge = Callable[[int], ApiError]


def bounded(request: Request, limit: int, too_large: TooLarge) -> Request:
    """`request` whose body, read through it (`body()`, `stream()`, `form()`), raises
    `too_large(bytes received)` as soon as more than `limit` bytes have come."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared))
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large(received)
        return message

    return Request(request.scope, receive)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes (else a 413)."""
    def too_large(size: int) -> ApiError:
        return ApiError(413, f"the request body is above this gateway's max_body_bytes ({limit}): {size} bytes "
                        "or more", "invalid_request_error", "too_large")
    return await bounded(request, limit, too_large).body()
