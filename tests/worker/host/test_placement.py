"""The host's placement policy alone: the scenarios `test_several_models.py` runs with
real hosts and worker processes, each decided here from what one look saw (milliseconds)."""

from __future__ import annotations

from client.hosts import HostedModel, HostRecord
from worker.host.placement import Decision, Demand, Look, Model, Policy, decide

GB = 1 << 30
POLICY = Policy("host-a", budget=10 * GB, idle_unload_s=60.0, scale_up_after_s=5.0, tick_s=0.5)
NOW = 1000.0
WAITING = Demand(unread=True, oldest_s=0.1)


def loaded(queue: str, gb: int = 4, last_used: float = NOW - 30, **fields) -> Model:
    return Model(queue, gb * GB, state="loaded", last_used=last_used, holds_memory=True, **fields)


def look(demand: dict[str, Demand], **fields) -> Look:
    return Look(NOW, demand, **fields)


def test_a_waiting_model_that_fits_loads():
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": WAITING})) == [Decision("load", "a")]


def test_nothing_waits_nothing_loads():
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": Demand()})) == []


def test_three_models_under_a_budget_for_two_take_turns_beside_the_pinned_one():
    """The pinned one stays; the idle unpinned one unloads to make room, and the waiting
    one loads at a later look, once the unloaded one has exited."""
    models = [loaded("pinned", pin=True), loaded("b"), Model("c", 4 * GB)]
    assert decide(POLICY, models, look({"c": WAITING})) == [Decision("unload", "b", "room")]
    draining = [models[0], Model("b", 4 * GB, state="draining", holds_memory=True), models[2]]
    assert decide(POLICY, draining, look({"c": WAITING})) == []  # counted as coming: nothing more unloads
    exited = [models[0], Model("b", 4 * GB), models[2]]
    assert decide(POLICY, exited, look({"c": WAITING})) == [Decision("load", "c")]


def test_a_model_with_work_in_this_look_is_not_unloaded_to_make_room():
    models = [loaded("busy", gb=8, last_used=NOW), Model("c", 4 * GB)]
    assert decide(POLICY, models, look({"c": WAITING})) == []


def test_an_idle_model_unloads_by_itself_but_a_pinned_one_stays():
    idle = NOW - POLICY.idle_unload_s
    models = [loaded("a", last_used=idle), loaded("p", last_used=idle, pin=True)]
    assert decide(POLICY, models, look({})) == [Decision("unload", "a", "idle")]
    refusing = loaded("p", last_used=idle, pin=True, refusing=True)  # a refusing pinned one is tried again
    assert decide(POLICY, [refusing], look({})) == [Decision("unload", "p", "idle")]


def test_of_two_hosts_the_one_with_more_room_loads_then_the_lower_name():
    offering = (HostedModel("a", "org/A", "available"),)
    roomier = HostRecord("host-b", free_bytes=11 * GB, models=offering)
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": WAITING}, other_hosts=[roomier])) == []
    same_room_lower_name = HostRecord("host-0", free_bytes=10 * GB, models=offering)
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": WAITING}, other_hosts=[same_room_lower_name])) == []
    higher_name = HostRecord("host-z", free_bytes=10 * GB, models=offering)
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": WAITING}, other_hosts=[higher_name])) == [
        Decision("load", "a")]
    failed_there = HostRecord("host-b", free_bytes=11 * GB, models=(HostedModel("a", "org/A", "available",
                                                                                failed="exited"),))
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": WAITING}, other_hosts=[failed_there])) == [
        Decision("load", "a")]


def test_a_load_another_host_holds_the_lease_of_waits_for_its_lease_to_end():
    """A host killed mid-load: its lease expires, and only then does another load."""
    held = look({"a": WAITING}, loading_elsewhere=frozenset({"a"}))
    assert decide(POLICY, [Model("a", 4 * GB)], held) == []
    assert decide(POLICY, [Model("a", 4 * GB)], look({"a": WAITING})) == [Decision("load", "a")]


def test_a_backlog_loads_a_second_copy_where_there_is_room():
    served = frozenset({"a"})
    young = look({"a": Demand(unread=True, oldest_s=POLICY.scale_up_after_s / 2)}, served_elsewhere=served)
    assert decide(POLICY, [Model("a", 4 * GB)], young) == []
    old = look({"a": Demand(unread=True, oldest_s=POLICY.scale_up_after_s)}, served_elsewhere=served)
    assert decide(POLICY, [Model("a", 4 * GB)], old) == [Decision("load", "a")]


def test_requests_a_dead_worker_read_are_work_only_where_nobody_serves_the_queue():
    pending = {"a": Demand(pending=True)}
    assert decide(POLICY, [Model("a", 4 * GB)], look(pending)) == [Decision("load", "a")]
    assert decide(POLICY, [Model("a", 4 * GB)], look(pending, served_elsewhere=frozenset({"a"}))) == []


def test_an_extra_copy_is_unloaded_before_a_model_used_longer_ago():
    models = [loaded("gamma", last_used=NOW - 50), loaded("beta", last_used=NOW - 10), Model("delta", 4 * GB)]
    decisions = decide(POLICY, models, look({"delta": WAITING}, served_elsewhere=frozenset({"beta"})))
    assert decisions == [Decision("unload", "beta", "room")]
    decisions = decide(POLICY, models, look({"delta": WAITING}))
    assert decisions == [Decision("unload", "gamma", "room")]  # no copies: the least recently used


def test_a_model_seen_larger_than_the_room_left_is_given_up_and_then_refused():
    models = [loaded("pinned", gb=6, pin=True), Model("huge", 5 * GB)]
    [given_up] = decide(POLICY, models, look({"huge": WAITING}))
    assert given_up.action == "give_up" and "4.0 GB memory_budget_gb leaves beside the pinned models" in given_up.why
    failed = [models[0], Model("huge", 5 * GB, failed=given_up.why)]
    assert decide(POLICY, failed, look({"huge": WAITING})) == [Decision("refuse", "huge")]
    assert decide(POLICY, failed, look({"huge": WAITING}, served_elsewhere=frozenset({"huge"}))) == []


def test_each_decision_counts_in_before_the_next_model():
    """Two waiting models, room for one: the first loads, the second waits its turn."""
    models = [Model("a", 6 * GB), Model("b", 6 * GB)]
    assert decide(POLICY, models, look({"a": WAITING, "b": WAITING})) == [Decision("load", "a")]
