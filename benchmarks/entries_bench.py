"""Every entry point against its unprotected twin, in one interleaved run.

``python -m benchmarks.entries_bench [--rounds R] [--batch N] [--write]`` prints one JSON
object; ``--write`` also puts its section into ``benchmarks/RESULTS.md`` (``make bench``
renders the same section from its own run).

One process and one uvicorn server, on the PostgreSQL database
``django_idempotency_bench_entries`` (created when missing), Django's defaults otherwise (no
prepared statements, no pooler; connections kept, ``CONN_MAX_AGE = 600``). Every operation
is a first one (a new key) whose work is the same single ``INSERT``; each entry point runs
protected and as its unprotected twin:

- ``drf``: ``IdempotencyMixin`` first in a DRF ``APIView`` / the same ``APIView`` (the
  yardstick: every other entry point's ratio should stay at or below it);
- ``ninja``: a django-ninja operation under ``ninja.idempotent`` / the same operation;
- ``async-view``: an ``async def`` view under ``@idempotent`` / the same view, served by
  uvicorn (one worker), requests one after another on a kept-alive connection;
- ``run-once``: ``run_once(write, ...)`` / ``write()``;
- ``celery-task``: ``@shared_task`` over ``@idempotent_task()`` / ``@shared_task``, each run
  with ``apply(task_id=...)`` (Celery's eager path: no broker, the worker's own code);
- ``django-task``: ``@task()`` over ``@idempotent_task()`` / ``@task()`` of Django's Tasks
  framework, enqueued on its ``ImmediateBackend`` (it runs at once), the protected one with
  the outbox message id a relay hands it.

The HTTP entry points (drf, ninja) go through Django's WSGI handler in this process, as
``connections_bench.py`` does. Rounds run every (entry point, protected or not) batch back
to back, in an order that rotates from round to round; the figures are the median time per
operation over all rounds, and per entry point the ratio of the protected median to the
twin's, with the spread of the per-round ratios.
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
ENTRIES = ("drf", "ninja", "async-view", "run-once", "celery-task", "django-task")
VARIANTS = ("twin", "ours")
BODY = b'{"amount": 1}'  # as connections_bench.post sends it
HAS_DJANGO_TASKS = importlib.util.find_spec("django.tasks") is not None


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
    settings.configure(
        DATABASES={"default": postgres_database(DATABASE)},
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

    async def async_twin(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": await sync_to_async(write)()}, status=201)

    @idempotent(operation="bench.async")
    async def async_ours(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": await sync_to_async(write)()}, status=201)

    from benchmarks import entries_bench

    entries_bench.urlpatterns[:] = [
        path("drf/twin/", TwinView.as_view()),
        path("drf/ours/", OursView.as_view()),
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

    CALLS.update(
        {
            "run-once|twin": lambda: write(),
            "run-once|ours": lambda: run_once(
                write, account="bench", operation="bench.run-once", key=new_key()
            ),
            "celery-task|twin": lambda: celery_twin.apply((1,), task_id=new_key()).get(),
            "celery-task|ours": lambda: celery_ours.apply((1,), task_id=new_key()).get(),
            "django-task|twin": lambda: entries_tasks.twin.enqueue(1),
            "django-task|ours": lambda: entries_tasks.ours.enqueue(
                1, **{MESSAGE_ARGUMENT: new_key()}
            ),
        }
    )


PATHS = {
    "drf|twin": "/drf/twin/",
    "drf|ours": "/drf/ours/",
    "ninja|twin": "/ninja/twin",
    "ninja|ours": "/ninja/ours",
    "async-view|twin": "/async/twin/",
    "async-view|ours": "/async/ours/",
}


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
    """uvicorn serving :func:`asgi` on a free port, and a kept-alive client to it."""

    def __init__(self) -> None:
        import httpx

        from benchmarks.run import free_port

        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
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

    def post(self, path: str) -> int:
        response = self.client.post(
            path,
            content=BODY,
            headers={
                "Content-Type": "application/json",
                "X-Account": "bench",
                "Idempotency-Key": uuid.uuid4().hex,
            },
        )
        return response.status_code

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(timeout=30)


def batch(kind: str, size: int, handler: Any, server: Server) -> float:
    """``size`` first operations of ``kind``; microseconds per operation."""
    entry = kind.split("|")[0]
    began = time.perf_counter()
    if entry == "async-view":
        for _ in range(size):
            status = server.post(PATHS[kind])
            assert status == 201, (kind, status)
    elif kind in PATHS:
        for _ in range(size):
            status = wsgi_post(handler, PATHS[kind])
            assert status in (200, 201), (kind, status)
    else:
        call = CALLS[kind]
        for _ in range(size):
            call()
    return (time.perf_counter() - began) / size * 1e6


def run(rounds: int, size: int) -> dict[str, Any]:
    handler = prepare()
    server = Server()
    kinds = [f"{entry}|{variant}" for entry in ENTRIES for variant in VARIANTS]
    try:
        for kind in kinds:  # warm-up: imports, the views' marks, caches, connections
            batch(kind, 20, handler, server)
        reset()
        per_round: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(rounds):
            shift = r % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                per_round[kind].append(batch(kind, size, handler, server))
            reset()
    finally:
        server.close()
    ratios: dict[str, dict[str, float]] = {}
    for entry in ENTRIES:
        twin, ours = per_round[f"{entry}|twin"], per_round[f"{entry}|ours"]
        each = [o / t for o, t in zip(ours, twin, strict=True)]
        ratios[entry] = {
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100, help="operations per kind and round")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    results = run(args.rounds, args.batch)
    print(json.dumps(results))
    if args.write:
        from benchmarks import report

        report.write_section(report.entries(results), report.SECTION_ENTRIES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
