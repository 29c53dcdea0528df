"""The engine thread's scheduling and lifecycle, with a fake batch backend and no model."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time

import pytest

from client import Delta, Done, Error
from worker.engine.backends import Loaded, ModelInfo, TokenOut
from worker.engine.backends.sim import Letters, SimBackend
from worker.engine.scheduler import GROUP_WAIT_S, Scheduler, SchedulingPolicy, StepPlan
from worker.engine.thread import Engine
from worker.messages import EngineRequest, Queueing, RequestRef, Resume, SamplingParams, StepOutput, Stopping


class CountingBackend(SimBackend):
    """The simulated backend, counting what the engine asks of it; optionally fails a step."""

    def __init__(self, fail_on_step: int | None = None, step_s: float = 0.001) -> None:
        super().__init__(step_s, slots=1_000)
        self.steps = 0
        self.most_running = 0
        self.fail_on_step = fail_on_step
        self.prompts: list[list[int]] = []
        self.plans: list[tuple[int, StepPlan]] = []  # (sequences running, the step's plan)
        self.uids: dict[int, list[int]] = {}  # each sequence's prompt
        self.batches: list[list[list[int]]] = []  # the prompts of each step's sequences

    @property
    def running(self) -> dict[int, list[int]]:
        return self._running

    def insert(self, prompt, max_tokens, sampler, logits_processors, cached=None, media=None, logprobs=False,
               speculative=True, cache_salt="", adapter=0) -> int:
        self.prompts.append(prompt)
        uid = super().insert(prompt, max_tokens, sampler, logits_processors, cached, media, logprobs)
        self.uids[uid] = prompt
        self.most_running = max(self.most_running, len(self._running))
        return uid

    def step(self, plan: StepPlan) -> list[TokenOut]:
        self.plans.append((len(self._running), plan))
        self.batches.append([self.uids[uid] for uid in self._running])
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        return super().step(plan)


def request(rid: str, max_tokens: int = 3, priority: int = 0, deadline_at: float | None = None,
            resume: Resume | None = None, alone: bool = False, prompt: tuple[int, ...] = (1,)) -> EngineRequest:
    return EngineRequest(ref=RequestRef(rid, "1-0"), prompt_tokens=list(prompt), sampling=SamplingParams(),
                         stopping=Stopping(max_tokens),
                         queueing=Queueing(priority, time.time(), deadline_at, alone=alone), resume=resume)


class Harness:
    def __init__(self, max_num_seqs: int = 2, policy: SchedulingPolicy | None = None, **backend_args: object) -> None:
        self.backends: list[CountingBackend] = []
        self.outputs: queue.Queue[StepOutput] = queue.Queue()

        def make_backend() -> CountingBackend:
            rebuilt = {k: v for k, v in backend_args.items() if k != "fail_on_step"}  # only the first one fails
            backend = CountingBackend(**(rebuilt if self.backends else backend_args))  # type: ignore[arg-type]
            self.backends.append(backend)
            return backend

        def load() -> Loaded:
            info = ModelInfo("fake", tokenizer=None, context_length=100, vocab_size=26)
            return Loaded(info, make_backend, Letters)

        self.fatal: list[BaseException] = []
        self.started: list[list[str]] = []
        self.first_tokens: list[str] = []
        self.preparing = 0  # requests the engine is told are on their way
        self.engine = Engine(load, policy or SchedulingPolicy(max_num_seqs), on_output=self.outputs.put,
                             on_fatal=self.fatal.append, on_start=self.started.append,
                             preparing=lambda: self.preparing)
        self.engine.start()
        self.engine.wait_ready(5)

    def shut_down(self, drain_timeout_s: float) -> list[StepOutput]:
        """Shut the engine down; everything it handed out after the last read."""
        self.engine.shutdown(drain_timeout_s)
        assert self.engine.join(5)
        outs = []
        while not self.outputs.empty():
            outs.append(self.outputs.get())
        return outs

    def events_until_terminal(self, ids: set[str], timeout: float = 5) -> dict[str, list]:
        events: dict[str, list] = {i: [] for i in ids}
        deadline = time.monotonic() + timeout
        while any(not evs or isinstance(evs[-1], Delta) for evs in events.values()):
            out = self.outputs.get(timeout=max(0.01, deadline - time.monotonic()))
            self.first_tokens.extend(out.first_tokens)
            for item in out.outgoing:
                events.setdefault(item.event.id, []).append(item.event)
        return events


def test_never_more_than_max_num_seqs_in_the_batch():
    """Five requests with two slots all finish, and at most two are ever in the backend."""
    h = Harness(max_num_seqs=2)
    for i in range(5):
        h.engine.submit(request(f"r{i}"))
    events = h.events_until_terminal({f"r{i}" for i in range(5)})
    assert all(isinstance(evs[-1], Done) and evs[-1].finish_reason == "length" for evs in events.values())
    assert h.backends[0].most_running == 2


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_engine_thread_is_batch_scheduled_and_the_callers_are_not():
    """The engine thread (and so the MLX threads it starts) runs SCHED_BATCH, so that
    handing ops to MLX's stream thread does not switch to it at every op; the thread that
    started the engine (the event loop's, in the worker) keeps its policy."""
    h = Harness()
    assert os.sched_getscheduler(h.engine._thread.native_id) == os.SCHED_BATCH
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


@pytest.mark.parametrize(("interval_s", "tokens_per_delta"), [(0.0, [1] * 6), (3600.0, [1, 5])])
def test_between_flushes_a_running_streams_tokens_go_out_together(interval_s, tokens_per_delta):
    """With a flush interval longer than the request, its first token goes out at once and
    the rest with its end; with none, every step's token goes out as it comes."""
    h = Harness(policy=SchedulingPolicy(2, flush_interval_s=interval_s))
    h.engine.submit(request("r", max_tokens=6))
    events = h.events_until_terminal({"r"})["r"]
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [len(d.tokens) for d in deltas] == tokens_per_delta
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 6


def test_each_step_gets_the_schedulers_plan():
    """The engine core asks its scheduler for each step's prefill: the configured sizes
    while nothing decodes, what the token budget leaves once something does."""
    h = Harness(policy=SchedulingPolicy(4, max_step_tokens=40, prefill_batch_size=8, prefill_step_size=512))
    h.engine.submit(request("first", max_tokens=10**6))
    h.outputs.get(timeout=5)
    h.engine.submit(request("second", max_tokens=1))
    while not any(isinstance(i.event, Done) and i.event.id == "second" for i in h.outputs.get(timeout=5).outgoing):
        pass
    h.engine.cancel("first")
    h.events_until_terminal({"first"})
    plans = h.backends[0].plans
    assert plans[0] == (1, StepPlan(512, 8))  # its prompt alone: nothing decodes yet
    assert (2, StepPlan(39, 2)) in plans  # one decodes: 39 tokens left of 40, two prompts of 16 at most


def test_lower_priority_value_is_admitted_first():
    """With the slots full, a later request of priority -1 starts before earlier priority-0 ones."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("running", max_tokens=10**6))
    h.outputs.get(timeout=5)  # "running" holds the only slot, until cancelled
    h.engine.submit(request("early", max_tokens=1))
    h.engine.submit(request("urgent", max_tokens=1, priority=-1))
    h.engine.cancel("running")  # after both are queued, whatever the thread's pace
    order: list[str] = []
    while len(order) < 3:
        for item in h.outputs.get(timeout=5).outgoing:
            if isinstance(item.event, Done):
                order.append(item.event.id)
    assert order == ["running", "urgent", "early"]


def test_cancel_running_and_waiting_requests():
    """A running request ends `cancelled` with its text so far; a waiting one with nothing."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("running", max_tokens=1000))
    h.engine.submit(request("waiting"))
    first = h.outputs.get(timeout=5).outgoing
    assert [item.event.id for item in first] == ["running"]
    h.engine.cancel("waiting")
    h.engine.cancel("running")
    h.engine.cancel("unknown")
    events = h.events_until_terminal({"running", "waiting"})
    events["running"][:0] = [first[0].event]
    assert [type(e) for e in events["waiting"]] == [Done]
    assert events["waiting"][0].finish_reason == "cancelled"
    done = events["running"][-1]
    assert done.finish_reason == "cancelled"
    assert done.text == "".join(e.text for e in events["running"][:-1]) != ""
    assert h.backends[0].running == {}


def test_a_resumed_request_cancelled_before_it_restarts_keeps_its_earlier_text():
    """Its stream already holds an earlier delivery's deltas: its `done` says their text and
    tokens (a reader checks that the deltas add up to it), not nothing."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("running", max_tokens=1000))
    h.outputs.get(timeout=5)  # "running" holds the only slot
    earlier = Resume(tokens=[5, 6], text="ab", deltas=2)
    h.engine.submit(request("resumed", resume=earlier))
    h.engine.cancel("resumed")
    h.engine.cancel("running")
    (done,) = h.events_until_terminal({"running", "resumed"})["resumed"]
    assert done.finish_reason == "cancelled" and done.text == "ab" and done.usage.completion_tokens == 2


def test_a_failing_step_fails_its_batch_and_the_engine_keeps_serving():
    """A step that raises gives each request in the batch one `internal` error; later work completes."""
    h = Harness(max_num_seqs=4, fail_on_step=2)
    h.engine.submit(request("a", max_tokens=10))
    h.engine.submit(request("b", max_tokens=10))
    events = h.events_until_terminal({"a", "b"})
    assert all(isinstance(evs[-1], Error) and evs[-1].code == "internal" for evs in events.values())
    h.engine.submit(request("c"))
    assert isinstance(h.events_until_terminal({"c"})["c"][-1], Done)
    assert len(h.backends) == 2, "the batch was rebuilt"
    assert h.fatal == []


def test_deadline_passed_while_waiting_is_an_error():
    """A request whose deadline passes while it waits is never started."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("running", max_tokens=20))
    h.engine.submit(request("late", deadline_at=time.time() + 0.05))
    events = h.events_until_terminal({"running", "late"})
    assert [type(e) for e in events["late"]] == [Error]
    assert events["late"][0].code == "deadline_exceeded"


def test_shutdown_finishes_running_and_abandons_waiting():
    """On shutdown, running requests finish within the drain time and waiting ones are handed back."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("running", max_tokens=5))
    h.engine.submit(request("waiting"))
    h.outputs.get(timeout=5)
    outs = h.shut_down(drain_timeout_s=10)
    assert [r.id for o in outs for r in o.abandoned] == ["waiting"]
    assert any(isinstance(i.event, Done) and i.event.id == "running" for o in outs for i in o.outgoing)


def test_shutdown_abandons_running_requests_after_the_drain_timeout():
    """Requests still running when the drain time is up are left for another worker, without a terminal event."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("endless", max_tokens=10**9))
    h.outputs.get(timeout=5)
    outs = h.shut_down(drain_timeout_s=0.1)
    assert [r.id for o in outs for r in o.abandoned] == ["endless"]
    assert not any(isinstance(i.event, Done) for o in outs for i in o.outgoing)


def test_a_failing_load_is_reported():
    """If the model cannot load, `wait_ready` raises with the reason."""
    from worker.engine.thread import EngineFailed

    def load() -> Loaded:
        raise FileNotFoundError("no such model")

    engine = Engine(load, SchedulingPolicy(1), on_output=lambda out: None, on_fatal=lambda e: None)
    engine.start()
    with pytest.raises(EngineFailed, match="no such model"):
        engine.wait_ready(5)


def test_a_request_that_was_in_an_engines_death_runs_alone():
    """A request marked `alone` (it was in an engine's death) starts only into an empty
    batch and nothing joins it: the requests behind it wait until it ends, then share
    the batch again. The engine says which requests enter the batch before the step that
    starts them, and which ended their prefill, once each."""
    h = Harness(max_num_seqs=4)
    h.engine.submit(request("before", max_tokens=20))
    h.engine.submit(request("suspect", max_tokens=5, alone=True, prompt=(2,)))
    for i in range(3):
        h.engine.submit(request(f"after{i}", max_tokens=5))
    ids = {"before", "suspect", "after0", "after1", "after2"}
    events = h.events_until_terminal(ids)
    assert all(isinstance(evs[-1], Done) for evs in events.values())
    with_suspect = [batch for batch in h.backends[0].batches if [2] in batch]
    assert with_suspect and all(batch == [[2]] for batch in with_suspect)
    assert max(len(batch) for batch in h.backends[0].batches) >= 2, "the others still share the batch"
    assert sorted(i for started in h.started for i in started) == sorted(ids)
    assert ["suspect"] in h.started
    assert sorted(h.first_tokens) == sorted(ids)


def test_the_scheduler_starts_a_request_marked_alone_only_into_an_empty_batch():
    s = Scheduler(SchedulingPolicy(4))
    for rid, alone in [("a", False), ("b", True), ("c", False)]:
        s.add(request(rid, alone=alone))
    assert [r.id for r in s.admit(running=0)] == ["a"]
    assert s.admit(running=1) == [], "it waits for the batch to empty, and holds back those behind it"
    assert [r.id for r in s.admit(running=0)] == ["b"]
    assert [r.id for r in s.admit(running=0)] == ["c"]


def test_a_deferred_request_keeps_its_place_while_those_behind_it_start():
    """A request the engine defers (it waits for a prefill it can reuse) stays waiting, first
    in line, and the requests behind it take the free slots meanwhile."""
    s = Scheduler(SchedulingPolicy(4))
    for rid in "abcd":
        s.add(request(rid))
    seen: list[tuple[str, list[str]]] = []

    def defer_b(r: EngineRequest, starting: list[EngineRequest]) -> bool:
        seen.append((r.id, [o.id for o in starting]))
        return r.id == "b"

    assert [r.id for r in s.admit(running=1, defer=defer_b)] == ["a", "c", "d"]
    assert seen == [("a", []), ("b", ["a"]), ("c", ["a"]), ("d", ["a", "c"])], "each sees what starts before it"
    s.add(request("e"))
    assert [r.id for r in s.admit(running=2)] == ["b", "e"], "the deferred one is still first in line"


def test_free_slots_wait_a_little_for_a_prefill_group_while_a_backlog_waits():
    """With a batch running and more waiting than slots are free, free slots are held for
    half a prefill group (four of eight here) for at most GROUP_WAIT_S; four free start at once."""
    s = Scheduler(SchedulingPolicy(16, prefill_batch_size=8))
    for i in range(12):
        s.add(request(f"r{i}"))
    assert s.holding(running=14, now=100.0), "two free of four: held"
    assert s.holding(running=13, now=100.0 + GROUP_WAIT_S / 2), "still within the wait, counted from the first"
    assert not s.holding(running=13, now=100.0 + GROUP_WAIT_S), "the wait is over: the three free slots fill"
    assert len(s.admit(running=13)) == 3
    assert s.holding(running=15, now=200.0), "a new wait begins with the next free slot"
    assert not s.holding(running=12, now=200.001), "four free: they start at once"
    assert len(s.admit(running=12)) == 4


def test_nothing_is_held_from_an_empty_batch_or_when_the_free_slots_take_every_waiting_request():
    s = Scheduler(SchedulingPolicy(16, prefill_batch_size=8))
    for i in range(12):
        s.add(request(f"r{i}"))
    assert not s.holding(running=0, now=1.0), "an idle engine starts what it has"
    assert not s.holding(running=16, now=1.0), "no free slot: nothing to hold"
    s.take(10)
    assert not s.holding(running=14, now=1.0), "two waiting, two free: both start (a closed loop)"


def test_waiting_requests_wait_a_little_for_those_being_prepared_to_start_beside_them():
    """Requests on their way (being prepared) that would start beside those waiting are
    waited for, at most GROUP_WAIT_S, an idle engine's included: a backlog's first wave,
    read together, starts together."""
    s = Scheduler(SchedulingPolicy(16, prefill_batch_size=8))
    s.add(request("first"))
    assert not s.holding(running=0, now=1.0, preparing=0), "nothing on its way: it starts at once"
    assert s.holding(running=0, now=1.0, preparing=5), "five on their way, all free: held"
    assert s.hold_left(now=1.0 + GROUP_WAIT_S / 3) == pytest.approx(GROUP_WAIT_S * 2 / 3)
    assert not s.holding(running=0, now=1.0 + 2 * GROUP_WAIT_S, preparing=5), "the wait is over"
    assert s.hold_left(now=1.0 + 2 * GROUP_WAIT_S) == 0.0
    for i in range(7):
        s.add(request(f"r{i}"))
    assert not s.holding(running=0, now=2.0, preparing=5), "a prefill group waits: it starts"
    s.take(6)
    assert not s.holding(running=14, now=3.0, preparing=5), "no more slots free than wait: they start"
    assert s.holding(running=10, now=3.0, preparing=5), "six free, two waiting, more on their way: held"


def test_a_request_held_for_one_on_its_way_that_never_comes_still_starts():
    """A preparation that never ends (refused, or its worker gone) holds an idle engine's
    waiting request for GROUP_WAIT_S, not for ever."""
    h = Harness(max_num_seqs=4)
    h.preparing = 1
    h.engine.submit(request("a", max_tokens=2))
    assert isinstance(h.events_until_terminal({"a"})["a"][-1], Done)
    h.shut_down(1)


def test_scheduler_is_fcfs_within_a_priority_and_skips_removed():
    """The scheduler orders by priority, then arrival; removed requests are never taken."""
    s = Scheduler(SchedulingPolicy(4))
    for rid, prio in [("a", 0), ("b", 1), ("c", 0), ("d", -1)]:
        s.add(request(rid, priority=prio))
    s.remove("c")
    assert [r.id for r in s.take(10)] == ["d", "a", "b"]
    assert len(s) == 0


def test_a_resumed_request_continues_after_what_was_streamed():
    """A request taken over after 2 deltas: the prompt carries the streamed tokens, only the
    rest of max_tokens is generated, seq goes on from 2, and `done` has the whole text."""
    h = Harness()
    h.engine.submit(request("again", max_tokens=5, resume=Resume(tokens=[0, 1], text="ab", deltas=2)))
    events = h.events_until_terminal({"again"})["again"]
    assert h.backends[0].prompts == [[1, 0, 1]]
    assert [e.seq for e in events[:-1]] == [2, 3, 4]
    assert events[-1].text == "ab" + "".join(e.text for e in events[:-1])
    assert events[-1].usage.completion_tokens == 5


def test_a_request_resumed_with_nothing_left_to_generate_just_ends():
    """Taken over after its last token was streamed but before its `done`: `done` at once."""
    h = Harness()
    h.engine.submit(request("spent", max_tokens=2, resume=Resume(tokens=[0, 1], text="ab", deltas=2)))
    (done,) = h.events_until_terminal({"spent"})["spent"]
    assert (done.finish_reason, done.text, done.usage.completion_tokens) == ("length", "ab", 2)
    assert h.backends[0].prompts == []


def test_an_abandoned_request_stops_without_a_word():
    """Abandon (another worker owns the request now) frees the slot and writes nothing."""
    h = Harness(max_num_seqs=1, step_s=0.01)
    h.engine.submit(request("taken", max_tokens=10**9))
    h.engine.submit(request("queued"))
    h.outputs.get(timeout=5)
    h.engine.abandon("queued")
    h.engine.abandon("taken")
    h.engine.submit(request("next"))
    seen = []
    while not seen or not isinstance(seen[-1], Done):
        seen += [item.event for item in h.outputs.get(timeout=5).outgoing]
    assert {e.id for e in seen if not isinstance(e, Delta)} == {"next"}, "no terminal event for the abandoned"
    assert "queued" not in {e.id for e in seen}


def test_aging_lets_a_starved_request_in_eventually():
    """Priority 5 that has waited 6 aging periods goes before priority 0 that just came;
    one that has waited 4 does not."""
    s = Scheduler(SchedulingPolicy(4, priority_aging_s=1.0))
    now = time.time()
    starved = dataclasses.replace(request("starved"), queueing=Queueing(5, now - 6))
    patient = dataclasses.replace(request("patient"), queueing=Queueing(5, now - 4))
    s.add(patient)
    s.add(starved)
    s.add(dataclasses.replace(request("fresh"), queueing=Queueing(0, now)))
    assert [r.id for r in s.take(3)] == ["starved", "fresh", "patient"]


def test_a_request_the_scheduler_cannot_rank_fails_alone():
    """A priority too large to rank (past what the wire allows) fails that request with
    `internal`; the scheduler keeps nothing of it and the engine serves the next one."""
    harness = Harness()
    harness.engine.submit(request("huge", priority=10**400))
    harness.engine.submit(request("next"))
    events = harness.events_until_terminal({"huge", "next"})
    (error,) = events["huge"]
    assert isinstance(error, Error) and error.code == "internal" and "could not queue" in error.message
    assert isinstance(events["next"][-1], Done)
    assert not harness.fatal
    harness.shut_down(1)
