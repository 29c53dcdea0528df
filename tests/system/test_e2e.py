"""End to end through a real worker process, real Valkey and real MLX on the demo model."""

from __future__ import annotations

import json
import time

import msgpack
import redis
from support import HELD, KEYS, ON_EACH, Outputs, check_stream, settled, wait_for_deltas, worker_fixture, xadd_json

from client import Client, Delta, Done, Error, Usage
from client.connect import is_cluster_url, parse_cluster_url

pytestmark = ON_EACH
worker = worker_fixture(max_num_seqs=4, prefill_batch_size=2, prefetch=2, max_tokens_limit=2000, default_max_tokens=16)
# Four slots, but only two sequences decoded (and prefilled) together inside BatchGenerator.
narrow_worker = worker_fixture(max_num_seqs=4, completion_batch_size=2, prefill_batch_size=2)



def greedy_text(r: redis.Redis, outputs: Outputs, queue: str, request_id: str, prompt: str, n: int = 40) -> str:
    xadd_json(r, queue, request_id, {"prompt": prompt, "max_tokens": n})
    done = check_stream(outputs.of(request_id))
    assert isinstance(done, Done)
    return done.text


def test_json_request_streams_deltas_that_join_to_the_result(worker, r, outputs, new_id):
    """A JSON request gets contiguous deltas, one `done`, usage and timing, and is acknowledged."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "Hello there", "max_tokens": 20, "metadata": {"user": 7}})
    events = outputs.of(rid)
    done = check_stream(events)
    assert isinstance(done, Done)
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 20
    assert done.usage.prompt_tokens > 0
    assert done.metadata == {"user": 7}
    assert done.text
    assert 0 <= done.timing.queued_ms <= done.timing.ttft_ms <= done.timing.total_ms
    t = done.timing  # the stages, in the order the request went through them
    assert 0 <= t.read_ms <= t.prepared_ms <= t.queued_ms <= t.ttft_ms <= t.published_ms <= t.total_ms
    assert r.ttl(KEYS.output(worker.queue, rid)) > 0, "output streams expire"
    assert settled(r, KEYS.queue(worker.queue))


def test_msgpack_request_gets_msgpack_output(worker, r, outputs, new_id):
    """A msgpack request is answered in msgpack, with the same invariants."""
    rid = new_id()
    body = {"prompt_tokens": [5, 6, 7, 8], "max_tokens": 9, "metadata": {"blob": b"\x00\x01"}}
    r.xadd(KEYS.queue(worker.queue), {"id": rid, "msgpack": msgpack.packb(body, use_bin_type=True)})
    done = check_stream(outputs.of(rid))
    assert isinstance(done, Done)
    assert done.usage == Usage(prompt_tokens=4, completion_tokens=9, cached_tokens=0)
    assert done.metadata == {"blob": b"\x00\x01"}
    raw = r.xrange(KEYS.output(worker.queue, rid))
    assert all(b"msgpack" in fields and b"json" not in fields for _, fields in raw)


def test_output_encoding_can_be_chosen(worker, r, outputs, new_id):
    """`encoding` picks the output format whatever the request's own."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "Hi", "max_tokens": 3, "encoding": "msgpack"})
    check_stream(outputs.of(rid))
    assert all(b"msgpack" in fields for _, fields in r.xrange(KEYS.output(worker.queue, rid)))


def test_max_tokens_one_gives_exactly_one_token(worker, r, outputs, new_id):
    """`max_tokens` 1 yields one token and finish_reason `length`."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "One", "max_tokens": 1})
    events = outputs.of(rid)
    done = check_stream(events)
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert sum(len(e.tokens) for e in events if isinstance(e, Delta)) == 1
    assert done.usage.completion_tokens == 1


def test_chat_messages_use_the_chat_template(worker, r, outputs, new_id):
    """`messages` are rendered with the model's chat template (ChatML on the demo model)."""
    rid = new_id()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    xadd_json(r, worker.queue, rid, {"messages": messages, "max_tokens": 4})
    done = check_stream(outputs.of(rid))
    assert isinstance(done, Done)
    # <|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    plain_id = new_id()
    xadd_json(r, worker.queue, plain_id, {"prompt": "Hi", "max_tokens": 4})
    plain = check_stream(outputs.of(plain_id))
    assert done.usage.prompt_tokens > plain.usage.prompt_tokens + 6


def most_at_once(outputs: Outputs, queue: str, n: int, r: redis.Redis, new_id) -> int:
    """Submit `n` requests at once; the most that were streaming at the same time.

    They share one reply_to stream, which holds the exact order the worker published in."""
    shared = KEYS.reply(queue, new_id())
    ids = [new_id() for _ in range(n)]
    with r.pipeline(transaction=False) as arrival:  # one write: all arrive together, however slow this process
        for i, rid in enumerate(ids):
            body = {"prompt": f"Request number {i}", "max_tokens": 12, "reply_to": shared}
            arrival.xadd(KEYS.queue(queue), {"id": rid, "json": json.dumps(body)})
        arrival.execute()
    for rid in ids:
        check_stream(outputs.events(shared, rid))
    running, most = set(), 0
    for event in outputs.all_on(shared):
        if isinstance(event, Delta):
            running.add(event.id)
        else:
            running.discard(event.id)
        most = max(most, len(running))
    return most


