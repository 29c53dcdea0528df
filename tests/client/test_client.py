"""The client SDK, sync and async, against a real worker."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from support import HELD, KEYS, ON_BOTH, free_port, worker_fixture

import client
from client import AsyncClient, Client, Delta, Done, JobCancelled, JobFailed, JobTimeout, RequestRejected

worker = worker_fixture(max_num_seqs=4)


@pytest.fixture
def sync_client(worker):
    with Client(worker.redis_url, queue=worker.queue) as c:
        yield c


def test_public_names():
    """The package exports exactly its documented API."""
    assert set(client.__all__) == {
        "DEFAULT_URL", "GROUP", "AsyncBatchHandle", "AsyncClient", "AsyncJob", "Batch", "BatchHandle", "Client",
        "LineResult", "Delta", "Done", "Error", "ErrorCode", "Event",
        "Job", "JobCancelled", "JobFailed", "JobTimeout", "Keys", "MlxqError", "QueueFull", "Ranked", "RedisFailed",
        "RedisUnavailable", "RequestRejected",
        "Timing",
        "TokenLogprob", "TopLogprob", "Undeliverable", "Usage", "decode_event", "encode_event", "encode_request"}


def test_a_redis_nobody_answers_is_an_mlxq_error_from_both_clients():
    """redis-py's errors become the client's at its one boundary, sync and async alike
    (and code that catches redis-py's ConnectionError still catches them)."""

    url = f"redis://127.0.0.1:{free_port()}"
    with Client(url) as c:
        with pytest.raises(client.RedisUnavailable) as sync_error:
            c.submit("x")
        with pytest.raises(client.RedisUnavailable):
            c.cancel("some-id")
    assert isinstance(sync_error.value, redis.ConnectionError)

    async def submit() -> None:
        async with AsyncClient(url) as c:
            await c.submit("x")

    with pytest.raises(client.MlxqError):
        asyncio.run(submit())


def test_a_client_never_closed_leaks_no_connection(worker):
    """`Client(url).cancel(id)` in one line: the client's connections and event loop go
    when it is collected (an unclosed connection would warn, and warnings fail the suite)."""
    import gc

    Client(worker.redis_url, queue=worker.queue).cancel("nobody-runs-this")
    job = Client(worker.redis_url, queue=worker.queue).submit("Hi", max_tokens=2)
    assert job.result(timeout=60).finish_reason == "length"
    del job
    gc.collect()


def test_every_error_the_client_raises_is_an_mlxq_error():
    """The helpers and the clients raise only `MlxqError`s, with the request id where there is one."""
    with pytest.raises(client.MlxqError):
        client.encode_request("bad id!", {"prompt": "x"})
    assert issubclass(client.JobTimeout, client.MlxqError) and issubclass(client.JobTimeout, TimeoutError)
    assert client.JobTimeout("r-1", 2.0).request_id == "r-1"
    assert all(issubclass(getattr(client, name), client.MlxqError) for name in client.__all__
               if isinstance(getattr(client, name), type) and issubclass(getattr(client, name), Exception))
    assert all(hasattr(client, name) for name in client.__all__)


def test_generate_returns_the_result(sync_client):
    """`generate` submits and waits in one call."""
    done = sync_client.generate("Hello", max_tokens=6, metadata={"k": "v"}, timeout=30)
    assert isinstance(done, Done)
    assert done.usage.completion_tokens == 6 and done.metadata == {"k": "v"}


def test_stream_yields_deltas_then_result_returns_the_same_text(sync_client):
    """`stream` yields deltas whose joined text equals `result().text`."""
    job = sync_client.submit("Stream it", max_tokens=12, id=f"sync-{uuid.uuid4().hex}")
    deltas = list(job.stream(timeout=30))
    assert all(isinstance(d, Delta) for d in deltas)
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert "".join(d.text for d in deltas) == job.result(timeout=5).text


def test_chat_messages_and_msgpack(sync_client):
    """`messages` and the msgpack encoding go through the same API."""
    done = sync_client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=3, encoding="msgpack",
                                timeout=30)
    assert done.usage.completion_tokens == 3


@ON_BOTH
def test_reply_to_lets_one_reader_follow_many_requests(sync_client):
    """Jobs sharing a reply_to stream each see only their own events; `events` sees all."""
    reply_to = sync_client.keys.reply(sync_client.queue, uuid.uuid4().hex)
    jobs = [sync_client.submit(f"Prompt {i}", max_tokens=4 + i, reply_to=reply_to) for i in range(3)]
    results = [job.result(timeout=30) for job in jobs]
    assert [r.usage.completion_tokens for r in results] == [4, 5, 6]
    assert [r.id for r in results] == [job.id for job in jobs]
    terminal_ids = []
    for _, event in sync_client.events(reply_to):
        if not isinstance(event, Delta):
            terminal_ids.append(event.id)
        if len(terminal_ids) == 3:
            break
    assert sorted(terminal_ids) == sorted(job.id for job in jobs)


def _entries_added(client: Client) -> int:
    """How many entries the queue stream was ever given: its length would not do, as the
    worker trims what it has finished at any moment."""
    if not client.redis.exists(KEYS.queue(client.queue)):
        return 0
    return int(client.redis.xinfo_stream(KEYS.queue(client.queue))["entries-added"])


