"""The `mlxq` command as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis
from support import HELD_PROMPT, KEYS, MLXQ, ROOT, free_port, mlxq, start_worker, wait_for, worker_fixture

from client import Client, Done, decode_event

pytestmark = pytest.mark.process  # runs the mlxq command in processes

worker = worker_fixture()


def test_help_lists_every_command():
    """`mlxq --help` names the four commands; each has its own complete help."""
    top = mlxq("--help")
    assert top.returncode == 0
    for command in ("worker", "submit", "redis", "demo-model"):
        assert command in top.stdout
        assert mlxq(command, "--help").returncode == 0
    worker_help = mlxq("worker", "--help").stdout
    for flag in ("--redis-url", "--model", "--max-num-seqs", "--prefill-step-size", "--stream-interval",
                 "--default-max-tokens", "--max-tokens-limit", "--result-ttl-s", "--prefetch", "--log-format",
                 "--config", "MLXQ_QUEUE"):
        assert flag in worker_help
    assert "--stream" in mlxq("submit", "--help").stdout


def test_submit_streams_the_text(worker):
    """`mlxq submit --stream` prints exactly the generated text, then a summary on stderr."""
    result = mlxq("submit", "--redis-url", worker.redis_url, "--queue", worker.queue, "--stream",
                  "--max-tokens", "16", "--id", "cli-stream-1", "Hello from the CLI")
    assert result.returncode == 0, result.stderr
    r = redis.Redis.from_url(worker.redis_url)
    terminal = decode_event(r.xrange(KEYS.output(worker.queue, "cli-stream-1"))[-1][1])
    r.close()
    assert result.stdout == terminal.text + "\n"
    assert "16 completion tokens" in result.stderr and "TTFT" in result.stderr


def test_submit_reports_errors(worker):
    """A rejected request exits non-zero with the reason."""
    result = mlxq("submit", "--redis-url", worker.redis_url, "--queue", worker.queue, "--max-tokens", "0", "x")
    assert result.returncode == 1
    assert "max_tokens" in result.stderr


def test_bad_worker_settings_exit_with_a_message():
    """An invalid setting stops the worker before it starts, naming the setting."""
    result = mlxq("worker", "--max-num-seqs", "0")
    assert result.returncode == 2
    assert "max_num_seqs" in result.stderr


def test_worker_with_embedded_defaults(tmp_path):
    """With no Redis and no model configured, the worker starts Valkey, builds the demo model, says
    which URL to use and serves `mlxq submit`. Ctrl-C (SIGINT to the whole process group, as a
    terminal sends it) lets a running request finish, then stops the worker and Valkey."""
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([*MLXQ, "worker", "--embedded-port", str(port)], cwd=ROOT, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while "worker ready" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert f"embedded Valkey at {url}" in log.read_text()
        hint = next(line.split()[0] for line in log.read_text().splitlines() if " submit --redis-url " in line)
        assert shutil.which(hint) or (ROOT / hint).is_file(), f"the hint's command {hint!r} cannot be run as shown"
        result = mlxq("submit", "--redis-url", url, "--max-tokens", "5", "Hi", env=env)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "cache" / "mlxq" / "demo-model" / "config.json").exists()
        assert (tmp_path / "cache" / "mlxq" / f"valkey-{port}" / "appendonlydir").is_dir()  # a directory a port
        with Client(url) as client:
            job = client.submit("A long one", max_tokens=1500)
            next(job.stream(timeout=30))
            os.killpg(process.pid, signal.SIGINT)
            assert job.result(timeout=60).finish_reason == "length"
        assert process.wait(60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_demo_model_command_builds_a_loadable_model(tmp_path):
    """`mlxq demo-model PATH` writes a model mlx-lm's ordinary load() accepts."""
    result = mlxq("demo-model", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    from mlx_lm import load

    model, tokenizer = load(str(tmp_path / "m"))
    assert tokenizer.has_chat_template and len(tokenizer.eos_token_ids) == 2


def test_demo_model_families_are_listed_and_need_vision(tmp_path):
    """`--family` takes one of the families mlx-vlm builds here, listed by --help, and only
    with --vision; `--vision` alone stays the Qwen2-VL model."""
    from mlxq.demo_vision import FAMILIES

    shown = mlxq("demo-model", "--help")
    assert all(family in shown.stdout for family in FAMILIES) and len(FAMILIES) >= 6
    refused = mlxq("demo-model", "--family", "gemma3", str(tmp_path / "x"))
    assert refused.returncode != 0 and "--family goes with --vision" in refused.stderr
    unknown = mlxq("demo-model", "--vision", "--family", "llava", str(tmp_path / "y"))
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_worker_exits_non_zero_when_the_model_cannot_load(valkey, tmp_path):
    """A model directory that holds no model stops the worker with status 1 and says why."""
    result = mlxq("worker", "--redis-url", valkey, "--model", str(tmp_path), "--queue", "nomodel",
                  env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert "the model could not be loaded" in result.stderr


def test_ctrl_c_on_submit_cancels_the_request(worker, tmp_path):
    """Interrupting `mlxq submit` cancels its request instead of leaving it to run."""
    rid = f"cli-interrupt-{time.monotonic_ns()}"
    log = tmp_path / "submit.log"
    with open(log, "wb") as out:
        # Its own SIGINT as a terminal gives it, even where the tests' runner ignores it
        # (a background job of a non-interactive shell does, and Python then keeps ignoring it).
        process = subprocess.Popen([*MLXQ, "submit", "--redis-url", worker.redis_url, "--queue", worker.queue,
                                    "--stream", "--max-tokens", "1500", "--id", rid, HELD_PROMPT],
                                   cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    r = redis.Redis.from_url(worker.redis_url)
    deadline = time.monotonic() + 30
    while not r.exists(KEYS.output(worker.queue, rid)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 130, f"SIGINT handler: {signal.getsignal(signal.SIGINT)}; " + log.read_text()[-2000:]
    last = None
    while not isinstance(last, Done):
        reply = r.xread({KEYS.output(worker.queue, rid): "0-0"}, count=10000, block=1000)
        last = decode_event(reply[0][1][-1][1])
        assert time.monotonic() < deadline + 30
    assert last.finish_reason == "cancelled"
    r.close()


def test_help_shows_every_default():
    """`--help` says the default of each option that has one."""
    assert "cancelled (default: 600.0)" in " ".join(mlxq("submit", "--help").stdout.split())
    assert "(default: 20)" in mlxq("dead", "--help").stdout
    assert "(default: 16; env MLXQ_MAX_NUM_SEQS)" in " ".join(mlxq("worker", "--help").stdout.split())


def test_common_mistakes_get_one_line_that_says_what_to_do(tmp_path):
    """Each mistake ends with one line on stderr, no traceback, and a non-zero status."""
    port = free_port()
    busy = socket.create_server(("127.0.0.1", 0))  # listens, but is not Redis
    busy_port = busy.getsockname()[1]
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('queue = "unterminated\n')
    cases = [
        (["submit", "--redis-url", f"redis://127.0.0.1:{port}", "Hi"], {}, 1,
         f"mlxq submit: cannot reach Redis at redis://127.0.0.1:{port}: connection refused: is Redis running on "
         "that host and port?; check --redis-url (MLXQ_REDIS_URL)"),
        (["submit", "--redis-url", "localhost:6379", "Hi"], {}, 2,
         "mlxq submit: --redis-url: 'localhost:6379' is not a Redis URL: write redis://localhost:6379 (rediss:// for "
         "TLS, unix:///path/to.sock for a socket, redis+sentinel://host:port,host:port/<primary> for Sentinel, "
         "redis+cluster://host:port,host:port for a Redis Cluster)"),
        (["status", "--redis-url", "redis://no-such-host.invalid:6379"], {}, 1,
         "mlxq status: cannot reach Redis at redis://no-such-host.invalid:6379: host name not resolved: "),
        (["worker", "--embedded-port", str(busy_port)], {}, 2,
         f"mlxq worker: port {busy_port} is in use by something that is not Redis, so the embedded Valkey cannot "
         "start there: free it, or set --embedded-port (MLXQ_EMBEDDED_PORT), or point --redis-url at your Redis"),
        (["worker", "--config", str(bad_toml)], {}, 2,
         f"mlxq worker: config file {bad_toml}: TOML syntax error: "),
        (["worker", "--model", str(tmp_path / "nope")], {}, 2,
         f"mlxq worker: invalid settings: model: {tmp_path / 'nope'} does not exist; give a model directory or a "
         "Hugging Face id such as mlx-community/Qwen3-0.6B-8bit"),
        (["worker"], {"MLXQ_MAX_NUM_SEQ": "4"}, 2,
         "mlxq worker: environment variable MLXQ_MAX_NUM_SEQ is not a worker setting (did you mean "
         "MLXQ_MAX_NUM_SEQS?); unset it"),
        (["redis", "stop", "--port", str(port)], {}, 1, f"mlxq redis: no Redis answers on 127.0.0.1:{port}"),
    ]
    try:
        for args, env, status, message in cases:
            result = mlxq(*args, env=env)
            assert result.returncode == status, (args, result.stderr)
            assert result.stderr.startswith(message), (args, result.stderr)
            assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    finally:
        busy.close()


def test_submit_warns_when_no_worker_serves_the_queue(valkey):
    """A request to a queue nobody serves: a warning after a few seconds, then, at the
    timeout, a message and the request cancelled rather than left for nobody."""
    queue = f"nobody-{time.monotonic_ns()}"
    result = mlxq("submit", "--redis-url", valkey, "--queue", queue, "--timeout", "7", "--id", queue, "Anyone?")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"mlxq submit: no live worker serves queue '{queue}' (see `")
    assert lines[1] == f"mlxq submit: request {queue}: no result within 7.0 s; it was cancelled (a larger --timeout " \
                       "waits longer)"
    r = redis.Redis.from_url(valkey)
    assert r.exists(KEYS.cancel_flag(queue, queue)), "the cancel flag is set, so no worker computes it later"
    r.close()


def test_every_command_and_the_client_find_the_same_redis(valkey):
    """One resolution (client/which_redis.py): the flag, else $MLXQ_REDIS_URL, else the
    embedded port $MLXQ_EMBEDDED_PORT. Each source is shown to reach the server by what
    only it holds: a queue bound of 1 that one entry fills (submit exits 75, queue full),
    a dead letter, the queue's length; the other commands reach it where nothing else
    answers (the embedded port is 1 unless it is the source)."""
    r = redis.Redis.from_url(valkey)
    queue = f"which-{os.getpid()}"
    r.hset(KEYS.limits(queue), "max_len", 1)
    r.xadd(KEYS.queue(queue), {"id": "filler", "json": "{}"})
    r.xadd(KEYS.dead(queue), {"reason": "which-redis marker", "field:id": "marked"})
    port = valkey.rsplit(":", 1)[1]
    sources = {"flag": (["--redis-url", valkey], {"MLXQ_REDIS_URL": "", "MLXQ_EMBEDDED_PORT": "1"}),
               "MLXQ_REDIS_URL": ([], {"MLXQ_REDIS_URL": valkey, "MLXQ_EMBEDDED_PORT": "1"}),
               "MLXQ_EMBEDDED_PORT": ([], {"MLXQ_REDIS_URL": "", "MLXQ_EMBEDDED_PORT": port})}
    client = ("from client import AsyncClient, Client\n"
              f"print(Client(queue={queue!r}).redis.hget({KEYS.limits(queue)!r}, 'max_len'))\n"
              f"print(AsyncClient().url)")
    for source, (flag, env) in sources.items():
        env = {**os.environ, **env}
        submitted = mlxq("submit", *flag, "--queue", queue, "Hi", env=env)
        assert submitted.returncode == 75 and "full" in submitted.stderr, (source, submitted.stderr)
        assert "which-redis marker" in mlxq("dead", "list", *flag, "--queue", queue, env=env).stdout, source
        shown = mlxq("status", *flag, "--queue", queue, "--json", env=env)
        streams = json.loads(shown.stdout)["streams"]
        assert [s["length"] for s in streams if s["lane"] is None] == [1], source
        assert {s["queue"] for s in streams} == {queue}, "--queue shows that queue alone"
        for command in (("adapters", "list", "--queue", queue), ("batch", "list"), ("keys", "list")):
            assert mlxq(*command, *flag, env=env).returncode == 0, (source, command)  # only that server answers
        if not flag:
            printed = subprocess.run([sys.executable, "-c", client], env=env, capture_output=True, text=True,
                                     timeout=60, cwd=ROOT)
            assert printed.stdout.split() == ["b'1'", valkey if source == "MLXQ_REDIS_URL" else
                                              f"redis://127.0.0.1:{port}"], (source, printed.stderr)
    r.close()


def test_two_embedded_servers_are_refused_one_data_directory(tmp_path):
    first_port, second_port = free_port(), free_port()
    data = tmp_path / "data"
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen([*MLXQ, "redis", "--port", str(first_port), "--dir", str(data)], cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "serving" in (tmp_path / "first.log").read_text(), what="the first server")
        second = mlxq("redis", "--port", str(second_port), "--dir", str(data))
        assert second.returncode == 2
        assert f"the data directory {data} is in use by the embedded Valkey on port {first_port}" in second.stderr
    finally:
        first.terminate()
        first.wait(30)
    alone = subprocess.Popen([*MLXQ, "redis", "--port", str(second_port), "--dir", str(data)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # once the first is gone, the directory is free
        assert alone.stdout is not None and b"serving" in alone.stdout.readline()
    finally:
        alone.terminate()
        alone.wait(30)
        if alone.stdout is not None:
            alone.stdout.close()


@pytest.mark.parametrize("config", sorted((ROOT / "config").glob("*.toml")), ids=lambda p: p.name)
def test_every_config_file_passes_its_check(config):
    command = "gateway" if config.name == "gateway.toml" else "worker"
    checked = mlxq(command, "--config", str(config), "--check")
    assert checked.returncode == 0 and "the settings are valid" in checked.stdout, checked.stderr


def test_a_config_with_an_unknown_key_fails_its_check(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('queue = "a"\nmax_num_seq = 4\n')
    checked = mlxq("worker", "--config", str(bad), "--check")
    assert checked.returncode == 2 and "max_num_seq" in checked.stderr and "max_num_seqs" in checked.stderr


def test_submit_chat_on_a_thinking_model_shows_the_reasoning_apart(valkey, thinking_model, logs_dir):
    """The answer on stdout, the reasoning on stderr: a thinking model's reply is never a blank line."""
    worker = start_worker(valkey, thinking_model, f"think-{os.getpid()}", logs_dir)
    try:
        for flags in ([], ["--stream"]):
            shown = mlxq("submit", "--redis-url", valkey, "--queue", worker.queue, "--chat", "--max-tokens", "24",
                         *flags, "Why queues?")
            assert shown.returncode == 0, shown.stderr
            assert "reasoning: " in shown.stderr and "<think>" not in shown.stdout, (flags, shown)
    finally:
        worker.stop()
