"""The URL forms the client accepts, and how a job's reader rides out a Redis failover
(no server: these are the client's own rules)."""

from __future__ import annotations

import pytest
import redis
from redis.crc import key_slot
from support import KEYS

from client import Delta, Done, Timing, Usage, encode_event
from client._jobs import Cursor, Outage
from client.connect import connect, connect_async, is_cluster, parse_cluster_url, parse_sentinel_url
from client.diagnose import redacted, redis_url_problem
from client.keys import Keys, hash_tag


def test_a_sentinel_url_names_the_sentinels_the_primary_and_its_credentials():
    target = parse_sentinel_url("redis+sentinel://mlxq:p%40ss@10.0.0.1:26379,10.0.0.2:26380/prod/2"
                                "?socket_timeout=3&sentinel_password=s")
    assert target.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert (target.primary, target.db, target.username, target.password) == ("prod", 2, "mlxq", "p@ss")
    assert target.sentinel_kwargs(socket_timeout=10) == {"password": "s", "socket_timeout": 10}
    assert target.connection_kwargs(socket_timeout=10)["socket_timeout"] == 10
    assert isinstance(connect("redis+sentinel://127.0.0.1:1/prod").connection_pool,
                      redis.sentinel.SentinelConnectionPool)
    assert redacted("redis+sentinel://mlxq:secret@h1:1,h2:2/prod") == "redis+sentinel://mlxq:***@h1:1,h2:2/prod"


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h1:26379", "host:port,host:port/<primary name>"),
    ("redis+sentinel://h1/prod", "give each Sentinel as host:port"),
    ("sentinel://h1:1/prod", "is not a Redis URL"),
    ("redis+cluster://h1", "give each cluster node as host:port"),
    ("redis+cluster://h1:7000/2", "a cluster has no databases"),
    ("redis+cluster://", "write redis+cluster://host:port"),
])
def test_a_bad_sentinel_or_cluster_url_says_what_to_write(url, says):
    assert says in redis_url_problem(url)


def test_a_cluster_url_names_some_nodes_and_the_credentials():
    shape = parse_cluster_url("rediss+cluster://w:p%40ss@10.0.0.1:6379,10.0.0.2:6380?ssl_ca_certs=/ca.pem"
                              "&socket_timeout=3")
    assert shape.nodes == [("10.0.0.1", 6379), ("10.0.0.2", 6380)]
    assert shape.options == {"username": "w", "password": "p@ss", "ssl": True, "ssl_ca_certs": "/ca.pem",
                             "socket_timeout": 3.0}
    assert is_cluster(connect_async("redis+cluster://127.0.0.1:1"))  # connects at its first command
    assert not is_cluster(connect_async("redis://127.0.0.1:1"))


@pytest.mark.parametrize(("key", "tag"), [
    ("mlxq:out:{r1}", "r1"), ("mlxq:reply:plain", "mlxq:reply:plain"), ("mlxq:reply:{}{x}", "mlxq:reply:{}{x}"),
    ("mlxq:reply:{a{b}c", "a{b"), ("a}{b}", "b"),
])
def test_hash_tags_follow_redis_cluster_rules(key, tag):
    assert hash_tag(key) == tag


def test_a_reply_name_with_braces_must_hold_one_hash_tag():
    """The fences of a reply stream's requests are placed by its hash tag: braces that
    form none are refused, with the rule."""
    keys = Keys()
    for good in ("mlxq:reply:q:{orders}-7", "mlxq:reply:q:{open", "mlxq:reply:q:plain"):
        assert keys.reply_to_problem("q", good) is None
        assert key_slot(keys.progress("q", "r1", good).encode()) == key_slot(good.encode())
    for bad in ("mlxq:reply:q:a}b", "mlxq:reply:q:{}x"):
        assert "must form one Redis Cluster hash tag" in keys.reply_to_problem("q", bad)
    assert keys.progress("q", "r1", "mlxq:reply:q:{orders}-7") == "mlxq:progress:q:{orders}:r1"
    for elsewhere in ("mlxq:reply:other:x", "mlxq:reply:x", "mlxq:out:q:{r2}"):  # another queue's, or none's
        assert "is not a shared reply stream of queue 'q'" in keys.reply_to_problem("q", elsewhere)
    assert keys.progress("q", "r1") == keys.progress("q", "r1", keys.output("q", "r1")) == "mlxq:progress:q:{r1}"


def entry(event) -> dict:
    return encode_event(event, "json")


def test_a_reader_keeps_the_first_copy_of_each_seq_when_a_failover_rewinds_the_output():
    cursor = Cursor("r1", KEYS.output("q", "r1"))
    first = [(f"1-{i}", entry(Delta("r1", i, f"t{i}", [i]))) for i in range(3)]
    assert [e.seq for e in cursor.feed(first)] == [0, 1, 2]
    again = [(f"2-{i}", entry(Delta("r1", i, f"u{i}", [i]))) for i in (1, 2, 3)]  # rewritten from seq 1
    assert [(e.seq, e.text) for e in cursor.feed(again)] == [(3, "u3")]
    done = Done("r1", "stop", "t0t1t2u3", Usage(1, 4), Timing(1, 2, 3))
    assert cursor.feed([("3-0", entry(done))])[0] == done and cursor.outcome() == done


def test_reads_ride_out_an_outage_for_a_while_then_give_up(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("client._jobs.time.monotonic", lambda: clock[0])
    outage, error = Outage(), redis.ConnectionError("refused")
    assert outage.failed(error) > 0
    clock[0] += 59
    assert outage.failed(error) > 0
    clock[0] += 2
    with pytest.raises(redis.ConnectionError):
        outage.failed(error)
    outage.ended()
    assert outage.failed(error) > 0  # a new outage starts its own count
