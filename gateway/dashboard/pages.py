"""The dashboard's routes: sign-in, six views (each also as a fragment, which the page's
script fetches every `REFRESH_S` to stay live), a dead letter's body, and the actions.

Pages are rendered on the server by Jinja with escaping on, under a Content-Security-Policy
that runs only the dashboard's own script: a prompt, a model name or a dead letter's
reason shows as text whatever it holds. Actions are POSTs with the session's CSRF token,
checked on the server, so a viewer's buttons are refused there, not only hidden.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from jinja2 import Environment, PackageLoader, select_autoescape
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from client import AsyncClient
from client.connect import connect
from client.dead_letters import DeadLetterError, DeadLetters
from client.diagnose import describe

from ..errors import ApiError
from ..tenants import ADMIN
from . import views
from .access import COOKIE, SESSION_TTL_S, Refused, Sessions, Viewer

log = structlog.get_logger("mlxq.dashboard")

REFRESH_S = 2.0
SNAPSHOT_FRESH_S = 0.5  # pages asked for within this of one another share one read of Redis
VIEWS = {"fleet": "Fleet", "queues": "Queues", "running": "In flight", "dead": "Dead letters",
         "batches": "Batches", "charts": "Charts"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin", "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
Handler = Callable[[Request], Awaitable[Response]]
SHAPES = {"queue": re.compile(r"[A-Za-z0-9_.\-]{1,128}"), "entry_id": re.compile(r"[0-9]{1,20}-[0-9]{1,20}")}


class Dashboard:
    """The dashboard of one gateway (or of `mlxq dashboard`, alone)."""

    def __init__(self, client: AsyncClient, sessions: Sessions, batches: Any, redis_url: str) -> None:
        self.client = client
        self.keys = client.keys
        self.sessions = sessions
        self.batches = batches  # the gateway's `Batches`: listing and cancelling with its rules
        self.redis = connect(redis_url)  # blocking reads (the fleet, dead letters) run in threads
        self.templates = Environment(loader=PackageLoader("gateway.dashboard"), autoescape=select_autoescape(
            default=True, default_for_string=True), trim_blocks=True, lstrip_blocks=True)
        self._snapshot: tuple[float, views.Snapshot] | None = None

    def routes(self) -> list[BaseRoute]:
        static = Path(__file__).parent / "static"
        return [
            Route("/dashboard", self._page(self.view)),
            Route("/dashboard/login", self._page(self.login), methods=["GET", "POST"]),
            Route("/dashboard/logout", self._page(self.logout), methods=["POST"]),
            Route("/dashboard/dead/{queue}/{entry_id}", self._page(self.dead_letter)),
            Route("/dashboard/act/{action}", self._page(self.act), methods=["POST"]),
            Mount("/dashboard/static", StaticFiles(directory=static), name="dashboard-static"),
            Route("/dashboard/{view}", self._page(self.view)),
        ]

    def close(self) -> None:
        self.redis.close()

    # ---- pages ----------------------------------------------------------------------

    async def view(self, request: Request) -> Response:
        viewer = await self._viewer(request)
        if viewer is None:
            return self._to_login(request)
        name = request.path_params.get("view", "fleet")
        if name not in VIEWS:
            return self._render("message.html", viewer, status=404, title="Not found",
                                message=f"There is no view {name!r}.")
        context = await self._context(name)
        template = f"{name}.html"
        if request.query_params.get("fragment") == "1":
            return self._render(template, viewer, fragment=True, view=name, **context)
        return self._render("page.html", viewer, view=name, body=template, refresh_s=REFRESH_S, **context)

    async def dead_letter(self, request: Request) -> Response:
        viewer = await self._viewer(request)
        if viewer is None:
            return self._to_login(request)
        queue, entry_id = request.path_params["queue"], request.path_params["entry_id"]
        well_formed = SHAPES["queue"].fullmatch(queue) and SHAPES["entry_id"].fullmatch(entry_id)
        letter = await asyncio.to_thread(views.dead_letter, self.redis, self.keys, queue, entry_id) \
            if well_formed else None
        if letter is None:
            return self._render("message.html", viewer, status=404, title="Not found",
                                message=f"No dead letter {entry_id} in queue {queue}.")
        return self._render("page.html", viewer, view="dead", body="letter.html", refresh_s=0, queue=queue,
                            letter=letter, fields=views.shown_fields(letter))

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            if await self.sessions.open_gateway():  # nothing to sign in with: a session at once
                return self._signed_in(await self.sessions.open_anonymous(), _https(request))
            return self._render("login.html", None)
        form = await request.form(max_files=0, max_fields=4, max_part_size=4096)
        try:
            token = await self.sessions.open(str(form.get("key", "")).strip())
        except Refused as e:
            return self._render("login.html", None, status=401, error=str(e))
        return self._signed_in(token, _https(request))

    async def logout(self, request: Request) -> Response:
        viewer = await self._viewer(request)
        if viewer is not None and await self._csrf_ok(request, viewer):
            await self.sessions.close(request.cookies.get(COOKIE, ""))
        response = RedirectResponse("/dashboard/login", status_code=303)
        response.delete_cookie(COOKIE, path="/dashboard")
        return response

    # ---- actions --------------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        """One button's action; refused (403) without a session's CSRF token or to a viewer."""
        viewer = await self._viewer(request)
        if viewer is None:
            return self._render("message.html", None, status=401, title="Signed out",
                                message="Sign in again: this session has ended.")
        form = await request.form(max_files=0, max_fields=8, max_part_size=4096)
        if not viewer.csrf_matches(str(form.get("csrf", ""))):
            return self._render("message.html", viewer, status=403, title="Refused",
                                message="This form is stale or came from another site (its CSRF token does not "
                                        "match): reload the page and try again.")
        if not viewer.may_act:
            return self._render("message.html", viewer, status=403, title="Refused",
                                message="This is a viewer's session: it sees the fleet but cannot act on it.")
        action = request.path_params["action"]
        fields = {k: str(v) for k, v in form.items()}
        try:
            done = await self._carry_out(action, fields)
        except (ApiError, DeadLetterError) as e:
            message = e.message if isinstance(e, ApiError) else str(e)
            return self._render("message.html", viewer, status=409, title="Not done", message=message)
        log.info("dashboard action", action=action, by=viewer.name, **{k: v for k, v in fields.items() if k != "csrf"})
        self._snapshot = None
        return RedirectResponse(_back(fields.get("back"), done), status_code=303)

    async def _carry_out(self, action: str, fields: dict[str, str]) -> str:
        """Do `action`; returns the view to go back to."""
        if action == "drain":  # a worker, or the model a host runs in it (unloading is its drain)
            consumer, instance = fields.get("consumer", ""), fields.get("instance", "")
            if not consumer or not instance:
                raise ApiError.invalid("drain: which worker (consumer and instance)")
            await self.client.redis.set(self.keys.drain(consumer), instance, ex=3600)
            return "fleet"
        if action == "cancel":
            await self.client.cancel(_field(fields, "id"), queue=_field(fields, "queue"))
            return "running"
        if action in ("retry", "discard"):
            letters = DeadLetters(self.redis, self.keys, _field(fields, "queue"))
            entry_id = _field(fields, "entry_id")
            if action == "retry":
                await asyncio.to_thread(letters.requeue, entry_id)
            else:
                await asyncio.to_thread(letters.purge, [entry_id])
            return "dead"
        if action == "cancel_batch":
            await self.batches.cancel(_field(fields, "batch_id"), ADMIN)
            return "batches"
        raise ApiError(404, f"no action {action!r}", "invalid_request_error", "not_found")

    # ---- parts ----------------------------------------------------------------------

    async def _context(self, view: str) -> dict[str, Any]:
        snapshot = await self._read_snapshot()
        if view == "fleet":
            return {"workers": views.worker_rows(snapshot), "models": views.model_rows(snapshot)}
        if view == "queues":
            return {"queues": views.queue_rows(snapshot)}
        if view == "running":
            return {"running": views.running_rows(snapshot)}
        if view == "dead":
            queues = sorted({s.queue for s in snapshot.fleet.streams})
            return {"letters": await asyncio.to_thread(views.dead_rows, self.redis, self.keys, queues)}
        if view == "batches":
            batches, _ = await self.batches.store.listing(None, 50, None)
            return {"batches": views.batch_rows(batches, time.time())}
        return {"charts": views.charts(snapshot)}

    async def _read_snapshot(self) -> views.Snapshot:
        now = time.monotonic()
        if self._snapshot is None or now - self._snapshot[0] > SNAPSHOT_FRESH_S:
            self._snapshot = (now, await asyncio.to_thread(views.read_snapshot, self.redis, self.keys))
        return self._snapshot[1]

    async def _viewer(self, request: Request) -> Viewer | None:
        return await self.sessions.who(request.cookies.get(COOKIE))

    async def _csrf_ok(self, request: Request, viewer: Viewer) -> bool:
        form = await request.form(max_files=0, max_fields=4, max_part_size=4096)
        return viewer.csrf_matches(str(form.get("csrf", "")))

    def _to_login(self, request: Request) -> Response:
        if request.query_params.get("fragment") == "1":  # the live refresh: the page reloads to the sign-in
            return Response("signed out", status_code=401, headers=HEADERS)
        return RedirectResponse("/dashboard/login", status_code=303, headers=HEADERS)

    def _signed_in(self, token: str, secure: bool) -> Response:
        response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(COOKIE, token, max_age=SESSION_TTL_S, path="/dashboard", httponly=True,
                            samesite="strict", secure=secure)
        return response

    def _render(self, template: str, viewer: Viewer | None, status: int = 200, **context: Any) -> Response:
        html = self.templates.get_template(template).render(viewer=viewer, views=VIEWS, **context)
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    def _page(self, handler: Handler) -> Handler:
        """`handler` with Redis failures answered as a page, not a stack trace."""
        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except (RedisError, OSError) as e:
                log.warning("dashboard: Redis unreachable", error=describe(e))
                return self._render("message.html", None, status=503, title="Redis did not answer",
                                    message=f"The queue's Redis did not answer this page: {describe(e)}")
        return answer


def _field(fields: dict[str, str], name: str) -> str:
    value = fields.get(name, "")
    if not value:
        raise ApiError.invalid(f"the form lacks {name!r}")
    pattern = SHAPES.get(name)
    if pattern is not None and not pattern.fullmatch(value):
        raise ApiError.invalid(f"{name} {value[:80]!r} is not one")
    return value


def _https(request: Request) -> bool:
    """Whether the browser came over HTTPS (directly, or through a proxy that says so)."""
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"


def _back(given: str | None, view: str) -> str:
    """Where to go after an action: the page it was pressed on when that is one of ours."""
    if given and given.startswith("/dashboard") and given.isprintable() and "\\" not in given:
        return given
    return f"/dashboard/{view}"