def test_no_more_than_max_num_seqs_run_at_once(worker, r, outputs, new_id):
    """Ten requests at once all finish; never more than max_num_seqs (4) stream together, and 4 do."""
    assert most_at_once(outputs, worker.queue, 10, r, new_id) == 4


def test_more_requests_than_the_completion_batch_all_finish(narrow_worker, r, outputs, new_id):
    """With a completion batch of 2, ten requests at once all finish, decoded two at a time."""
    assert most_at_once(outputs, narrow_worker.queue, 10, r, new_id) == 2


def test_a_request_joins_while_others_decode(worker, redis_url, r, outputs, new_id):
    """A request submitted while two long ones decode starts and finishes before they do."""
    shared = KEYS.reply(worker.queue, new_id())
    long_ids = start_long_requests(r, worker.queue, 2, shared, new_id)
    short = new_id("short")
    xadd_json(r, worker.queue, short, {"prompt": "Quick", "max_tokens": 5, "reply_to": shared})
    check_stream(outputs.events(shared, short))
    with Client(redis_url, queue=worker.queue) as client:
        for rid in long_ids:
            client.cancel(rid)
            check_stream(outputs.events(shared, rid))
    order = [(type(e).__name__, e.id) for e in outputs.all_on(shared)]
    short_done = order.index(("Done", short))
    assert all(order.index(("Done", rid)) > short_done for rid in long_ids)
    assert all(order.index(("Delta", rid)) < order.index(("Delta", short)) for rid in long_ids)


def start_long_requests(r: redis.Redis, queue: str, n: int, reply_to: str, new_id) -> list[str]:
    """Submit `n` requests sharing `reply_to` that run until cancelled; return once each
    has streamed a delta."""
    ids = [new_id("long") for _ in range(n)]
    for rid in ids:
        xadd_json(r, queue, rid, {**HELD, "reply_to": reply_to})  # runs until cancelled
    wait_for_deltas(r, reply_to, ids)
    return ids


def test_greedy_output_is_unaffected_by_a_hot_neighbour(worker, r, outputs, new_id):
    """A greedy request gives the same text alone and beside a temperature-1.5 request."""
    prompt = "The weather today is"
    alone = greedy_text(r, outputs, worker.queue, new_id(), prompt)
    greedy, hot = new_id("greedy"), new_id("hot")
    xadd_json(r, worker.queue, hot, {"prompt": prompt, "max_tokens": 40, "temperature": 1.5, "seed": 3})
    xadd_json(r, worker.queue, greedy, {"prompt": prompt, "max_tokens": 40})
    hot_done = check_stream(outputs.of(hot))
    assert check_stream(outputs.of(greedy)).text == alone
    assert hot_done.text != alone, "the hot request really sampled"


def test_identical_greedy_prompts_together_give_identical_outputs(worker, r, outputs, new_id):
    """Four identical greedy prompts submitted together produce the same text."""
    ids = [new_id() for _ in range(4)]
    for rid in ids:
        xadd_json(r, worker.queue, rid, {"prompt": "Same prompt", "max_tokens": 30})
    texts = {check_stream(outputs.of(rid)).text for rid in ids}
    assert len(texts) == 1


def test_a_seed_makes_sampling_repeatable(worker, r, outputs, new_id):
    """Two requests with the same seed and temperature sample the same text, whatever runs beside them."""
    body = {"prompt": "Roll the dice", "max_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": 42}
    first, second, other = new_id(), new_id(), new_id()
    xadd_json(r, worker.queue, first, body)
    first_text = check_stream(outputs.of(first)).text
    xadd_json(r, worker.queue, other, {**body, "seed": 7})
    xadd_json(r, worker.queue, second, body)
    assert check_stream(outputs.of(second)).text == first_text
    assert check_stream(outputs.of(other)).text != first_text


def test_stop_strings_cut_the_output(worker, r, outputs, new_id):
    """A stop string ends the request with `stop` and is not part of the text."""
    prompt = "Stop me if you can"
    full = greedy_text(r, outputs, worker.queue, new_id(), prompt, n=60)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": prompt, "max_tokens": 60, "stop": ["\u2603 never", stop]})
    done = check_stream(outputs.of(rid))
    assert done.finish_reason == "stop"
    assert done.text == expected


