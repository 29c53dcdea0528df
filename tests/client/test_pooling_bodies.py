"""Embedding and rerank bodies, read by the client (as the worker reads them) and by the
gateway (OpenAI's, vLLM's and Cohere's shapes): what is taken, what is refused and how
the refusal reads; any JSON value is either a body or a `RequestRejected` / `ApiError`."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.pooling import (
    MAX_INPUTS,
    EmbeddingBody,
    RerankBody,
    decode_vector,
    validate_any_body,
    validate_embedding_body,
    validate_rerank_body,
)
from client.protocol import RequestBody, RequestRejected
from gateway.errors import ApiError
from gateway.pooling import read_pooling_call


def test_each_kind_of_body_is_told_apart_by_its_inputs():
    assert isinstance(validate_any_body({"input": "hi"}), EmbeddingBody)
    assert isinstance(validate_any_body({"query": "q", "documents": ["d"]}), RerankBody)
    assert isinstance(validate_any_body({"prompt": "hi"}), RequestBody)


@pytest.mark.parametrize(("body", "problem"), [
    ({"input": []}, "give at least one input"),
    ({"input": [""]}, "input 0 is empty"),
    ({"input": [[]]}, "input 0 is empty"),
    ({"input": [[3, -1]]}, "cannot be negative"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, f"{MAX_INPUTS + 1} inputs is above"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "prompt": "b"}, "prompt: Extra inputs are not permitted"),
    ({"input": 3}, "input"),
])
def test_embedding_bodies_refused_with_the_field_and_the_reason(body, problem):
    with pytest.raises(RequestRejected, match=problem):
        validate_embedding_body(body)


@pytest.mark.parametrize(("body", "problem"), [
    ({"query": "", "documents": ["d"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["d", ""]}, r"documents \[1\] are empty"),
    ({"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": [3]}, "documents"),
])
def test_rerank_bodies_refused_with_the_field_and_the_reason(body, problem):
    with pytest.raises(RequestRejected, match=problem):
        validate_rerank_body(body)


def test_a_base64_vector_decodes_to_its_float32_values():
    values = [0.5, -1.25, 3.0]
    assert decode_vector(base64.b64encode(struct.pack("<3f", *values)).decode()) == values
    assert decode_vector(values) == values


def test_the_gateway_reads_openai_s_embedding_request():
    call = read_pooling_call("embeddings", {"model": "m", "input": [1, 2, 3], "dimensions": 8,
                                            "encoding_format": "base64", "user": "u"})
    assert call.body == {"input": [[1, 2, 3]], "dimensions": 8, "encoding_format": "base64"}
    assert call.task == "embed" and not call.stream


def test_the_gateway_reads_cohere_s_and_jina_s_rerank_request():
    call = read_pooling_call("rerank", {"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1,
                                        "return_documents": True})
    assert call.body == {"query": "q", "documents": ["a", "b"], "top_n": 1}
    assert call.returns_documents and call.task == "rerank"


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("embeddings", {"model": "m", "input": {"a": 1}}, "input"),
    ("embeddings", {"model": "m", "input": "a", "pooling": "mean"}, None),
    ("rerank", {"model": "m", "query": "q", "documents": [{"title": "x"}]}, "documents"),
    ("rerank", {"model": "m", "documents": ["d"]}, "query"),
])
def test_the_gateway_refuses_what_it_cannot_read(kind, body, param):
    with pytest.raises(ApiError) as refused:
        read_pooling_call(kind, body)
    assert refused.value.status == 400
    if param is not None:
        assert refused.value.param == param


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["input", "query", "documents", "dimensions", "encoding_format", "top_n",
                                        "truncate", "model", "instruction"]), JSON, max_size=5))
def test_any_body_is_read_or_refused_never_an_exception(raw: dict[str, Any]):
    try:
        validate_any_body(raw)
    except RequestRejected:
        pass
    for kind in ("embeddings", "rerank"):
        try:
            read_pooling_call(kind, raw)  # type: ignore[arg-type]
        except ApiError:
            pass
