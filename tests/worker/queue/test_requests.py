"""The request table, the one owner of a held request's state (no Valkey, no model)."""

from __future__ import annotations

from support import KEYS

from client.protocol import Done, Timing, Usage
from worker.messages import RequestRef, Route
from worker.queue.requests import RequestStatus, RequestTable


def table() -> tuple[RequestTable, list[str]]:
    dropped: list[str] = []
    return RequestTable(2, abandon=dropped.append), dropped


def route(request_id: str = "r1", entry_id: str = "1-0") -> Route:
    return Route(request_id, entry_id, KEYS.output("q", request_id), "json", "mlxq:q:q")


def test_a_request_goes_read_streaming_acked_and_its_room_comes_back():
    """Its first written event makes it STREAMING; its terminal one ends it ACKED, and
    the engine, which made that terminal event, is not told to drop it."""
    requests, dropped = table()
    requests.read(route())
    requests.fenced("r1", "token", 0)
    assert requests.room(read_ahead=0) == 1 and requests.room(read_ahead=2) == 3
    assert requests.get("r1").route.fence == "token"
    requests.wrote(RequestRef("r1", "1-0"), 1, terminal=False)
    assert requests.get("r1").status is RequestStatus.STREAMING and requests.get("r1").written == 1
    requests.wrote(RequestRef("r1", "1-0"), 3, terminal=True)
    assert requests.get("r1") is None and requests.room(read_ahead=0) == 2 and dropped == []


def test_a_request_that_ends_here_early_is_dropped_by_the_engine():
    """Taken over (LOST), settled without output, handed back: the engine drops the rest."""
    requests, dropped = table()
    for i, status in enumerate((RequestStatus.LOST, RequestStatus.SETTLED, RequestStatus.HANDED_BACK)):
        requests.read(route(f"r{i}"))
        requests.end(f"r{i}", status)
    assert dropped == ["r0", "r1", "r2"]


def test_what_another_entry_of_the_same_id_writes_is_not_this_ones():
    """An engine event for an earlier delivery (entry 1-0) of a request now held from
    entry 2-0 does not touch the one held."""
    requests, _ = table()
    requests.read(route(entry_id="2-0"))
    assert requests.holding(RequestRef("r1", "1-0")) is None
    requests.wrote(RequestRef("r1", "1-0"), 5, terminal=True)
    assert requests.get("r1") is not None and requests.get("r1").written == 0


def test_a_done_gets_the_stages_the_table_saw():
    """Read, prepared and first written, in ms from the arrival; the engine's stages stay."""
    requests, _ = table()
    held = requests.read(route())
    requests.prepared("r1", arrived_at=held.read_at - 0.010)
    held.prepared_at = held.read_at + 0.005
    requests.wrote(RequestRef("r1", "1-0"), 1, terminal=False)
    held.first_published_at = held.read_at + 0.020
    done = Done(id="r1", finish_reason="length", text="", usage=Usage(1, 1),
                timing=Timing(queued_ms=12.0, ttft_ms=25.0, total_ms=40.0))
    timed = held.timed(done)
    assert isinstance(timed, Done)
    assert (timed.timing.read_ms, timed.timing.prepared_ms, timed.timing.published_ms) == (10.0, 15.0, 30.0)
    assert (timed.timing.queued_ms, timed.timing.ttft_ms, timed.timing.total_ms) == (12.0, 25.0, 40.0)


def test_an_answer_made_at_intake_drops_a_request_the_engine_already_has():
    """Intake answers a request itself (its intake failed after the hand-over to the
    engine): the engine is told to drop it, since the written terminal will not tell it."""
    from types import SimpleNamespace

    from client.protocol import ErrorCode
    from worker.messages import failed
    from worker.queue.intake import Intake

    requests, _ = table()
    told: list[str] = []
    emitted: list[object] = []
    intake = Intake(None, None, None, None, requests, None,  # type: ignore[arg-type]
                    SimpleNamespace(abandon=told.append), emitted.append, 0.0, None)  # type: ignore[arg-type]
    for request_id, status in (("handed", RequestStatus.ADMITTED), ("unhanded", RequestStatus.READ)):
        requests.read(route(request_id))
        requests.advance(request_id, status)
        intake._answer(failed(RequestRef(request_id, "1-0"), ErrorCode.INTERNAL, "x"))
    assert told == ["handed"] and len(emitted) == 2
    assert requests.get("handed").status is requests.get("unhanded").status is RequestStatus.FINISHING


def test_a_request_taken_over_during_an_await_is_left_alone():
    """Intake changes a request after awaiting Redis or a thread; if another worker took
    it meanwhile (the lease keeper ended it LOST), those changes do nothing and raise nothing."""
    requests, _ = table()
    requests.read(route())
    requests.end("r1", RequestStatus.LOST)
    assert requests.reroute("r1", reply_to="mlxq:reply:x") is None
    requests.fenced("r1", "token", 3)
    requests.prepared("r1", arrived_at=1.0)
    assert requests.get("r1") is None
