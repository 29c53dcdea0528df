"""Tenants: keys made with `mlxq keys` and stored in Redis, each reaching only its own
tenant's files, batches and models, under limits every gateway shares; bodies bounded
while they arrive. Real gateways, a real worker, real Valkey, the official SDK."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import openai
import pytest
import redis
import redis.asyncio as aioredis
from support import (
    HELD,
    KEYS,
    MLXQ,
    ROOT,
    own_valkey_fixture,
    start_gateway,
    start_worker,
    wait_for,
    worker_fixture,
)

from client.keys import Keys
from gateway.errors import ApiError
from gateway.quotas import Quotas, rate_limit_storage
from gateway.tenants import Caller, KeyRecord

ADMIN_KEY = "sk-admin-test"


own_valkey = own_valkey_fixture("tenants")


worker = worker_fixture(queue="team", redis="own_valkey")


@pytest.fixture(scope="module")
def gateways(own_valkey, worker, logs_dir):
    """Two gateways on the same Redis, each with the admin key configured."""
    started = [start_gateway(own_valkey, logs_dir, "--api-keys", ADMIN_KEY, "--batch-lease-s", "2",
                             "--max-body-bytes", str(16 * 1024 * 1024), "--max-file-bytes", str(1024 * 1024))
               for _ in range(2)]
    yield started
    for gateway in started:
        gateway.stop()


def make_key(redis_url: str, tenant: str, *flags: str) -> dict:
    made = subprocess.run([*MLXQ, "keys", "create", "--redis-url", redis_url, "--tenant", tenant, "--json", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def upload(api: openai.OpenAI, queue: str) -> str:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": queue, "prompt": "Hi", "max_tokens": 3}}
    return api.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch").id


def test_keys_are_shown_once_listed_without_the_key_and_stored_as_a_hash(own_valkey):
    made = make_key(own_valkey, "listing", "--rpm", "5", "--models", "a,b")
    assert made["key"].startswith("sk-mlxq-") and made["tenant"] == "listing" and made["models"] == ["a", "b"]
    listed = subprocess.run([*MLXQ, "keys", "list", "--redis-url", own_valkey], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert made["id"] in listed.stdout and "rpm=5" in listed.stdout and made["key"] not in listed.stdout
    r = redis.Redis.from_url(own_valkey)
    stored = b"".join(k + v for k, v in r.hgetall(KEYS.api_keys).items())
    assert made["key"].encode() not in stored
    refused = subprocess.run([*MLXQ, "keys", "create", "--redis-url", own_valkey, "--tenant", "no spaces"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "tenant" in refused.stderr and "Traceback" not in refused.stderr
    posing = subprocess.run([*MLXQ, "keys", "create", "--redis-url", own_valkey, "--tenant", "admin"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)  # the admins' tenant owns what they made
    assert posing.returncode == 2 and "the admins' own" in posing.stderr


def test_another_tenant_s_files_batches_and_models_are_not_found(own_valkey, gateways, worker, demo_model):
    """Tenant B, with its own key, sees nothing of A's and calls none of A's models; A's
    own calls work; the admin key sees both."""
    owner = sdk(gateways[0], make_key(own_valkey, "alpha", "--models", worker.queue)["key"])
    other = sdk(gateways[1], make_key(own_valkey, "beta", "--models", "elsewhere")["key"])
    file_id = upload(owner, worker.queue)
    batch = owner.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: owner.batches.retrieve(batch.id).status == "completed", timeout=60, what="the batch")
    output_id = owner.batches.retrieve(batch.id).output_file_id
    assert owner.files.content(output_id).content.count(b"\n") == 1
    assert [f.id for f in owner.files.list()] == [file_id]

    assert file_id not in [f.id for f in other.files.list()]
    assert batch.id not in [b.id for b in other.batches.list()]
    for attempt in (lambda: other.files.retrieve(file_id), lambda: other.files.content(file_id),
                    lambda: other.files.delete(file_id), lambda: other.files.content(output_id),
                    lambda: other.files.retrieve(output_id), lambda: other.batches.retrieve(batch.id),
                    lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.NotFoundError) as refused:
        other.completions.create(model=worker.queue, prompt="Hi", max_tokens=2)
    assert refused.value.code == "model_not_found"
    assert other.models.list().data == [] and [m.id for m in owner.models.list()] == [str(demo_model)]
    refused_batch = other.batches.create(input_file_id=upload(other, worker.queue), endpoint="/v1/completions",
                                         completion_window="24h")  # fails validation, as OpenAI's would
    assert refused_batch.status == "failed" and refused_batch.errors.data[0].code == "model_not_found"
    admin = sdk(gateways[1], ADMIN_KEY)
    assert file_id in [f.id for f in admin.files.list()] and admin.batches.retrieve(batch.id).id == batch.id
    owner.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        owner.files.retrieve(file_id)


def test_rate_limits_are_shared_by_two_gateways(own_valkey, gateways, worker):
    key = make_key(own_valkey, "rated", "--rpm", "2")["key"]
    first, second = (httpx.Client(base_url=f"{g.url}/v1", headers={"authorization": f"Bearer {key}"}, timeout=60)
                     for g in gateways)
    body = {"model": worker.queue, "prompt": "Hi", "max_tokens": 2}
    assert first.post("/completions", json=body).status_code == 200
    assert second.post("/completions", json=body).status_code == 200
    refused = first.post("/completions", json=body)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert second.post("/completions", json=body).status_code == 429
    first.close()
    second.close()


async def test_a_rate_limit_lifts_once_its_window_has_moved_on(own_valkey):
    """The gateway's own `Quotas` on the same Redis, with a 2-second window where the
    gateway's is a minute (the same code, a window a test can wait out)."""
    connection = aioredis.from_url(own_valkey)
    keys = Keys()
    quotas = Quotas(connection, keys, rate_limit_storage(own_valkey, connection, keys), lease_s=60, window_s=2)
    caller = Caller("rated", KeyRecord(id=f"key_{uuid.uuid4().hex[:12]}", tenant="rated", rpm=2))
    try:
        for _ in range(2):
            await quotas.admit(caller, uuid.uuid4().hex)
        with pytest.raises(ApiError) as refused:
            await quotas.admit(caller, uuid.uuid4().hex)
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] in {"1", "2"}
        deadline = asyncio.get_running_loop().time() + 30  # fifteen windows: a limit that never lifts fails
        while True:  # the window moves on by itself: no test can make it sooner
            try:
                await quotas.admit(caller, uuid.uuid4().hex)
                break
            except ApiError:
                assert asyncio.get_running_loop().time() < deadline, "the limit never lifted"
                await asyncio.sleep(0.2)
    finally:
        await connection.aclose()


