"""The dashboard in a real browser (Playwright driving Debian's chromium) against a live
gateway, real workers and Valkey: it signs in with a key, stays live without a reload,
shows what the fleet does, acts through Redis, escapes what requests carry, and refuses
those who may not see or act. Each view's screenshot is written where the README shows it."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from support import (
    HELD,
    KEYS,
    MLXQ,
    ROOT,
    free_port,
    own_valkey_fixture,
    start_gateway,
    start_worker,
    wait_for,
)

from client import Client, Done, JobCancelled, decode_event
from client.timeline import Sample

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    if os.environ.get("MLXQ_TEST_REQUIRE_BROWSER"):
        raise RuntimeError("MLXQ_TEST_REQUIRE_BROWSER is set but no chromium is installed (apt install chromium)")
    pytest.skip("no chromium here (apt install chromium)", allow_module_level=True)

ADMIN_KEY = "sk-dashboard-admin"
QUEUE = "dash"
SCREENSHOTS = ROOT / "docs" / "dashboard"
LIVE_S = 20_000  # ms a live change may take to show: a heartbeat bound (3 x 0.5 s) and a refresh, with room
VIEWS = {"fleet": "Fleet", "queues": "Queues", "running": "In flight", "dead": "Dead letters", "batches": "Batches",
         "charts": "The last hour"}
HOSTILE_PROMPT = "<script>window.__pwned = 1</script>"
HOSTILE_MODEL = '"><img src=x onerror="window.__pwned = 2">'


own_valkey = own_valkey_fixture("dashboard")


@pytest.fixture(scope="module")
def r(own_valkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(own_valkey)
    yield client
    client.close()


def _worker(own_valkey, demo_model, logs_dir, name: str):
    return start_worker(own_valkey, demo_model, QUEUE, logs_dir, consumer=name, timeline_s=0.5)


@pytest.fixture(scope="module")
def workers(own_valkey, demo_model, logs_dir):
    started = [_worker(own_valkey, demo_model, logs_dir, f"dash-{n}") for n in ("a", "b")]
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def gateway(own_valkey, workers, logs_dir):
    started = start_gateway(own_valkey, logs_dir, "--api-keys", ADMIN_KEY, "--batch-lease-s", "2")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def viewer_key(own_valkey, gateway) -> str:
    return _make_key(own_valkey, "ops", "--role", "viewer")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


class Console:
    """A page's console errors and uncaught exceptions: a clean page has none."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: self.errors.append(str(error)))


