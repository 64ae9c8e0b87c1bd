"""``ATOMIC_REQUESTS``: what a protected request costs with it and without it.

``python -m benchmarks.connections_bench [--rounds R] [--batch N] [--write]`` prints one JSON
object; ``--write`` also puts its section into ``benchmarks/RESULTS.md`` (``make bench``
renders the same section from its own run).

One process, its own PostgreSQL database ``django_idempotency_bench_connections`` (created
when missing), requests through Django's WSGI handler itself (so ``request_started`` and
``request_finished`` close connections as a server's would; the test client does not). Four
entry points, each a first request (a new key) writing one row: ``@idempotent`` on a function
view, ``IdempotencyMixin`` first in a DRF ``APIView``, DRF's ``@api_view`` over
``@idempotent``, and a django-ninja operation under its ``@idempotent``. Each runs in four
configurations: ``ATOMIC_REQUESTS`` off and on, with ``CONN_MAX_AGE = 0`` (a connection
per request, Django's default) and ``600`` (persistent). Rounds run every (entry point,
configuration) batch back to back, in an order that rotates from round to round; the
figures are the median time per request over all rounds, the connections opened per
request (``connection_created``), and per entry point and ``CONN_MAX_AGE`` the ratio of
``ATOMIC_REQUESTS`` on to off with the spread of the per-round ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

# At the top: ninja reads the operations' annotations from this module's globals.
from django.http import HttpRequest, HttpResponse, JsonResponse

DATABASE = "django_idempotency_bench_connections"
TABLE = "bench_connections_charge"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
ENTRIES = ("decorator", "mixin", "api-view", "ninja")
CONFIGS = tuple((atomic, age) for age in (0, 600) for atomic in (False, True))
BODY = b'{"amount": 1}'


def configure() -> None:
    """Django on the benchmark's own database; the URLconf is this module."""
    import django
    from django.conf import settings

    from benchmarks.site_setup import ensure_database

    ensure_database(DATABASE)
    if settings.configured:
        return
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": DATABASE,
                "USER": os.environ.get("PGUSER", "postgres"),
                "PASSWORD": os.environ.get("PGPASSWORD", ""),
                "HOST": os.environ.get("PGHOST", "127.0.0.1"),
                "PORT": os.environ.get("PGPORT", "5432"),
                "CONN_MAX_AGE": 0,
            }
        },
        INSTALLED_APPS=[
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "rest_framework",
            "django_idempotency",
        ],
        ROOT_URLCONF="benchmarks.connections_bench",
        ALLOWED_HOSTS=["*"],
        USE_TZ=True,
        SECRET_KEY="django-idempotency-connections-bench",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        MIDDLEWARE=[],
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "UNAUTHENTICATED_USER": None,
        },
        # The caller's account from a header: every entry point scopes keys alike.
        IDEMPOTENCY={"ACCOUNT_RESOLVER": "benchmarks.connections_bench.account"},
    )
    django.setup()


def account(request: Any) -> str | None:
    value: str | None = request.META.get("HTTP_X_ACCOUNT")
    return value