def test_tokens_per_minute_count_what_requests_used(own_valkey, gateways, worker):
    api = sdk(gateways[0], make_key(own_valkey, "tokens", "--tpm", "20")["key"])
    done = api.completions.create(model=worker.queue, prompt="Tell me about queues", max_tokens=16)
    assert done.usage.total_tokens > 20
    with pytest.raises(openai.RateLimitError) as refused:
        sdk(gateways[1], api.api_key).completions.create(model=worker.queue, prompt="Hi", max_tokens=2)
    assert "tokens" in refused.value.message and refused.value.response.headers["x-ratelimit-limit-tokens"] == "20"


def test_a_key_s_concurrency_is_bounded_across_gateways(own_valkey, gateways, worker):
    key = make_key(own_valkey, "one-at-a-time", "--max-concurrency", "1")["key"]
    headers = {"authorization": f"Bearer {key}"}
    held = {"model": worker.queue, "prompt": HELD["prompt_tokens"], "max_tokens": HELD["max_tokens"], "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{gateways[0].url}/v1/completions", json=held,
                                                       headers=headers) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped iterator closes the connection, which cancels
        next(lines)  # it runs (until cancelled: it cannot end within the test)
        busy = http.post(f"{gateways[1].url}/v1/completions", headers=headers,
                         json={"model": worker.queue, "prompt": "Hi", "max_tokens": 2})
        assert busy.status_code == 429 and "max_concurrency" in busy.json()["error"]["message"]
    # the stream closed: its request is cancelled and its lease given back
    wait_for(lambda: httpx.post(f"{gateways[1].url}/v1/completions", headers=headers, timeout=60,
                                json={"model": worker.queue, "prompt": "Hi", "max_tokens": 2}).status_code == 200,
             what="the lease to come back")


def test_a_user_key_s_priority_is_clamped_to_its_best(own_valkey, gateways, worker):
    key = make_key(own_valkey, "eager", "--max-priority", "3")["key"]
    r = redis.Redis.from_url(own_valkey)
    with ThreadPoolExecutor(1) as pool:  # reads the queue as entries arrive (the worker deletes what it finished)
        arriving = pool.submit(r.xread, {KEYS.queue(worker.queue): "$"}, count=1, block=30_000)
        wait_for(lambda: any(c["cmd"] == "xread" for c in r.client_list()), what="the reader to block")
        answered = httpx.post(f"{gateways[0].url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                              json={"model": worker.queue, "prompt": "Hi", "max_tokens": 2, "priority": -(2**31)},
                              timeout=60)
        assert answered.status_code == 200
        [(_, [(_, sent)])] = arriving.result()
    assert sent[b"id"].decode() == answered.headers["x-request-id"]
    assert msgpack.unpackb(sent[b"msgpack"])["priority"] == 3
    r.close()


def test_revoking_a_key_reaches_both_gateways(own_valkey, gateways, worker):
    made = make_key(own_valkey, "leaving")
    for gateway in gateways:
        assert sdk(gateway, made["key"]).models.list().data
    revoked = subprocess.run([*MLXQ, "keys", "revoke", made["id"], "--redis-url", own_valkey], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    for gateway in gateways:
        wait_for(lambda g=gateway: httpx.get(f"{g.url}/v1/models", timeout=10,
                                             headers={"authorization": f"Bearer {made['key']}"}).status_code == 401,
                 timeout=10, what="the revoke to reach the gateway")


def test_the_files_budget_counts_a_tenant_s_files_and_batch_lines(own_valkey, gateways, worker):
    api = sdk(gateways[0], make_key(own_valkey, "small-budget", "--files-budget", "600")["key"])
    file_id = upload(api, worker.queue)  # ~120 bytes
    api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.APIStatusError) as refused:
        for _ in range(10):
            upload(api, worker.queue)
    assert refused.value.status_code == 413 and "files budget" in refused.value.message