def _make_key(redis_url: str, tenant: str, *flags: str) -> str:
    made = subprocess.run([*MLXQ, "keys", "create", "--redis-url", redis_url, "--tenant", tenant, "--json", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)["key"]


def _signed_in(browser, gateway, key: str):
    """A new browser context signed in with `key`, on the fleet view; and its console."""
    context = browser.new_context(viewport={"width": 1400, "height": 800})
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the buttons that ask first
    console = Console(page)
    page.goto(f"{gateway.url}/dashboard")
    expect(page).to_have_url(re.compile(r"/dashboard/login$"))
    page.fill("input[name=key]", key)
    page.click("text=Sign in")
    expect(page.locator("h1")).to_have_text("Fleet")
    return page, console


def _row(page, worker: str):
    return page.locator(f"tr[data-worker='{worker}']")


def _serve_some(own_valkey) -> None:
    with Client(own_valkey, queue=QUEUE) as client:
        for n in range(4):
            client.generate(prompt=f"Once upon a time {n}", max_tokens=8, timeout=120)


def test_the_views_load_clean_and_show_both_workers(browser, gateway, workers, own_valkey, r):
    _serve_some(own_valkey)
    wait_for(lambda: any(Sample.from_wire(i, f).finished for i, f in r.xrange(KEYS.timeline)),
             what="a timeline sample that counts a finished request")
    page, console = _signed_in(browser, gateway, ADMIN_KEY)
    for worker in workers:
        expect(_row(page, worker.consumer).locator("td.state")).to_have_text("serving")
    for view, heading in VIEWS.items():
        page.goto(f"{gateway.url}/dashboard/{view}")
        expect(page.locator("h1")).to_have_text(heading)
    expect(page.locator("svg.chart polyline").first).to_be_attached()
    page.goto(f"{gateway.url}/dashboard/queues")
    expect(page.locator(f"tr[data-queue='{QUEUE}'][data-lane='(queue)'] td").nth(8)).not_to_have_text("")
    assert console.errors == []


def test_a_worker_killed_turns_dead_on_the_open_page(browser, gateway, own_valkey, demo_model, logs_dir):
    doomed = _worker(own_valkey, demo_model, logs_dir, f"dash-doomed-{uuid.uuid4().hex[:4]}")
    try:
        page, console = _signed_in(browser, gateway, ADMIN_KEY)
        expect(_row(page, doomed.consumer).locator("td.state")).to_have_text("serving", timeout=LIVE_S)
        first_load = page.evaluate("performance.getEntriesByType('navigation')[0].startTime")
        doomed.signal(signal.SIGKILL)
        expect(_row(page, doomed.consumer).locator("td.state")).to_have_text("dead", timeout=LIVE_S)
        assert page.evaluate("performance.getEntriesByType('navigation')[0].startTime") == first_load  # no reload
        assert console.errors == []
    finally:
        doomed.stop()


def test_drain_from_the_page_drains_that_worker(browser, gateway, own_valkey, demo_model, logs_dir, workers):
    drained = _worker(own_valkey, demo_model, logs_dir, f"dash-drained-{uuid.uuid4().hex[:4]}")
    try:
        page, _ = _signed_in(browser, gateway, ADMIN_KEY)
        _row(page, drained.consumer).locator("button", has_text="Drain").click()
        assert drained.wait(60) == 0
        assert "drain asked through Redis" in drained.log()
        expect(_row(page, drained.consumer).locator("td.state")).to_have_text("stopped", timeout=LIVE_S)
        for worker in workers:  # the others serve on
            assert worker.process.poll() is None
            expect(_row(page, worker.consumer).locator("td.state")).to_have_text("serving")
    finally:
        drained.stop()


def test_a_dead_letter_retried_from_the_page_is_served(browser, gateway, workers, r):
    r.xadd(KEYS.queue(QUEUE), {"json": json.dumps({"prompt": "Back from the dead", "max_tokens": 4})})  # no id
    entry = wait_for(lambda: r.xrange(KEYS.dead(QUEUE)), what="a dead letter")[-1][0].decode()
    page, console = _signed_in(browser, gateway, ADMIN_KEY)
    page.goto(f"{gateway.url}/dashboard/dead")
    page.locator(f"tr[data-entry='{entry}']").locator("button", has_text="Retry").click()
    expect(page.locator(f"tr[data-entry='{entry}']")).to_have_count(0)
    assert not r.xrange(KEYS.dead(QUEUE), entry, entry)
    stream = wait_for(lambda: next(iter(r.scan_iter(match=KEYS.output(QUEUE, "dead-r*"), count=1000)), None),
                      what="the requeued request's output stream")
    terminal = wait_for(lambda: [e for e in (decode_event(f) for _, f in r.xrange(stream)) if e.type != "delta"],
                        what="the requeued request's end")
    assert isinstance(terminal[0], Done) and terminal[0].text
    assert console.errors == []


def test_markup_a_request_carries_renders_as_text(browser, gateway, workers, r):
    body = {"prompt": HOSTILE_PROMPT, "model": HOSTILE_MODEL, "max_tokens": 4}
    r.xadd(KEYS.queue(QUEUE), {"json": json.dumps(body), "reason": HOSTILE_MODEL})  # no id: dead-lettered
    entry = wait_for(lambda: [e for e, f in r.xrange(KEYS.dead(QUEUE)) if b"onerror" in f.get(b"field:json", b"")],
                     what="the hostile dead letter")[-1].decode()
    page, console = _signed_in(browser, gateway, ADMIN_KEY)
    page.goto(f"{gateway.url}/dashboard/dead")
    page.locator(f"tr[data-entry='{entry}'] a").click()
    letter = page.locator("#letter")
    expect(letter).to_contain_text(HOSTILE_PROMPT)
    expect(letter).to_contain_text(HOSTILE_MODEL)
    assert page.locator("#letter img").count() == 0 and page.locator("#letter script").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert console.errors == []
    for path in (f"dead/{QUEUE}/not-an-id", "dead/a:b/1-0", "nowhere"):  # what is no dead letter or view: 404
        assert page.goto(f"{gateway.url}/dashboard/{path}").status == 404


def test_a_batch_bar_advances_to_done_on_the_open_page(browser, gateway, workers):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ADMIN_KEY, max_retries=0) as api:
        _a_batch_advances(browser, gateway, api)


def _a_batch_advances(browser, gateway, api) -> None:
    lines = [{"custom_id": str(n), "method": "POST", "url": "/v1/completions",
              "body": {"model": QUEUE, "prompt": f"Line {n}", "max_tokens": 4}} for n in range(3)]
    file_id = api.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                               purpose="batch").id
    page, console = _signed_in(browser, gateway, ADMIN_KEY)
    page.goto(f"{gateway.url}/dashboard/batches")
    batch = api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    row = page.locator(f"tr[data-batch='{batch.id}']")
    expect(row.locator("td.status")).to_have_text("completed", timeout=60_000)
    expect(row.locator("td.done")).to_have_text("3")
    expect(row.locator("progress")).to_have_attribute("value", "3")
    assert console.errors == []


