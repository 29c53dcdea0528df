"""mlxq's thin client: submit generation requests to a Redis stream and follow their output.

Needs only redis and msgpack (and pydantic for validation); it never imports MLX.
"""

from ._async import DEFAULT_URL, AsyncClient, AsyncJob
from ._errors import JobCancelled, JobFailed, JobTimeout, MlxqError, RequestRejected
from ._keys import GROUP, Keys
from ._protocol import Delta, Done, Error, Event, decode_event, encode_event, encode_request
from ._sync import Client, Job

__all__ = [
    "DEFAULT_URL",
    "GROUP",
    "AsyncClient",
    "AsyncJob",
    "Client",
    "Delta",
    "Done",
    "Error",
    "Event",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobTimeout",
    "Keys",
    "MlxqError",
    "RequestRejected",
    "decode_event",
    "encode_event",
    "encode_request",
]
