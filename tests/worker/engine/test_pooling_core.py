"""The pooling engine core in this process, on the real demo embedding model: how inputs of
many requests share padded passes (by length bucket, within the pass's budget), what a
cancel and a deadline do; and the preparer's checks of `dimensions` and lengths."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
from support import build_demo_model

from client.engine_stats import EngineTime
from client.protocol import Done, Envelope, Error, RequestRejected
from worker.engine.backends import PoolingInfo, load_model
from worker.engine.pooling_core import PoolingCore
from worker.engine.scheduler import SchedulingPolicy
from worker.messages import PoolingRequest, PoolInput, Queueing, RequestRef, StepOutput
from worker.prepare.pooling import PoolingPreparer
from worker.settings import WorkerSettings


@pytest.fixture(scope="module")
def pooling_model(tmp_path_factory):
    path = build_demo_model(tmp_path_factory.mktemp("model") / "embedding", "--embedding")
    return load_model(WorkerSettings(model=str(path)))


class Counting:
    """The model's pass, counting the inputs of each call."""

    def __init__(self, pool):
        self.pool = pool
        self.passes: list[list[int]] = []

    def __call__(self, batch):
        self.passes.append([len(item.tokens) for item in batch])
        return self.pool(batch)


def request(name: str, lengths: list[int], priority: int = 0, **fields) -> PoolingRequest:
    inputs = [PoolInput([(7 * i + n) % 900 + 10 for i in range(n)]) for n in lengths]
    return PoolingRequest(RequestRef(name, "0-1"), inputs, Queueing(priority, time.time()), **fields)


def core_of(pooling_model, max_num_seqs: int = 8, prefill_batch_size: int = 8, prefill_step_size: int = 512):
    counting = Counting(pooling_model.pooler)
    policy = SchedulingPolicy(max_num_seqs, prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size)
    core = PoolingCore(replace(pooling_model, pooler=counting), policy, EngineTime())
    return core, counting


def run(core: PoolingCore) -> list[Done | Error]:
    ended = []
    while core.busy():
        out = StepOutput()
        core.step(out)
        ended += [item.event for item in out.outgoing]
    return ended


def alone(pooling_model, item: PoolInput) -> list[float]:
    return pooling_model.pooler([item])[0].tolist()


def test_inputs_of_many_requests_share_passes_by_length_bucket(pooling_model):
    core, counting = core_of(pooling_model)
    requests = [request("a", [5, 40]), request("b", [9, 12, 33]), request("c", [3]), request("d", [60, 70])]
    for r in requests:
        core.submit(r, StepOutput())
    ended = {e.id: e for e in run(core)}
    assert counting.passes == [[5, 9, 12, 3], [40, 33, 60], [70]]  # buckets 16, 64, 128: the head's first
    for r in requests:
        done = ended[r.id]
        assert isinstance(done, Done) and done.usage.prompt_tokens == sum(len(i.tokens) for i in r.inputs)
        for item, vector in zip(r.inputs, done.embeddings, strict=True):
            assert max(abs(x - y) for x, y in zip(vector, alone(pooling_model, item), strict=True)) < 1e-5


def test_a_pass_holds_at_most_max_num_seqs_inputs_and_the_token_budget(pooling_model):
    core, counting = core_of(pooling_model, max_num_seqs=3, prefill_batch_size=1, prefill_step_size=100)
    core.submit(request("many", [10] * 7), StepOutput())
    core.submit(request("wide", [40, 40, 40, 200]), StepOutput())
    run(core)
    assert counting.passes == [[10, 10, 10], [10, 10, 10], [10], [40, 40], [40], [200]]


def test_a_better_ranked_request_s_inputs_go_first(pooling_model):
    core, counting = core_of(pooling_model, max_num_seqs=2)
    core.submit(request("late", [100, 100]), StepOutput())
    core.submit(request("urgent", [8], priority=-1), StepOutput())
    ended = [e.id for e in run(core)]
    assert ended == ["urgent", "late"] and counting.passes == [[8], [100, 100]]


def test_an_urgent_request_admitted_later_goes_before_a_large_one_admitted_first(pooling_model):
    """A batch line's 6 inputs are running when an interactive request comes: its input
    runs in the next pass, not after the line's."""
    core, counting = core_of(pooling_model, max_num_seqs=2)
    core.submit(request("line", [30] * 6, priority=2**20), StepOutput())
    first = StepOutput()
    core.step(first)
    core.submit(request("urgent", [50]), StepOutput())
    ended = [e.id for e in run(core)]
    assert counting.passes == [[30, 30], [50], [30, 30], [30, 30]] and ended == ["urgent", "line"]


