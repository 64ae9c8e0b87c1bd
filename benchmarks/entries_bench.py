"""Every entry point against its unprotected twin, in one interleaved run.

``python -m benchmarks.entries_bench [--rounds R] [--batch N] [--write]`` prints one JSON
object; ``--write`` also puts its section into ``benchmarks/RESULTS.md`` (``make bench``
renders the same section from its own run).

One process and two uvicorn servers (Django's defaults, and Django's pool), on the
PostgreSQL database ``django_idempotency_bench_entries`` (created when missing), Django's
defaults otherwise (no prepared statements, no pooler; connections kept, ``CONN_MAX_AGE =
600``). Every operation
does the same single ``INSERT``; each entry point runs as its unprotected twin, protected
with a new key (a first operation: the claim, the work's transaction, the completion) and
protected with a key it has seen (a replay: one indexed read, the work not run):

- ``drf``: ``IdempotencyMixin`` first in a DRF ``APIView`` / the same ``APIView`` (the
  yardstick: every other entry point's ratio should stay at or below it);
- ``django-view``: a Django function view under ``@idempotent`` / the same view;
- ``async-view``: an ``async def`` view under ``@idempotent`` / the same view, served by
  uvicorn (one worker), requests one after another on a kept-alive connection; under ASGI
  Django opens a PostgreSQL session per request whatever ``CONN_MAX_AGE`` says;
- ``async-view-pool``: the same two views on a second uvicorn whose Django keeps its
  sessions in its connection pool (``OPTIONS["pool"]``, what docs/deployment.md
  recommends under ASGI);
- ``ninja``: a django-ninja operation under ``ninja.idempotent`` / the same operation;
- ``run-once``: ``run_once(write, ...)`` / ``write()``;
- ``celery-task``: ``@shared_task`` over ``@idempotent_task()`` / ``@shared_task``, each run
  with ``apply(task_id=...)`` (Celery's eager path: no broker, the worker's own code);
- ``django-task``: ``@task()`` over ``@idempotent_task()`` / ``@task()`` of Django's Tasks
  framework, enqueued on its ``ImmediateBackend`` (it runs at once), the protected one with
  the outbox message id a relay hands it;
- ``mcp`` and ``fastmcp``: a tool under ``@idempotent_tool(account=...)`` / the same tool
  unprotected, on the SDK's ``MCPServer`` and on FastMCP, called through each framework's
  own in-memory client (``Client(server)``) on an event loop in a thread of its own;
- ``mcp-async``: the same on ``MCPServer`` for an ``async def`` tool, whose write goes
  through ``sync_to_async`` (the engine runs on a thread of its own, the unprotected tool's
  ORM call on asgiref's).

The HTTP entry points (drf, django-view, ninja) go through Django's WSGI handler in this process, as
``connections_bench.py`` does. Rounds run every (entry point, protected or not) batch back
to back, in an order that rotates from round to round; the figures are the median time per
operation over all rounds, and per entry point the ratio of the protected median (first
operation, replay) to the twin's, with the spread of the per-round ratios. The work's rows
are counted at the end of every round: one per twin and per first operation, none per
replay.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

# At the top: ninja reads the operations' annotations from this module's globals.
from django.http import HttpRequest, HttpResponse, JsonResponse

# The work (one INSERT into connections_bench's table), its reset, a request through WSGI.
from benchmarks.connections_bench import TABLE, reset, write
from benchmarks.connections_bench import post as wsgi_post

DATABASE = "django_idempotency_bench_entries"
ROOT = Path(__file__).resolve().parent.parent
ENTRIES = (
    "drf",
    "django-view",
    "async-view",
    "async-view-pool",
    "ninja",
    "run-once",
    "celery-task",
    "django-task",
    "mcp",
    "mcp-async",
    "fastmcp",
)
VARIANTS = ("twin", "ours", "replay")
#: The key every replay sends (its record made once, before the warm-up).
SEEN = "entries-bench-seen-key"
BODY = b'{"amount": 1}'  # as connections_bench.post sends it
HAS_DJANGO_TASKS = importlib.util.find_spec("django.tasks") is not None
#: Set in the environment of the uvicorn server whose Django pools its connections.
POOLED = "ENTRIES_BENCH_POOLED"


def configure() -> None:
    """Django on the benchmark's own database; the URLconf is this module."""
    import django
    from django.conf import settings

    from benchmarks.site_setup import ensure_database, postgres_database

    ensure_database(DATABASE)
    if settings.configured:
        return
    apps = [
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "rest_framework",
        "django_idempotency",
    ]
    if not HAS_DJANGO_TASKS:
        apps.append("django_tasks")
    immediate = (
        "django.tasks.backends.immediate.ImmediateBackend"
        if HAS_DJANGO_TASKS
        else "django_tasks.backends.immediate.ImmediateBackend"
    )
    database = postgres_database(DATABASE)
    if os.environ.get(POOLED) == "1":  # the uvicorn server of "async-view-pool"
        database.update(CONN_MAX_AGE=0, OPTIONS={"pool": {"min_size": 1, "max_size": 4}})
    settings.configure(
        DATABASES={"default": database},
        INSTALLED_APPS=apps,
        ROOT_URLCONF="benchmarks.entries_bench",
        ALLOWED_HOSTS=["*"],
        USE_TZ=True,
        SECRET_KEY="django-idempotency-entries-bench",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        MIDDLEWARE=[],
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "UNAUTHENTICATED_USER": None,
        },
        TASKS={"default": {"BACKEND": immediate}},
        # The caller's account from a header: every HTTP entry point scopes keys alike.
        IDEMPOTENCY={"ACCOUNT_RESOLVER": "benchmarks.entries_bench.account"},
        LOGGING_CONFIG=None,
    )
    django.setup()