def test_active_batches_per_tenant_are_capped(own_valkey, gateways, worker):
    api = sdk(gateways[0], make_key(own_valkey, "batcher", "--max-batches", "1")["key"])
    file_id = upload(api, worker.queue)
    api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError) as refused:
        api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    assert refused.value.code == "batch_limit_reached"


# ---- bodies bounded while they arrive ----------------------------------------------


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def chunks(total: int, head: bytes = b"", tail: bytes = b"") -> Iterator[bytes]:
    yield head
    block = b"x" * (1024 * 1024)
    for _ in range(total // len(block)):
        yield block
    yield tail


def send(url: str, content: Iterator[bytes], headers: dict[str, str]) -> int | None:
    """The status the gateway answered, or None if it closed the connection while the body came."""
    try:
        return httpx.post(url, content=content, headers=headers, timeout=120).status_code
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return None


def test_a_300_mb_chunked_body_and_a_260_mb_upload_are_refused_as_they_arrive(gateways):
    gateway = gateways[0]
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    before = peak_rss_mb(gateway.process.pid)
    status = send(f"{gateway.url}/v1/chat/completions", chunks(300 * 1024 * 1024, b'{"model": "x", "pad": "'),
                  {**auth, "content-type": "application/json"})
    assert status in (413, None)
    boundary = uuid.uuid4().hex
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    status = send(f"{gateway.url}/v1/files", chunks(260 * 1024 * 1024, head, f"\r\n--{boundary}--\r\n".encode()),
                  {**auth, "content-type": f"multipart/form-data; boundary={boundary}"})
    assert status in (413, None)
    assert peak_rss_mb(gateway.process.pid) - before < 64
    small = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth, timeout=60,
                       content=chunks(20 * 1024 * 1024, b'{"model": "x", "pad": "', b'"}'))
    assert small.status_code == 413 and small.json()["error"]["code"] == "too_large"


def test_one_tenant_s_large_batch_does_not_hold_back_another_s_small_one(own_valkey, gateways, demo_model, logs_dir):
    """Two slots, tenant A's 40-line batch created first, tenant B's 4-line one after: B's
    batch ends while most of A's lines still wait (each batch keeps only its share of the
    queue's slots in flight, so B's lines queue behind a few of A's, not all of them)."""
    queue = f"fair{uuid.uuid4().hex[:6]}"
    small = start_worker(own_valkey, demo_model, queue, logs_dir, max_num_seqs=2)
    try:
        big_api, small_api = (sdk(gateways[0], make_key(own_valkey, tenant)["key"]) for tenant in ("big", "little"))

        def batch(api: openai.OpenAI, lines: int) -> str:
            content = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {
                "model": queue, "prompt": f"Line {i}", "max_tokens": 150, "ignore_eos": True}}) + "\n"
                for i in range(lines))
            file_id = api.files.create(file=("in.jsonl", io.BytesIO(content.encode())), purpose="batch").id
            return api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h").id

        big = batch(big_api, 40)
        wait_for(lambda: big_api.batches.retrieve(big).status == "in_progress", what="the big batch to start")
        little = batch(small_api, 4)
        wait_for(lambda: small_api.batches.retrieve(little).status == "completed", timeout=120,
                 what="the small batch to complete")
        assert big_api.batches.retrieve(big).request_counts.completed < 30
        wait_for(lambda: big_api.batches.retrieve(big).status == "completed", timeout=300,
                 what="the big batch to complete too")
    finally:
        small.stop()


def test_an_isolating_key_hits_only_the_prefixes_its_own_tenant_cached(own_valkey, gateways, worker):
    """`--isolate-cache` (vLLM's cache_salt, per tenant): the same prompt is a prefix-cache
    hit for the tenant that sent it before, and a miss for another tenant's key, whether
    that one isolates too or not, so no time to first token tells what the other sent."""
    alpha, beta, open_key = (sdk(gateways[0], make_key(own_valkey, tenant, *flags)["key"]) for tenant, flags in
                             (("alpha-c", ["--isolate-cache"]), ("beta-c", ["--isolate-cache"]), ("gamma-c", [])))
    prompt = f"{uuid.uuid4().hex} A shared system prompt, long enough to be worth caching. " * 4

    def cached(api: openai.OpenAI, salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt else None
        done = api.completions.create(model=worker.queue, prompt=prompt, max_tokens=2, extra_body=extra)
        return done.usage.prompt_tokens_details.cached_tokens

    assert cached(alpha) == 0
    assert cached(alpha) > 0, "its own tenant's prefix is a hit"
    assert cached(beta) == 0 and cached(open_key) == 0
    assert cached(open_key, salt="alpha-c:") == 0, "a salt naming another tenant is not that tenant's"
    assert cached(beta) > 0 and cached(open_key) > 0