def test_dimensions_cut_and_renormalize_and_base64_round_trips(pooling_model):
    from client.pooling import decode_vector

    core, _ = core_of(pooling_model)
    core.submit(request("cut", [6], dimensions=16), StepOutput())
    core.submit(request("b64", [6], base64=True), StepOutput())
    ended = {e.id: e for e in run(core)}
    full = alone(pooling_model, request("x", [6]).inputs[0])
    norm = math.sqrt(sum(x * x for x in full[:16]))
    assert max(abs(a - b / norm) for a, b in zip(ended["cut"].embeddings[0], full[:16], strict=True)) < 1e-6
    assert max(abs(a - b) for a, b in zip(decode_vector(ended["b64"].embeddings[0]), full, strict=True)) < 1e-6


def test_cancel_and_deadline(pooling_model):
    core, counting = core_of(pooling_model)
    out = StepOutput()
    core.submit(request("gone", [5]), out)
    core.submit(replace(request("late", [5]), queueing=Queueing(0, time.time(), time.time() - 1)), out)
    core.cancel("gone", out)
    ended = run(core)
    assert out.outgoing[0].event.finish_reason == "cancelled" and out.outgoing[0].event.embeddings is None
    assert [(e.id, e.code) for e in ended] == [("late", "deadline_exceeded")] and counting.passes == []


def envelope(raw) -> Envelope:
    return Envelope("r", raw, "json", None)


def preparer(pooling_model, **pooling) -> PoolingPreparer:
    info = replace(pooling_model.info, pooling=replace(pooling_model.info.pooling, **pooling))
    return PoolingPreparer(info, WorkerSettings(model="sim:x"))


@pytest.mark.parametrize(("matryoshka", "asked", "problem"), [
    (False, 16, "not trained to be cut"), ((16, 32), 20, "can be cut to 16, 32 only"), (True, 65, "more than"),
    ((16, 32), 32, None), (True, 5, None), (False, 64, None)])
def test_dimensions_are_allowed_only_where_the_model_says(pooling_model, matryoshka, asked, problem):
    prepare = preparer(pooling_model, matryoshka=matryoshka).prepare
    if problem is None:
        made = prepare(envelope({"input": "hi", "dimensions": asked}), RequestRef("r", "0-1"), time.time(), 0.0)
        assert made.dimensions == (None if asked == 64 else asked)
    else:
        with pytest.raises(RequestRejected, match=problem):
            prepare(envelope({"input": "hi", "dimensions": asked}), RequestRef("r", "0-1"), time.time(), 0.0)


def test_pooling_info_of_the_demo_embedding_model(pooling_model):
    assert pooling_model.info.pooling == PoolingInfo("embed", 2048, pooling_model.info.pooling.pad_id, 64, True, None)


def test_the_worker_s_matryoshka_setting_overrides_the_config(pooling_model):
    from pydantic import ValidationError

    path = pooling_model.info.name
    assert load_model(WorkerSettings(model=path, matryoshka_dimensions=[16, 8])).info.pooling.matryoshka == (8, 16)
    assert load_model(WorkerSettings(model=path, matryoshka_dimensions=[0])).info.pooling.matryoshka is True
    for bad in ([], [-1], [0, 8]):
        with pytest.raises(ValidationError, match="0 alone for any size"):
            WorkerSettings(model=path, matryoshka_dimensions=bad)


@pytest.mark.parametrize(("config", "tokenizer_limit", "longest"), [
    ({"model_type": "xlm-roberta", "max_position_embeddings": 514}, 512, 512),  # BGE-reranker: 2 positions pad's
    ({"model_type": "xlm-roberta", "max_position_embeddings": 8194}, None, 8192),  # BGE-M3
    ({"model_type": "qwen3", "max_position_embeddings": 32768}, 8192, 8192),  # the tokenizer's limit is lower
    ({"model_type": "bert"}, None, 512),  # neither says: the fallback
])
def test_the_longest_input_is_the_model_s_and_its_tokenizer_s(config, tokenizer_limit, longest):
    from types import SimpleNamespace

    from worker.engine.backends.pooling import _max_length

    assert _max_length(config, SimpleNamespace(model_max_length=tokenizer_limit)) == longest