def write() -> int:
    """The view's work: one INSERT."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {TABLE} (amount) VALUES (1) RETURNING id")
        (pk,) = cursor.fetchone()
    return int(pk)


# -- the views: one per entry point (made once Django is configured) ---------------------------

urlpatterns: list[Any] = []


def build_urls() -> None:
    from django.urls import path
    from ninja import NinjaAPI
    from rest_framework.decorators import api_view
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from django_idempotency.decorators import idempotent
    from django_idempotency.drf import IdempotencyMixin
    from django_idempotency.ninja import idempotent as ninja_idempotent

    @idempotent(operation="bench.decorator")
    def decorator_view(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"id": write()}, status=201)

    class MixinView(IdempotencyMixin, APIView):
        idempotency_operation = "bench.mixin"

        def post(self, request: Request) -> Response:
            return Response({"id": write()}, status=201)

    @api_view(["POST"])
    @idempotent(operation="bench.api-view")
    def api_view_view(request: Request) -> Response:
        return Response({"id": write()}, status=201)

    api = NinjaAPI(urls_namespace="bench-connections")

    @api.post("/charges")  # answered 200
    @ninja_idempotent(operation="bench.ninja")
    def ninja_view(request: HttpRequest) -> Any:
        return {"id": write()}

    # The URLconf is this module as Django imports it (not __main__, when run as a script).
    from benchmarks import connections_bench

    connections_bench.urlpatterns[:] = [
        path("decorator/", decorator_view),
        path("mixin/", MixinView.as_view()),
        path("api-view/", api_view_view),
        path("ninja/", api.urls),
    ]


PATHS = {
    "decorator": "/decorator/",
    "mixin": "/mixin/",
    "api-view": "/api-view/",
    "ninja": "/ninja/charges",
}


def prepare() -> Any:
    """Migrate, the table, the URLs, the handler."""
    configure()
    build_urls()
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, amount int NOT NULL)"
        )
    reset()
    return WSGIHandler()


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE}, django_idempotency_step, django_idempotency_record")
        cursor.execute(f"ANALYZE {TABLE}")


def use(atomic: bool, age: int) -> None:
    """The configuration for the next requests: a new connection picks it up."""
    from django.db import connection

    connection.close()
    connection.settings_dict["ATOMIC_REQUESTS"] = atomic
    connection.settings_dict["CONN_MAX_AGE"] = age


def post(handler: Any, path: str, key: str | None = None) -> int:
    """One request through the WSGI handler, closed as a server closes it; its status.
    ``key``: the key it sends (default: a new one)."""
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(BODY)),
        "HTTP_HOST": "bench",
        "HTTP_X_ACCOUNT": "bench",
        "HTTP_IDEMPOTENCY_KEY": key or uuid.uuid4().hex,
        "wsgi.input": io.BytesIO(BODY),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": False,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.version": (1, 0),
    }
    statuses: list[str] = []
    response = handler(environ, lambda status, headers: statuses.append(status))
    b"".join(response)
    response.close()  # request_finished: Django closes (or keeps) the connection
    return int(statuses[0].split()[0])


def batch(handler: Any, entry: str, atomic: bool, age: int, size: int) -> tuple[float, float]:
    """``size`` first requests; microseconds per request, connections opened per request."""
    from django.db.backends.signals import connection_created

    use(atomic, age)
    post(handler, PATHS[entry])  # the configuration's connection, as a server would have it
    opened = 0

    def count(**kwargs: Any) -> None:
        nonlocal opened
        opened += 1

    connection_created.connect(count)
    try:
        began = time.perf_counter()
        for _ in range(size):
            status = post(handler, PATHS[entry])
            assert status in (200, 201), (entry, status)
        elapsed = time.perf_counter() - began
    finally:
        connection_created.disconnect(count)
    return elapsed / size * 1e6, opened / size


def label(entry: str, atomic: bool, age: int) -> str:
    return f"{entry}|{'atomic' if atomic else 'plain'}|{age}"


def run(rounds: int, size: int) -> dict[str, Any]:
    handler = prepare()
    kinds = [(entry, atomic, age) for entry in ENTRIES for atomic, age in CONFIGS]
    for kind in kinds:  # warm-up: imports, the views' marks, caches
        batch(handler, *kind, 20)
    reset()
    per_round: dict[str, list[float]] = {label(*kind): [] for kind in kinds}
    connections: dict[str, list[float]] = {label(*kind): [] for kind in kinds}
    for r in range(rounds):
        shift = r % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            micros, opened = batch(handler, *kind, size)
            per_round[label(*kind)].append(micros)
            connections[label(*kind)].append(opened)
        reset()
    ratios: dict[str, dict[str, Any]] = {}
    for entry in ENTRIES:
        for age in (0, 600):
            plain = per_round[label(entry, False, age)]
            atomic = per_round[label(entry, True, age)]
            each = [a / p for a, p in zip(atomic, plain, strict=True)]
            ratios[f"{entry}|{age}"] = {
                "ratio": statistics.median(atomic) / statistics.median(plain),
                "min": min(each),
                "max": max(each),
            }
    return {
        "rounds": rounds,
        "batch": size,
        "median_us": {name: statistics.median(values) for name, values in per_round.items()},
        "connections_per_request": {
            name: statistics.median(values) for name, values in connections.items()
        },
        "ratios": ratios,
        "load_average": os.getloadavg(),
    }


def write_section(results: dict[str, Any]) -> None:
    """Put this benchmark's section into RESULTS.md, in place of an older one."""
    from benchmarks import report

    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = report.connections(results)
    RESULTS.write_text(report.replace_section(text, section, report.SECTION_CONNECTIONS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100, help="requests per kind and round")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    results = run(args.rounds, args.batch)
    print(json.dumps(results))
    if args.write:
        write_section(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