def test_a_request_cancelled_from_the_page_ends_cancelled(browser, gateway, workers, own_valkey):
    with Client(own_valkey, queue=QUEUE) as client:
        job = client.submit(**HELD)
        page, console = _signed_in(browser, gateway, ADMIN_KEY)
        page.goto(f"{gateway.url}/dashboard/running")
        page.locator(f"tr[data-request='{job.id}']").locator("button", has_text="Cancel").click(timeout=LIVE_S)
        with pytest.raises(JobCancelled):
            job.result(timeout=60)
    assert console.errors == []


def test_without_a_key_the_dashboard_is_refused(gateway, own_valkey):
    with httpx.Client(base_url=gateway.url) as http:
        assert http.get("/dashboard").headers["location"] == "/dashboard/login"
        assert http.get("/dashboard/fleet", params={"fragment": "1"}).status_code == 401
        assert http.post("/dashboard/act/drain", data={"consumer": "x", "instance": "y"}).status_code == 401
        assert http.post("/dashboard/login", data={"key": "sk-wrong"}).status_code == 401
        user_key = _make_key(own_valkey, "team-a")
        refused = http.post("/dashboard/login", data={"key": user_key})
        assert refused.status_code == 401 and "user key" in refused.text


def test_a_viewer_sees_but_the_server_refuses_its_buttons(browser, gateway, viewer_key, workers, r):
    page, console = _signed_in(browser, gateway, viewer_key)
    target = workers[0]
    row = _row(page, target.consumer)
    expect(row.locator("td.state")).to_have_text("serving")
    expect(row.locator("button", has_text="Drain")).to_be_disabled()
    expect(page.locator("header .who")).to_contain_text("read only")
    form = row.locator("form.act")
    fields = {name: form.locator(f"input[name={name}]").get_attribute("value")
              for name in ("csrf", "consumer", "instance")}
    answer = page.request.post(f"{gateway.url}/dashboard/act/drain", form=fields, max_redirects=0)
    assert answer.status == 403 and "viewer" in answer.text()
    assert r.get(KEYS.drain(target.consumer)) is None and target.process.poll() is None
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=viewer_key, max_retries=0) as api, \
            pytest.raises(openai.PermissionDeniedError):  # and no API
        api.models.list()
    assert console.errors == []


def test_an_action_without_the_sessions_csrf_token_is_refused(browser, gateway, workers, r):
    page, _ = _signed_in(browser, gateway, ADMIN_KEY)
    target = workers[1]
    instance = _row(page, target.consumer).locator("input[name=instance]").get_attribute("value")
    answer = page.request.post(f"{gateway.url}/dashboard/act/drain", max_redirects=0,
                               form={"csrf": "forged", "consumer": target.consumer, "instance": instance})
    assert answer.status == 403 and "CSRF" in answer.text()
    assert r.get(KEYS.drain(target.consumer)) is None


def test_the_dashboard_alone_serves_the_same_pages(own_valkey, workers, logs_dir):
    port = free_port()
    with open(logs_dir / "dashboard.log", "ab") as log:
        process = subprocess.Popen([*MLXQ, "dashboard", "--redis-url", own_valkey, "--port", str(port),
                                    "--api-keys", ADMIN_KEY], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url) as http:
            wait_for(lambda: _answers(http), what="mlxq dashboard listening")
            signed = http.post("/dashboard/login", data={"key": ADMIN_KEY})
            assert signed.status_code == 303
            page = http.get("/dashboard/fleet")
            assert all(w.consumer in page.text for w in workers)
            assert http.post("/v1/chat/completions", json={}).status_code == 404  # no API here
    finally:
        process.terminate()
        process.wait(30)


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def test_each_view_is_written_as_a_screenshot_where_the_readme_shows_it(browser, gateway, workers, own_valkey, r,
                                                                      tmp_path):
    """Last in this module, so that the views have something to show: the batch and the
    dead letters of the tests before, and a request held while the pictures are taken.
    Into docs/dashboard with `MLXQ_UPDATE_SCREENSHOTS=1`; else a test run leaves the
    tracked pictures as they are."""
    readme = (ROOT / "README.md").read_text()
    folder = SCREENSHOTS if os.environ.get("MLXQ_UPDATE_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    with Client(own_valkey, queue=QUEUE) as client:
        held = client.submit(**HELD)
        page, console = _signed_in(browser, gateway, ADMIN_KEY)
        page.goto(f"{gateway.url}/dashboard/running")
        expect(page.locator(f"tr[data-request='{held.id}']")).to_be_visible(timeout=LIVE_S)
        for view, heading in VIEWS.items():
            page.goto(f"{gateway.url}/dashboard/{view}")
            expect(page.locator("h1")).to_have_text(heading)
            page.screenshot(path=str(folder / f"{view}.png"), full_page=True)
            assert (folder / f"{view}.png").read_bytes().startswith(b"\x89PNG")
            assert f"docs/dashboard/{view}.png" in readme and (SCREENSHOTS / f"{view}.png").is_file()
        held.cancel()
    assert console.errors == []