def test_invalid_request_is_rejected_before_sending(sync_client):
    """A request the worker would refuse raises `RequestRejected` and is not queued."""
    before = _entries_added(sync_client)
    with pytest.raises(RequestRejected, match="max_tokens"):
        sync_client.submit("hi", max_tokens=0)
    with pytest.raises(RequestRejected, match="exactly one of"):
        sync_client.submit("hi", prompt_tokens=[1])
    with pytest.raises(RequestRejected, match="invalid id"):
        sync_client.submit("hi", id="has space")
    assert _entries_added(sync_client) == before


def test_submit_many_queues_every_request_in_one_call_or_none(sync_client):
    """Many requests in one call come back as jobs in order, each with its own result;
    one invalid request sends none of them, and says which it was."""
    jobs = sync_client.submit_many([{"prompt": f"Bulk {i}", "max_tokens": 3 + i} for i in range(3)]
                                   + [{"id": "bulk-named", "messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 2}])
    assert jobs[-1].id == "bulk-named"
    assert [job.result(timeout=60).usage.completion_tokens for job in jobs] == [3, 4, 5, 2]
    before = _entries_added(sync_client)
    with pytest.raises(RequestRejected, match="request 1: .*max_tokens"):
        sync_client.submit_many([{"prompt": "fine"}, {"prompt": "not fine", "max_tokens": 0}])
    assert _entries_added(sync_client) == before
    assert sync_client.submit_many([]) == []


def test_worker_errors_raise_job_failed(sync_client):
    """An `error` event becomes `JobFailed` with its code."""
    with pytest.raises(JobFailed) as failure:
        sync_client.generate(prompt_tokens=[5] * 3000, timeout=30)
    assert failure.value.code == "too_large"


def test_result_times_out(worker):
    """With no worker on the queue, `result(timeout=...)` raises `JobTimeout`."""
    with Client(worker.redis_url, queue=f"nobody-{uuid.uuid4().hex}") as c:
        job = c.submit("anyone?", max_tokens=3)
        with pytest.raises(JobTimeout):
            job.result(timeout=0.3)
        with pytest.raises(TimeoutError):  # JobTimeout is a TimeoutError too
            list(job.stream(timeout=0.3))


@ON_BOTH
def test_cancel_raises_job_cancelled(sync_client):
    """Cancelling a running job ends it; `result` raises `JobCancelled` carrying what was produced."""
    job = sync_client.submit(**HELD)  # runs until cancelled
    stream = job.stream(timeout=30)
    next(stream)
    job.cancel()
    with pytest.raises(JobCancelled) as cancelled:
        list(stream)
    assert cancelled.value.done.finish_reason == "cancelled"
    with pytest.raises(JobCancelled):
        job.result(timeout=5)


@ON_BOTH
async def test_async_client_generate_stream_and_cancel(worker):
    """The async client streams, waits and cancels like the sync one."""
    async with AsyncClient(worker.redis_url, queue=worker.queue) as c:
        done = await c.generate("Async hello", max_tokens=5, timeout=30)
        assert done.usage.completion_tokens == 5

        job = await c.submit("Async stream", max_tokens=10)
        texts = [d.text async for d in job.stream(timeout=30)]
        assert "".join(texts) == (await job.result()).text

        jobs = await asyncio.gather(*(c.submit(f"Together {i}", max_tokens=4) for i in range(3)))
        results = await asyncio.gather(*(j.result(timeout=30) for j in jobs))
        assert all(r.usage.completion_tokens == 4 for r in results)

        long_job = await c.submit(**HELD)  # runs until cancelled
        async for _ in long_job.stream(timeout=30):
            await long_job.cancel()
            break
        with pytest.raises(JobCancelled):
            await long_job.result(timeout=30)


async def test_async_client_errors(worker):
    """The async client raises the same exceptions for rejection, failure and timeout."""
    async with AsyncClient(worker.redis_url, queue=worker.queue) as c:
        with pytest.raises(RequestRejected):
            await c.submit("", max_tokens=3)
        with pytest.raises(JobFailed):
            await c.generate("hi", images=["aGk="], timeout=30)
    async with AsyncClient(worker.redis_url, queue=f"nobody-{uuid.uuid4().hex}") as c:
        job = await c.submit("anyone?")
        with pytest.raises(JobTimeout):
            await job.result(timeout=0.3)


@pytest.mark.parametrize("reply_to", ["mlxq:q:default", "mlxq:out:{someone-else}", "orders:events", "mlxq:reply:",
                                      "mlxq:reply:a b", "mlxq:reply:other-queue:x"])
def test_a_reply_to_outside_mlxq_reply_is_rejected_before_sending(sync_client, reply_to):
    """The client refuses any reply_to but `mlxq:reply:<queue>:<name>` of the request's own
    queue, with the worker's own message."""
    with pytest.raises(RequestRejected, match=f"is not a shared reply stream of queue '{sync_client.queue}'; use "
                       f"'mlxq:reply:{sync_client.queue}:<name>'"):
        sync_client.submit("hi", reply_to=reply_to)
