"""Embedding and rerank queues end to end: real Valkey, real workers on the demo embedding
model and reranker (`mlxq demo-model --embedding` / `--reranker`), the official `openai`
SDK against the gateway; every answer checked against the model run in this process."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import subprocess
import time
import uuid

import httpx
import openai
import pytest
import redis
from support import KEYS, MLXQ, ROOT, Outputs, build_demo_model, start_gateway, worker_fixture, xadd_json

from client import Client, Done, Error, JobFailed, RequestRejected

TEXTS = ["Hello there.", "Queues hold work until a worker takes it.", "json",
         "Continuous batching admits new requests between decode steps, so a long generation does not hold "
         "back the short ones that arrive after it; embeddings ride the same queue.",
         "A haiku on Redis streams", "x"]
QUERY = "What holds work until a worker takes it?"
DOCUMENTS = ["Queues hold work until a worker takes it.", "The cat sat on the mat.", "json is a format",
             "Workers take work from queues, and a queue holds it meanwhile.", "pathlib paths"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("model") / "embedding", "--embedding")


@pytest.fixture(scope="module")
def reranker_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("model") / "reranker", "--reranker")


@pytest.fixture(scope="module")
def cross_encoder_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("model") / "cross-encoder", "--cross-encoder")


embedder = worker_fixture("embedding_model", max_num_seqs=8)
reranker = worker_fixture("reranker_model", task="rerank")
cross_encoder = worker_fixture("cross_encoder_model")  # its task read from its config (auto)


@pytest.fixture(scope="module")
def gateway(redis_url, embedder, reranker, logs_dir):
    process = start_gateway(redis_url, logs_dir)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def in_process(embedding_model):
    """The embedding model as mlx-vlm's own server runs it: its tokenizer, one text at a time, no padding."""
    import mlx.core as mx
    from mlx_vlm.embedding_loader import load_embedding_model
    from mlx_vlm.models.pooling import read_pooling_config
    from mlx_vlm.utils import load_processor

    model = load_embedding_model(embedding_model)
    model.pooling_config = read_pooling_config(embedding_model)
    tokenizer = load_processor(embedding_model, add_detokenizer=False)

    def embed(text: str | list[int]) -> list[float]:
        ids = text if isinstance(text, list) else tokenizer(text)["input_ids"]
        return model(mx.array([ids]), attention_mask=mx.array([[1] * len(ids)])).text_embeds[0].tolist()

    embed.tokenizer = tokenizer  # type: ignore[attr-defined]
    return embed


@pytest.fixture(scope="module")
def scores_in_process(reranker_model):
    """Qwen3-Reranker's score as its model card computes it: P(yes) against no after its prompt, one pair alone."""
    import mlx.core as mx
    from mlx_vlm.reranker_loader import load_reranker

    from worker.prepare.pooling import QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX, qwen3_rerank_text

    model, tokenizer = load_reranker(str(reranker_model))
    yes, no = (tokenizer.convert_tokens_to_ids(w) for w in ("yes", "no"))

    def score(query: str, document: str) -> float:
        text = QWEN3_RERANK_PREFIX + qwen3_rerank_text(query, document, None) + QWEN3_RERANK_SUFFIX
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        language = model.language_model
        last = language.model(mx.array([ids]))[:, -1]
        logits = language.model.embed_tokens.as_linear(last)[0]
        return float(mx.sigmoid(logits[yes] - logits[no]).item())

    return score


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOLERANCE


def cut(vector: list[float], size: int) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector[:size]))
    return [x / norm for x in vector[:size]]


def test_embeddings_equal_the_model_in_process_alone_and_batched(embedder, in_process, r):
    """Many requests of inputs of other lengths, all sent at once (so their inputs share
    padded passes): each vector equals the model's on that text alone; the usage counts
    the tokens the model's tokenizer makes."""
    bodies = [{"input": TEXTS[i % len(TEXTS)]} if i % 3 else {"input": TEXTS[i % 4:]} for i in range(18)]
    bodies.append({"input": [in_process.tokenizer("Hello there.")["input_ids"], [5, 6, 7]]})
    ids = [f"emb-{uuid.uuid4().hex[:8]}" for _ in bodies]
    with r.pipeline(transaction=False) as pipe:
        for request_id, body in zip(ids, bodies, strict=True):
            pipe.xadd(KEYS.queue(embedder.queue), {"id": request_id, "json": json.dumps(body)})
        pipe.execute()
    outputs = Outputs(r)
    for request_id, body in zip(ids, bodies, strict=True):
        [done] = outputs.of(request_id)
        inputs = [body["input"]] if isinstance(body["input"], str) else body["input"]
        assert isinstance(done, Done) and done.finish_reason == "stop" and done.text == "", done
        assert len(done.embeddings) == len(inputs)
        for text, vector in zip(inputs, done.embeddings, strict=True):
            assert close(vector, in_process(text)), text
        tokens = sum(len(t) if isinstance(t, list) else len(in_process.tokenizer(t)["input_ids"]) for t in inputs)
        assert done.usage.prompt_tokens == tokens and done.usage.completion_tokens == 0


