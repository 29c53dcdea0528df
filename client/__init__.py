"""mlxq's thin client: submit generation requests to a Redis stream and follow their output.

Needs only redis and msgpack (and pydantic for validation); it never imports MLX. The
wire format is `client.protocol` and the key names `client.keys`, public because the
worker (and any other implementation in Python) speaks through them too.
"""

from ._async import AsyncClient, AsyncJob
from ._batch_jobs import AsyncBatchHandle
from ._errors import (
    JobFailed,
    JobTimeout,
    MlxqError,
    QueueFull,
    RedisFailed,
    RedisUnavailable,
    RequestRejected,
    Undeliverable,
)
from ._jobs import JobCancelled
from ._sync import BatchHandle, Client, Job
from .batches import Batch, LineResult
from .keys import GROUP, Keys
from .protocol import (
    Delta,
    Done,
    Error,
    ErrorCode,
    Event,
    Ranked,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    decode_event,
    encode_event,
    encode_request,
)
from .which_redis import DEFAULT_URL

__all__ = [
    "DEFAULT_URL",
    "GROUP",
    "AsyncBatchHandle",
    "AsyncClient",
    "AsyncJob",
    "Batch",
    "BatchHandle",
    "Client",
    "Delta",
    "Done",
    "Error",
    "ErrorCode",
    "Event",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobTimeout",
    "Keys",
    "LineResult",
    "MlxqError",
    "QueueFull",
    "RedisFailed",
    "RedisUnavailable",
    "Ranked",
    "RequestRejected",
    "Timing",
    "TokenLogprob",
    "TopLogprob",
    "Undeliverable",
    "Usage",
    "decode_event",
    "encode_event",
    "encode_request",
]
