"""`/v1/embeddings` (OpenAI's shape) and `/v1/rerank` (the Cohere / Jina shape vLLM serves):
bodies read strictly into mlxq's embedding and rerank bodies, and their `done` written
back in those APIs' shapes. The values are checked by `client.pooling` when submitted."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.protocol import Done, Event, TokenLogprob

from .errors import ApiError
from .requests import Call, describe

PoolingKind = Literal["embeddings", "rerank"]
SHAPES = {"input": "input: a string, a list of strings, a list of token ids, or a list of lists of token ids",
          "documents": "documents: a list of strings or of {\"text\": string} objects"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingsRequest(_Strict):
    """OpenAI's embeddings request, with vLLM's `truncate_prompt_tokens` spelled as mlxq's
    `truncate` (cut to the model's limit) and mlxq's `priority` (extra_body)."""

    model: str = Field(min_length=1, max_length=512)
    input: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    truncate: bool | None = None
    priority: int | None = None

    def to_body(self) -> dict[str, Any]:
        one_tokenized = isinstance(self.input, list) and bool(self.input) and isinstance(self.input[0], int)
        return {"input": [self.input] if one_tokenized else self.input, "dimensions": self.dimensions,
                "encoding_format": self.encoding_format, "truncate": self.truncate, "priority": self.priority}


class Document(_Strict):
    text: str


class RerankRequest(_Strict):
    """A rerank request as vLLM, Cohere and Jina take it (documents as strings or `{text}`)."""

    model: str = Field(min_length=1, max_length=512)
    query: str
    documents: list[str | Document]
    top_n: int | None = None
    return_documents: bool = False
    instruction: str | None = None
    truncate: bool | None = None
    priority: int | None = None

    def to_body(self) -> dict[str, Any]:
        return {"query": self.query, "documents": [d if isinstance(d, str) else d.text for d in self.documents],
                "top_n": self.top_n, "instruction": self.instruction, "truncate": self.truncate,
                "priority": self.priority}


def read_pooling_call(kind: PoolingKind, raw: Any) -> Call:
    """Validate an HTTP body as an embeddings or rerank request; raises `ApiError` (400)."""
    if not isinstance(raw, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    try:
        request = (EmbeddingsRequest if kind == "embeddings" else RerankRequest).model_validate(raw)
    except ValidationError as e:
        shape = next((SHAPES[p["loc"][0]] for p in e.errors(include_url=False) if p["loc"][0] in SHAPES), None)
        if shape is not None:  # a union's every branch failed: say what it takes, once
            raise ApiError.invalid(shape, param=shape.split(":")[0]) from e
        raise ApiError.invalid(*describe(e)) from e
    body = {k: v for k, v in request.to_body().items() if v is not None}
    returns_documents = isinstance(request, RerankRequest) and request.return_documents
    return Call(kind, request.model, body, False, False, int(time.time()), False, returns_documents)


def embeddings_response(call: Call, done: Done) -> dict[str, Any]:
    """OpenAI's embeddings response for an embedding request's `done`."""
    data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(done.embeddings or [])]
    tokens = done.usage.prompt_tokens
    return {"object": "list", "data": data, "model": call.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_response(call: Call, done: Done, request_id: str) -> dict[str, Any]:
    """vLLM's (Jina's) rerank response: results best first, with their documents when asked."""
    documents = call.body["documents"]
    results = [{"index": r.index, "relevance_score": r.relevance_score,
                **({"document": {"text": documents[r.index]}} if call.returns_documents else {})}
               for r in done.results or []]
    return {"id": f"rerank-{request_id}", "model": call.model, "results": results,
            "usage": {"total_tokens": done.usage.prompt_tokens}}


class PoolingShape:
    """How an embeddings or rerank call is answered: one whole response, never a stream."""

    keepalive = b""

    def __init__(self, call: Call, request_id: str, tool_call: tuple[str, str] | None) -> None:
        self.call = call
        self.request_id = request_id
        self.route: str = call.kind

    def opening(self) -> list[bytes]:
        return []

    def lines(self, event: Event) -> list[bytes]:
        return []

    def failure(self, error: ApiError) -> list[bytes]:
        return []

    async def settle(self) -> None:
        pass

    def whole(self, done: Done, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        if self.call.kind == "embeddings":
            return embeddings_response(self.call, done)
        return rerank_response(self.call, done, self.request_id)