def test_stream_intervals_give_the_same_text(worker, r, outputs, new_id):
    """stream_interval 1, 3 and 7 coalesce tokens differently but join to the same text;
    every delta but the last carries at least the interval's tokens (more when the
    worker's flush interval joined several steps)."""
    texts = set()
    for interval in (1, 3, 7):
        rid = new_id()
        xadd_json(r, worker.queue, rid, {"prompt": "Interval", "max_tokens": 20, "stream_interval": interval})
        events = outputs.of(rid)
        done = check_stream(events)
        deltas = [e for e in events if isinstance(e, Delta)]
        assert all(len(d.tokens) >= interval for d in deltas[:-1])
        assert len(deltas[0].tokens) == interval  # the first delta waits for its tokens, not for a flush
        assert 1 <= len(deltas) <= -(-20 // interval)
        texts.add(done.text)
    assert len(texts) == 1


def test_cancel_a_running_request_frees_its_slot(worker, redis_url, r, outputs, new_id):
    """Cancelling one of four running requests ends it `cancelled`, and a new request takes its slot."""
    shared = KEYS.reply(worker.queue, new_id())
    long_ids = start_long_requests(r, worker.queue, 4, shared, new_id)
    client = Client(redis_url, queue=worker.queue)
    client.cancel(long_ids[0])
    cancelled = check_stream(outputs.events(shared, long_ids[0]))
    assert cancelled.finish_reason == "cancelled"
    assert 0 < cancelled.usage.completion_tokens < HELD["max_tokens"]
    newcomer = new_id("new")
    xadd_json(r, worker.queue, newcomer, {"prompt": "Me too", "max_tokens": 5, "reply_to": shared})
    assert check_stream(outputs.events(shared, newcomer)).finish_reason == "length"
    for rid in long_ids[1:]:
        client.cancel(rid)
        assert check_stream(outputs.events(shared, rid)).finish_reason == "cancelled"
    client.close()


def test_a_cancel_published_through_any_node_stops_the_request(worker, redis_url, r, outputs, new_id):
    """A classic PUBLISH reaches every node of a cluster: a cancel published through any
    node (here with no flag, so the message alone must do it) stops a running request."""
    shared = KEYS.reply(worker.queue, new_id())
    nodes = [f"redis://{h}:{p}" for h, p in parse_cluster_url(redis_url).nodes] if is_cluster_url(redis_url) else [
        redis_url]
    for node_url in nodes:
        (rid,) = start_long_requests(r, worker.queue, 1, shared, new_id)
        with redis.Redis.from_url(node_url) as node:
            node.publish(KEYS.cancel_channel(worker.queue), rid)
        assert check_stream(outputs.events(shared, rid)).finish_reason == "cancelled"


def test_cancel_before_start_is_never_computed(worker, redis_url, r, outputs, new_id):
    """A request cancelled while it waits, or before it is read, ends `cancelled` with no deltas."""
    client = Client(redis_url, queue=worker.queue)
    flagged = new_id("flagged")
    client.cancel(flagged)  # the flag is set before the request exists
    xadd_json(r, worker.queue, flagged, {"prompt": "Never", "max_tokens": 5})
    events = outputs.of(flagged)
    assert len(events) == 1 and events[0].finish_reason == "cancelled"
    assert events[0].usage.completion_tokens == 0

    long_ids = [new_id("long") for _ in range(4)]
    for rid in long_ids:
        xadd_json(r, worker.queue, rid, HELD)  # four slots taken until cancelled
    waiting = new_id("waiting")
    xadd_json(r, worker.queue, waiting, {"prompt": "Waiting", "max_tokens": 5})
    for rid in long_ids:
        wait_for_deltas(r, KEYS.output(worker.queue, rid), [rid])
    client.cancel(waiting)
    events = outputs.of(waiting)
    assert [type(e) for e in events] == [Done] and events[0].finish_reason == "cancelled"
    for rid in long_ids:
        client.cancel(rid)
        check_stream(outputs.of(rid))
    client.close()


def test_deadline_in_the_past_is_an_error_without_compute(worker, r, outputs, new_id):
    """A request whose deadline already passed gets `deadline_exceeded` and no deltas."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "Late", "deadline_ms": int(time.time() * 1000) - 1000})
    events = outputs.of(rid)
    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].code == "deadline_exceeded"


def test_a_repeated_finished_id_is_not_computed_again(worker, r, outputs, new_id):
    """A second entry with an id already finished gets no output and is acknowledged."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "Once", "max_tokens": 5})
    check_stream(outputs.of(rid))
    written = len(r.xrange(KEYS.output(worker.queue, rid)))
    xadd_json(r, worker.queue, rid, {"prompt": "Once", "max_tokens": 5})
    later = new_id()
    xadd_json(r, worker.queue, later, {"prompt": "After", "max_tokens": 5})
    check_stream(outputs.of(later))  # the worker reads in order: the repeat was handled by now
    assert len(r.xrange(KEYS.output(worker.queue, rid))) == written
    assert settled(r, KEYS.queue(worker.queue))


def test_each_finished_request_gets_a_summary_log_line(worker, r, outputs, new_id):
    """The worker logs one line per finished request with its id, tokens, TTFT and tok/s."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "Log me", "max_tokens": 8})
    check_stream(outputs.of(rid))
    for _ in range(50):
        lines = [json.loads(line) for line in worker.log().splitlines() if rid in line]
        if lines:
            break
        time.sleep(0.05)
    (line,) = [x for x in lines if x["event"] == "request finished"]
    assert line["completion_tokens"] == 8 and line["ttft_ms"] > 0 and line["tok_s"] > 0