def test_the_openai_sdk_gets_floats_base64_and_matryoshka_dimensions(gateway, embedder, in_process):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=60) as sdk:
        floats = sdk.embeddings.create(model=embedder.queue, input=TEXTS[:3], encoding_format="float")
        decoded = sdk.embeddings.create(model=embedder.queue, input=TEXTS[:3])  # the SDK asks base64 and decodes
        raw = sdk.embeddings.create(model=embedder.queue, input=TEXTS[:3], encoding_format="base64")
        short = sdk.embeddings.create(model=embedder.queue, input=TEXTS[:3], dimensions=16)
        one = sdk.embeddings.create(model=embedder.queue, input="json")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == embedder.queue
    full = [in_process(t) for t in TEXTS[:3]]
    assert all(close(d.embedding, v) for d, v in zip(floats.data, full, strict=True))
    assert all(close(list(d.embedding), v) for d, v in zip(decoded.data, full, strict=True))
    for d, v in zip(raw.data, full, strict=True):
        data = base64.b64decode(d.embedding)
        assert close(list(struct.unpack(f"<{len(data) // 4}f", data)), v)
    assert all(len(d.embedding) == 16 and close(d.embedding, cut(v, 16)) for d, v in zip(short.data, full, strict=True))
    assert close(one.data[0].embedding, in_process("json"))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(
        len(in_process.tokenizer(t)["input_ids"]) for t in TEXTS[:3])


