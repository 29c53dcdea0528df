"""The bodies of embedding and rerank requests (docs/protocol.md, "Embeddings and rerank").

An embedding model's queue takes `EmbeddingBody`, a reranker's `RerankBody`; each is
answered by one `done` (`Done.embeddings`, `Done.results`). Like `RequestBody`, unknown
fields are an error. What depends on the model (its length limit, its Matryoshka sizes)
is the worker's to check.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._errors import JobFailed, RequestRejected
from .protocol import (
    Done,
    Encoding,
    PoolingTask,
    Ranked,
    RequestBody,
    describe_validation_error,
    validate_body,
)

MAX_INPUTS = 2048  # inputs of one embedding request, as OpenAI's API allows
MAX_DOCUMENTS = 1024  # documents of one rerank request
EncodingFormat = Literal["float", "base64"]


class _PoolingBody(BaseModel):
    """What every pooling request may carry besides its inputs: as on a generation request."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    truncate: bool = False  # cut an input past the model's limit to fit, instead of refusing it
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    deadline_ms: int | None = Field(None, ge=0, lt=2**53)
    reply_to: str | None = Field(None, min_length=1, max_length=512)
    encoding: Encoding | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # as on a generation (pooling keeps no cache)


class EmbeddingBody(_PoolingBody):
    """One vector per input, in order."""

    input: str | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    dimensions: int | None = Field(None, ge=1)
    encoding_format: EncodingFormat = "float"

    @field_validator("input")
    @classmethod
    def _inputs_not_empty(cls, value: str | list[str] | list[list[int]]) -> str | list[str] | list[list[int]]:
        items = [value] if isinstance(value, str) else value
        if not items:
            raise ValueError("give at least one input")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"{len(items)} inputs is above the most one request may hold ({MAX_INPUTS}); "
                             "split them over several requests")
        for i, item in enumerate(items):
            if not item:
                raise ValueError(f"input {i} is empty")
            if isinstance(item, list) and min(item) < 0:
                raise ValueError(f"input {i}: token ids cannot be negative")
        return value

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        return [self.input] if isinstance(self.input, str) else self.input


class RerankBody(_PoolingBody):
    """The documents' relevance to the query, best first."""

    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    instruction: str | None = Field(None, min_length=1, max_length=4096)  # what a Qwen3-style reranker judges by

    @field_validator("documents")
    @classmethod
    def _documents_not_empty(cls, documents: list[str]) -> list[str]:
        empty = [i for i, d in enumerate(documents) if not d]
        if empty:
            raise ValueError(f"documents {empty[:5]} are empty")
        return documents


def pooling_kind(raw: dict[str, Any]) -> PoolingTask | None:
    """Which kind of pooling request a body is, by its inputs (`input`; `query` or
    `documents`); None for a generation request."""
    if "input" in raw:
        return "embed"
    return "rerank" if "query" in raw or "documents" in raw else None


def validate_any_body(raw: dict[str, Any]) -> RequestBody | EmbeddingBody | RerankBody:
    """A generation, embedding or rerank body (`pooling_kind`), validated as the worker will."""
    kind = pooling_kind(raw)
    if kind == "embed":
        return validate_embedding_body(raw)
    return validate_rerank_body(raw) if kind == "rerank" else validate_body(raw)


def validate_embedding_body(raw: dict[str, Any]) -> EmbeddingBody:
    """Validate a decoded body; raise `RequestRejected` naming each bad field and why."""
    return _validated(EmbeddingBody, raw)


def validate_rerank_body(raw: dict[str, Any]) -> RerankBody:
    return _validated(RerankBody, raw)


def _validated(kind: type[EmbeddingBody] | type[RerankBody], raw: dict[str, Any]) -> Any:
    try:
        return kind.model_validate(raw)
    except ValidationError as e:
        raise RequestRejected(describe_validation_error(e)) from e


def decode_vector(value: Sequence[float] | str) -> list[float]:
    """The floats of a vector in either encoding."""
    if isinstance(value, str):
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return list(value)


def embeddings_of(done: Done) -> list[list[float]]:
    """The vectors of an embedding request's `done`, as floats whichever encoding it asked;
    `JobFailed` if it has none (a worker of an older version answered)."""
    if done.embeddings is None:
        raise JobFailed(done.id, "internal", "the request ended without embeddings")
    return [decode_vector(v) for v in done.embeddings]


def ranked_of(done: Done) -> list[Ranked]:
    """The results of a rerank request's `done`, best first (`JobFailed` if it has none)."""
    if done.results is None:
        raise JobFailed(done.id, "internal", "the request ended without results")
    return list(done.results)