def account(request: Any) -> str | None:
    value: str | None = request.META.get("HTTP_X_ACCOUNT")
    return value


# -- the entry points, made once Django is configured -------------------------------------------

urlpatterns: list[Any] = []
CALLS: dict[str, Any] = {}


def build() -> None:
    """The views (this module's URLconf), the tasks and the calls of the in-process kinds."""
    from asgiref.sync import sync_to_async
    from celery import Celery, shared_task
    from django.urls import path
    from ninja import NinjaAPI
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from benchmarks import entries_tasks
    from django_idempotency import run_once
    from django_idempotency.decorators import idempotent
    from django_idempotency.drf import IdempotencyMixin
    from django_idempotency.ninja import idempotent as ninja_idempotent
    from django_idempotency.tasks import MESSAGE_ARGUMENT, idempotent_task

    class TwinView(APIView):
        def post(self, request: Request) -> Response:
            return Response({"id": write()}, status=201)

    class OursView(IdempotencyMixin, TwinView):
        idempotency_operation = "bench.drf"

    api = NinjaAPI(urls_namespace="bench-entries")

    @api.post("/twin")
    def ninja_twin(request: HttpRequest) -> Any:
        return {"id": write()}

    @api.post("/ours")
    @ninja_idempotent(operation="bench.ninja")
    def ninja_ours(request: HttpRequest) -> Any:
        return {"id": write()}

    def view_twin(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": write()}, status=201)

    @idempotent(operation="bench.view")
    def view_ours(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": write()}, status=201)

    async def async_twin(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": await sync_to_async(write)()}, status=201)

    @idempotent(operation="bench.async")
    async def async_ours(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": await sync_to_async(write)()}, status=201)

    from benchmarks import entries_bench

    entries_bench.urlpatterns[:] = [
        path("drf/twin/", TwinView.as_view()),
        path("drf/ours/", OursView.as_view()),
        path("view/twin/", view_twin),
        path("view/ours/", view_ours),
        path("ninja/", api.urls),
        path("async/twin/", async_twin),
        path("async/ours/", async_ours),
    ]

    app = Celery("bench-entries", set_as_current=True)
    app.conf.update(task_always_eager=True, broker_url="memory://", result_backend=None)

    @shared_task(name="bench.celery_twin")
    def celery_twin(n: int) -> int:
        return write()

    @shared_task(name="bench.celery_ours")
    @idempotent_task()
    def celery_ours(n: int) -> int:
        return write()

    def new_key() -> str:
        return uuid.uuid4().hex

    def once(key: str) -> int:
        return run_once(write, account="bench", operation="bench.run-once", key=key)

    CALLS.update(
        {
            "run-once|twin": lambda: write(),
            "run-once|ours": lambda: once(new_key()),
            "run-once|replay": lambda: once(SEEN),
            "celery-task|twin": lambda: celery_twin.apply((1,), task_id=new_key()).get(),
            "celery-task|ours": lambda: celery_ours.apply((1,), task_id=new_key()).get(),
            "celery-task|replay": lambda: celery_ours.apply((1,), task_id=SEEN).get(),
            "django-task|twin": lambda: entries_tasks.twin.enqueue(1),
            "django-task|ours": lambda: entries_tasks.ours.enqueue(
                1, **{MESSAGE_ARGUMENT: new_key()}
            ),
            "django-task|replay": lambda: entries_tasks.ours.enqueue(1, **{MESSAGE_ARGUMENT: SEEN}),
        }
    )


PATHS = {
    "drf|twin": "/drf/twin/",
    "drf|ours": "/drf/ours/",
    "django-view|twin": "/view/twin/",
    "django-view|ours": "/view/ours/",
    "ninja|twin": "/ninja/twin",
    "ninja|ours": "/ninja/ours",
    "async-view|twin": "/async/twin/",
    "async-view|ours": "/async/ours/",
    "async-view-pool|twin": "/async/twin/",
    "async-view-pool|ours": "/async/ours/",
}


class Tools:
    """The tool entry points: an ``MCPServer`` and a FastMCP server, each with the tool
    unprotected and protected, and each framework's in-memory client, open on an event loop
    in a thread of its own for the whole run."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.clients: dict[str, Any] = {}
        self.closed = asyncio.run_coroutine_threadsafe(self.serve(), self.loop)
        ready = asyncio.run_coroutine_threadsafe(self.ready(), self.loop)
        ready.result(timeout=60)

    async def serve(self) -> None:
        import asyncio

        import fastmcp
        from mcp import Client

        self.stop = asyncio.Event()
        async with Client(mcp_server()) as sdk, fastmcp.Client(fastmcp_server()) as fast:
            self.clients.update({"mcp": sdk, "fastmcp": fast})
            await self.stop.wait()

    async def ready(self) -> None:
        import asyncio

        while len(self.clients) < 2:
            if self.closed.done():
                self.closed.result()  # the error that ended serve()
            await asyncio.sleep(0.05)

    def batch(self, framework: str, variant: str, size: int) -> float:
        """``size`` calls, one after another; microseconds per call."""
        import asyncio

        timed = asyncio.run_coroutine_threadsafe(self.calls(framework, variant, size), self.loop)
        return timed.result()

    async def calls(self, framework: str, variant: str, size: int) -> float:
        from benchmarks.mcp_bench import call_tool

        client = self.clients[framework.removesuffix("-async")]
        suffix = "_async" if framework.endswith("-async") else ""
        began = time.perf_counter()
        for _ in range(size):
            arguments: dict[str, Any]
            if variant == "twin":
                tool, arguments = "twin", {"amount": 1}
            else:
                key = SEEN if variant == "replay" else uuid.uuid4().hex
                tool, arguments = "ours", {"amount": 1, "idempotency_key": key}
            await call_tool(client, framework, tool + suffix, arguments, f"{framework}|{variant}")
        return (time.perf_counter() - began) / size * 1e6

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.closed.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def mcp_server() -> Any:
    from asgiref.sync import sync_to_async
    from mcp.server.mcpserver import MCPServer

    from django_idempotency.mcp import idempotent_tool

    server = MCPServer("bench-entries")

    @server.tool()
    def twin(amount: int) -> dict[str, int]:
        return {"id": write()}

    @server.tool()
    @idempotent_tool(account="bench", operation="bench.mcp")
    def ours(amount: int, idempotency_key: str) -> dict[str, int]:
        return {"id": write()}

    @server.tool()
    async def twin_async(amount: int) -> dict[str, int]:
        return {"id": await sync_to_async(write)()}

    @server.tool()
    @idempotent_tool(account="bench", operation="bench.mcp-async")
    async def ours_async(amount: int, idempotency_key: str) -> dict[str, int]:
        return {"id": await sync_to_async(write)()}

    return server


def fastmcp_server() -> Any:
    from fastmcp import FastMCP

    from django_idempotency.fastmcp import idempotent_tool

    server = FastMCP("bench-entries")

    @server.tool
    def twin(amount: int) -> dict[str, int]:
        return {"id": write()}

    @server.tool
    @idempotent_tool(account="bench", operation="bench.fastmcp")
    def ours(amount: int, idempotency_key: str) -> dict[str, int]:
        return {"id": write()}

    return server


def asgi() -> Any:
    """The ASGI application uvicorn serves (``--factory``)."""
    configure()
    build()
    from django.core.asgi import get_asgi_application

    logging.getLogger("django.request").setLevel(logging.ERROR)  # the start-up probe's 404

    return get_asgi_application()


def prepare() -> Any:
    """Migrate, the table, the entry points; the WSGI handler."""
    configure()
    build()
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    columns = "id bigserial PRIMARY KEY, amount int NOT NULL"
    connection.cursor().execute(f"CREATE TABLE IF NOT EXISTS {TABLE} ({columns})")
    reset()
    return WSGIHandler()


class Server:
    """uvicorn serving :func:`asgi` on a free port, and a kept-alive client to it
    (``pooled``: its Django keeps its connections in its pool)."""

    def __init__(self, pooled: bool = False) -> None:
        import httpx

        from benchmarks.run import free_port

        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), POOLED: "1" if pooled else "0"}
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "uvicorn", "--factory", "benchmarks.entries_bench:asgi"),
                *("--port", str(self.port), "--log-level", "warning", "--no-access-log"),
            ],
            cwd=ROOT,
            env=env,
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.get("/")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("uvicorn did not start") from None
                time.sleep(0.2)

    def post(self, path: str, key: str | None = None) -> int:
        response = self.client.post(
            path,
            content=BODY,
            headers={
                "Content-Type": "application/json",
                "X-Account": "bench",
                "Idempotency-Key": key or uuid.uuid4().hex,
            },
        )
        return response.status_code

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(timeout=30)


def batch(
    kind: str, size: int, handler: Any, servers: dict[str, Server], tools: Tools | None
) -> float:
    """``size`` operations of ``kind``; microseconds per operation (the uvicorn views need
    their server in ``servers``, by entry point; the tools ``tools``)."""
    entry, variant = kind.split("|")
    path = PATHS.get(f"{entry}|{'twin' if variant == 'twin' else 'ours'}")
    key = SEEN if variant == "replay" else None
    began = time.perf_counter()
    if entry in ("mcp", "mcp-async", "fastmcp"):
        assert tools is not None
        return tools.batch(entry, variant, size)
    if entry in servers:
        assert path is not None
        server = servers[entry]
        for _ in range(size):
            status = server.post(path, key)
            assert status == 201, (kind, status)
    elif path is not None:
        for _ in range(size):
            status = wsgi_post(handler, path, key)
            assert status in (200, 201), (kind, status)
    else:
        call = CALLS[kind]
        for _ in range(size):
            call()
    return (time.perf_counter() - began) / size * 1e6


def analyze() -> None:
    """The tables' statistics once the warm-up wrote their first rows, as autovacuum would
    gather them (see benchmarks/README.md)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}, django_idempotency_record")


def rows() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {TABLE}")
        (count,) = cursor.fetchone()
    return int(count)


def run(rounds: int, size: int, entries: tuple[str, ...] = ENTRIES) -> dict[str, Any]:
    handler = prepare()
    servers: dict[str, Server] = {
        entry: Server(pooled=entry == "async-view-pool")
        for entry in ("async-view", "async-view-pool")
        if entry in entries
    }
    tools = Tools()
    # Nothing logged per operation: the frameworks' INFO lines (a task's start and end, the
    # HTTP client's requests; FastMCP sets up a handler for them) are not what is measured.
    logging.disable(logging.INFO)
    kinds = [f"{entry}|{variant}" for entry in entries for variant in VARIANTS]
    # Each round's work: one row per twin and per first operation, none per replay.
    expected = size * len(entries) * 2
    try:
        for entry in entries:  # the records every replay finds
            batch(f"{entry}|ours", 1, handler, servers, tools)
        for kind in kinds:  # warm-up: imports, the views' marks, caches, connections
            batch(kind, 20, handler, servers, tools)
        analyze()
        per_round: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(rounds):
            before = rows()
            shift = r % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                per_round[kind].append(batch(kind, size, handler, servers, tools))
            written = rows() - before
            if written != expected:
                raise SystemExit(f"round {r}: {written} rows written, {expected} expected")
    finally:
        tools.close()
        for server in servers.values():
            server.close()
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for entry in entries:
        twin = per_round[f"{entry}|twin"]
        ratios[entry] = {}
        for variant in ("ours", "replay"):
            ours = per_round[f"{entry}|{variant}"]
            each = [o / t for o, t in zip(ours, twin, strict=True)]
            ratios[entry][variant] = {
                "ratio": statistics.median(ours) / statistics.median(twin),
                "min": min(each),
                "max": max(each),
            }
    return {
        "rounds": rounds,
        "batch": size,
        "median_us": {kind: statistics.median(values) for kind, values in per_round.items()},
        "ratios": ratios,
        "load_average": os.getloadavg(),
    }


def profile(kinds: list[str], size: int, top: int) -> None:
    """cProfile of ``size`` operations of each kind in this process (the in-process entry
    points: every kind but the uvicorn view's), the package's functions and the driver's
    wait printed by own and cumulative time per operation."""
    import cProfile
    import io
    import pstats

    handler = prepare()
    tools = Tools()
    logging.disable(logging.INFO)
    try:
        for entry in {kind.split("|")[0] for kind in kinds}:
            batch(f"{entry}|ours", 1, handler, {}, tools)
        for kind in kinds:
            batch(kind, 50, handler, {}, tools)
            profiler = cProfile.Profile()
            profiler.enable()
            batch(kind, size, handler, {}, tools)
            profiler.disable()
            stats = pstats.Stats(profiler)
            entries = stats.stats  # type: ignore[attr-defined]
            total = sum(tottime for (_, _, tottime, _, _) in entries.values())
            wait = sum(
                tottime
                for (filename, _, name), (_, _, tottime, _, _) in entries.items()
                if name in ("wait", "wait_conn") and "psycopg" in filename
            )
            print(
                f"== {kind}: {total / size * 1e3:.2f} ms per operation, of which the driver's "
                f"wait {wait / size * 1e3:.2f} ms and Python {(total - wait) / size * 1e3:.2f} ms"
            )
            if top == 0:
                continue
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats(order).print_stats(top)
                print(f"== {kind}: {size} operations, by {order} ==")
                print(text.getvalue())
    finally:
        tools.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100, help="operations per kind and round")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument(
        "--profile",
        metavar="KINDS",
        help="cProfile these kinds instead (entry|variant, comma-separated: run-once|ours)",
    )
    parser.add_argument("--top", type=int, default=40, help="functions printed per profile")
    parser.add_argument(
        "--only", default=",".join(ENTRIES), help="these entry points (comma-separated)"
    )
    args = parser.parse_args()
    if args.profile:
        profile(args.profile.split(","), args.batch, args.top)
        return 0
    entries = tuple(args.only.split(","))
    unknown = set(entries) - set(ENTRIES)
    if unknown:
        parser.error(f"unknown entry points {sorted(unknown)}; they are {', '.join(ENTRIES)}")
    results = run(args.rounds, args.batch, entries)
    print(json.dumps(results))
    if args.write:
        from benchmarks import report

        report.write_section(report.entries(results), report.SECTION_ENTRIES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