def test_rerank_orders_documents_by_the_model_s_scores(gateway, reranker, scores_in_process):
    expected = sorted(((i, scores_in_process(QUERY, d)) for i, d in enumerate(DOCUMENTS)), key=lambda p: -p[1])
    reply = httpx.post(f"{gateway.url}/v1/rerank", timeout=60, json={
        "model": reranker.queue, "query": QUERY, "documents": [DOCUMENTS[0], *({"text": d} for d in DOCUMENTS[1:])],
        "top_n": 3, "return_documents": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [r["index"] for r in body["results"]] == [i for i, _ in expected[:3]]
    for result, (index, score) in zip(body["results"], expected, strict=False):
        assert abs(result["relevance_score"] - score) <= TOLERANCE
        assert result["document"] == {"text": DOCUMENTS[index]}
    assert body["usage"]["total_tokens"] > 0
    with Client(reranker.redis_url, queue=reranker.queue) as client:
        ranked = client.rerank(QUERY, DOCUMENTS, timeout=60)
    assert [(r.index, round(r.relevance_score, 5)) for r in ranked] == [(i, round(s, 5)) for i, s in expected]


def test_a_cross_encoder_scores_each_pair_as_it_does_alone(cross_encoder, cross_encoder_model):
    """Query and document as one pair encoding (segments 0 and 1), right-padded in a
    shared pass: each score equals the model's on that pair alone."""
    import mlx.core as mx
    from mlx_vlm.reranker_loader import load_reranker

    model, tokenizer = load_reranker(str(cross_encoder_model))

    def alone(document: str) -> float:
        pair = tokenizer(QUERY, document)
        logits = model(mx.array([pair["input_ids"]]), token_type_ids=mx.array([pair["token_type_ids"]])).logits
        return float(mx.sigmoid(logits.reshape(-1))[0].item())

    expected = sorted(((i, alone(d)) for i, d in enumerate(DOCUMENTS)), key=lambda p: -p[1])
    with Client(cross_encoder.redis_url, queue=cross_encoder.queue) as client:
        ranked = client.rerank(QUERY, DOCUMENTS, timeout=60)
        long = client.rerank(QUERY, ["queue " * 600, "json"], truncate=True, timeout=60)
        with pytest.raises(JobFailed, match="cross-encoder; it takes none"):
            client.rerank(QUERY, DOCUMENTS, instruction="judge", timeout=60)
        with pytest.raises(JobFailed, match="documents 0: with the query, .* tokens is above"):
            client.rerank(QUERY, ["queue " * 600], timeout=60)
    assert [r.index for r in ranked] == [i for i, _ in expected]
    assert all(abs(r.relevance_score - s) <= TOLERANCE for r, (_, s) in zip(ranked, expected, strict=True))
    assert sorted(r.index for r in long) == [0, 1]


def test_the_client_and_mlxq_submit_embed(embedder, in_process):
    with Client(embedder.redis_url, queue=embedder.queue) as client:
        vectors = client.embed(TEXTS[:2], timeout=60)
        short = client.embed("json", dimensions=8, timeout=60)
        with pytest.raises(RequestRejected, match="input: give at least one input"):
            client.embed([])
    assert all(close(v, in_process(t)) for v, t in zip(vectors, TEXTS, strict=False))
    assert close(short[0], cut(in_process("json"), 8))
    printed = subprocess.run([*MLXQ, "submit", "--redis-url", embedder.redis_url, "--queue", embedder.queue,
                              "--embed", "json", "--dimensions", "8", "--timeout", "60"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert close(json.loads(printed.stdout), short[0])


def hostile_bodies(vocab: int) -> dict[str, object]:
    return {
        "an empty list": {"input": []},
        "an empty string": {"input": ["ok", ""]},
        "100,000 inputs": {"input": ["a"] * 100_000},
        "a 10 MB string": {"input": "a" * 10_000_000},
        "a number": {"input": 5},
        "a mixed list": {"input": ["a", 1]},
        "a negative token id": {"input": [[1, -2]]},
        "a token id past the vocabulary": {"input": [[1, vocab + 5]]},
        "a generation body": {"prompt": "hello", "max_tokens": 3},
        "dimensions 0": {"input": "a", "dimensions": 0},
        "dimensions past the model's": {"input": "a", "dimensions": 100_000},
        "an unknown encoding_format": {"input": "a", "encoding_format": "int8"},
        "an unknown field": {"input": "a", "pooling": "mean"},
        "a rerank body": {"query": "q", "documents": ["d"]},
    }


def test_hostile_inputs_are_answered_with_errors_and_the_worker_serves_on(embedder, in_process, r):
    outputs = Outputs(r)
    bodies = hostile_bodies(len(in_process.tokenizer))
    answers = {}
    for what, body in bodies.items():
        request_id = f"bad-{uuid.uuid4().hex[:8]}"
        xadd_json(r, embedder.queue, request_id, body)
        [answers[what]] = outputs.of(request_id)
    for what, answer in answers.items():
        assert isinstance(answer, Error) and answer.code in ("invalid_request", "too_large"), (what, answer)
    assert "max_body_bytes" in answers["a 10 MB string"].message
    assert "100000 inputs" in answers["100,000 inputs"].message
    assert "serves embed, not generation" in answers["a generation body"].message
    assert embedder.process.poll() is None
    with Client(embedder.redis_url, queue=embedder.queue) as client:
        assert close(client.embed("json", timeout=60)[0], in_process("json"))


def test_a_long_input_is_refused_unless_the_request_asks_to_truncate(embedder, in_process, r):
    long = " ".join(["queue"] * 3000)  # past the demo model's 2,048 tokens
    with Client(embedder.redis_url, queue=embedder.queue) as client:
        job = client.submit(input=[long, "json"])
        with pytest.raises(JobFailed, match=r"input 0: \d+ tokens is above this model's limit \(2048\); .*truncate"):
            job.result(timeout=60)
        done = client.submit(input=[long, "json"], truncate=True).result(timeout=60)
    ids = in_process.tokenizer(long, truncation=True, max_length=2048)["input_ids"]
    assert len(ids) == 2048 and ids[-1] == in_process.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert done.usage.prompt_tokens == 2048 + len(in_process.tokenizer("json")["input_ids"])
    assert close(done.embeddings[0], in_process(ids))


def test_the_gateway_refuses_bad_bodies_and_the_wrong_kind_of_model(gateway, embedder, reranker):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=60) as sdk:
        with pytest.raises(openai.BadRequestError, match="serves embed"):
            sdk.chat.completions.create(model=embedder.queue, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="serves rerank"):
            sdk.embeddings.create(model=reranker.queue, input="hi")
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            sdk.embeddings.create(model=embedder.queue, input="hi", dimensions=100_000)
    reply = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": embedder.queue, "input": {"a": 1}}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        reply = httpx.post(f"{gateway.url}{path}", json={"model": reranker.queue, "query": "q", "documents": []},
                           timeout=60)
        assert reply.status_code == 400 and "documents" in reply.json()["error"]["message"]


def test_a_batch_of_embedding_lines(gateway, embedder, in_process):
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": embedder.queue, "input": text}} for i, text in enumerate(TEXTS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": embedder.queue, "input": "x", "dimensions": 0}})
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=60) as sdk:
        upload = sdk.files.create(file=("lines.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                  purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (len(TEXTS), 1)
        output = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    for line, text in zip(output, TEXTS, strict=True):
        assert line["response"]["status_code"] == 200
        assert close(line["response"]["body"]["data"][0]["embedding"], in_process(text)), line["custom_id"]
    assert [e["custom_id"] for e in errors] == ["bad"]


def test_the_heartbeat_names_the_task(embedder, reranker, r: redis.Redis):
    from client.heartbeat import Heartbeat

    tasks = {Heartbeat.from_json(r.get(KEYS.worker(w.consumer))).model.task for w in (embedder, reranker)}
    assert tasks == {"embed", "rerank"}
