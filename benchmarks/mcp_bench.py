"""Agents' tool calls: a protected MCP tool call against the same tool unprotected, under the
SDK's ``MCPServer`` and under FastMCP, beside a protected DRF create against plain DRF.

``python -m benchmarks.mcp_bench [--calls N] [--rounds R] [--prepare]`` prints one JSON
object. It uses the PostgreSQL database ``django_idempotency_bench_mcp`` (created when
missing) and each framework's own client, in process (``Client(server)``: a memory transport,
so the figures are the server's work and the framework's, without a network).

Every variant runs one body, an ``INSERT`` of one row (the side effect every call counts):

- ``plain``: the tool as written, no protection: the baseline;
- ``protected``: the same body under ``@idempotent_tool(account=...)``, each call with a
  new ``idempotency_key`` (a first call: the claim, the body's transaction, the fenced
  completion);
- ``replay``: the protected tool called again with a key it has seen (one indexed read);

for ``mcp`` (the SDK's ``MCPServer``) and ``fastmcp``; and for ``drf``, the same body as a
DRF ``APIView`` called in process (``RequestFactory``), plain and under ``IdempotencyMixin``,
the yardstick the design sets: a protected tool call may cost no more above its unprotected
twin than a protected DRF create costs above plain DRF.

Each round runs ``--calls`` sequential calls of each variant, the order rotating from round
to round (interleaved); the figures are the medians of the rounds' per-call times, and the
ratios are against the framework's ``plain`` within the same round. ``--prepare`` sets
``OPTIONS["prepare_threshold"]``: the engine's statements prepared on the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from typing import Any

DATABASE = "django_idempotency_bench_mcp"


def configure(prepare: bool = False) -> None:
    import django
    from django.conf import settings

    from benchmarks.site_setup import ensure_database

    ensure_database(DATABASE)
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": DATABASE,
                "USER": os.environ.get("PGUSER", "postgres"),
                "PASSWORD": os.environ.get("PGPASSWORD", ""),
                "HOST": os.environ.get("PGHOST", "127.0.0.1"),
                "PORT": os.environ.get("PGPORT", "5432"),
                "CONN_MAX_AGE": 600,
                "OPTIONS": {"prepare_threshold": 5} if prepare else {},
            }
        },
        INSTALLED_APPS=[
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "rest_framework",
            "django_idempotency",
        ],
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "UNAUTHENTICATED_USER": None,
        },
        USE_TZ=True,
        SECRET_KEY="django-idempotency-mcp-bench",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        IDEMPOTENCY={},
    )
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS mcp_bench_effect (id bigserial PRIMARY KEY)")
        cursor.execute(
            "TRUNCATE mcp_bench_effect, django_idempotency_record, django_idempotency_step"
        )


def effect() -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO mcp_bench_effect DEFAULT VALUES RETURNING id")
        (row_id,) = cursor.fetchone()
    return {"id": row_id}


def server() -> Any:
    from mcp.server.mcpserver import MCPServer

    from django_idempotency.mcp import idempotent_tool

    shop = MCPServer("bench")

    @shop.tool()
    def plain(amount: int) -> dict[str, int]:
        return effect()

    @shop.tool()
    @idempotent_tool(account="bench")
    def protected(amount: int, idempotency_key: str) -> dict[str, int]:
        return effect()

    return shop


def fast_server() -> Any:
    from fastmcp import FastMCP

    from django_idempotency.fastmcp import idempotent_tool

    shop = FastMCP("bench")

    @shop.tool
    def plain(amount: int) -> dict[str, int]:
        return effect()

    @shop.tool
    @idempotent_tool(account="bench")
    def protected(amount: int, idempotency_key: str) -> dict[str, int]:
        return effect()

    return shop


def drf_views() -> tuple[Any, Any]:
    """The same body as a DRF create: plain, and under ``IdempotencyMixin``."""
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from django_idempotency.drf import IdempotencyMixin

    class Plain(APIView):
        def post(self, request: Any) -> Response:
            return Response(effect(), status=201)

    class Protected(IdempotencyMixin, APIView):
        def get_idempotency_account(self, request: Any) -> str:
            return "bench"

        def post(self, request: Any) -> Response:
            return Response(effect(), status=201)

    return Plain.as_view(), Protected.as_view()


FRAMEWORKS = ("mcp", "fastmcp", "drf")
VARIANTS = ("plain", "protected", "replay")


async def measure(calls: int, rounds: int) -> dict[str, Any]:
    import fastmcp
    from mcp import Client

    names = [f"{framework}.{variant}" for framework in FRAMEWORKS for variant in VARIANTS]
    times: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {
        f"{framework}.{variant}": []
        for framework in FRAMEWORKS
        for variant in ("protected", "replay")
    }
    seen = str(uuid.uuid4())
    views = drf_views()
    async with Client(server()) as sdk, fastmcp.Client(fast_server()) as fast:
        clients = {"mcp": sdk, "fastmcp": fast}
        for framework in FRAMEWORKS:  # the key every replay sends: its record made
            await run(clients, views, f"{framework}.replay", 1, seen)
        for name in names:  # warm-up
            await run(clients, views, name, 20, seen)
        for index in range(rounds):
            shift = index % len(names)
            order = names[shift:] + names[:shift]
            per_call = {name: await run(clients, views, name, calls, seen) for name in order}
            for name in names:
                times[name].append(per_call[name])
            for name in ratios:
                plain = per_call[f"{name.split('.')[0]}.plain"]
                ratios[name].append(per_call[name] / plain)
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "per_call_ms": {name: round(statistics.median(v) * 1000, 3) for name, v in times.items()},
        "ratio_to_plain": {
            name: {
                "median": round(statistics.median(v), 3),
                "min": round(min(v), 3),
                "max": round(max(v), 3),
            }
            for name, v in ratios.items()
        },
    }


async def run(
    clients: dict[str, Any], views: tuple[Any, Any], name: str, calls: int, seen: str
) -> float:
    framework, variant = name.split(".")
    if framework == "drf":
        return await asyncio.to_thread(drf, views, variant, calls, f"drf:{seen}")
    return await call(clients[framework], framework, variant, calls, f"{framework}:{seen}")


async def call(client: Any, framework: str, variant: str, calls: int, seen: str) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        if variant == "plain":
            arguments: dict[str, Any] = {"amount": 1}
            tool = "plain"
        else:
            key = seen if variant == "replay" else str(uuid.uuid4())
            arguments = {"amount": 1, "idempotency_key": key}
            tool = "protected"
        await call_tool(client, framework, tool, arguments, f"{framework}.{variant}")
    return (time.perf_counter() - started) / calls


async def call_tool(
    client: Any, framework: str, tool: str, arguments: dict[str, Any], name: str
) -> None:
    """One call through the framework's client; an error result raises, saying ``name``."""
    if framework == "fastmcp":
        result = await client.call_tool(tool, arguments, raise_on_error=False)
    else:
        result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise RuntimeError(f"{name} answered an error: {result}")


def drf(views: tuple[Any, Any], variant: str, calls: int, seen: str) -> float:
    """``calls`` DRF creates in this thread (the ORM is synchronous), as one round's variant."""
    from django.db import close_old_connections
    from django.test import RequestFactory

    factory = RequestFactory()
    plain, protected = views
    started = time.perf_counter()
    for _ in range(calls):
        if variant == "plain":
            response = plain(factory.post("/charges/", {"amount": 1}, format="json"))
        else:
            key = seen if variant == "replay" else str(uuid.uuid4())
            request = factory.post("/charges/", {"amount": 1}, HTTP_IDEMPOTENCY_KEY=key)
            response = protected(request)
        if response.status_code != 201:
            raise RuntimeError(f"drf.{variant} answered {response.status_code}")
    took = (time.perf_counter() - started) / calls
    close_old_connections()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--prepare", action="store_true")
    args = parser.parse_args()
    configure(args.prepare)
    figures = asyncio.run(measure(args.calls, args.rounds))
    figures["prepared_statements"] = args.prepare
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM mcp_bench_effect")
        (effects,) = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM django_idempotency_record")
        (records,) = cursor.fetchone()
    # Every plain and protected call made one row, per framework; no replay did.
    per_framework = 1 + 20 * 2 + args.rounds * args.calls * 2
    expected = per_framework * len(FRAMEWORKS)
    figures["effects"] = {"rows": effects, "expected": expected, "records": records}
    if effects != expected:
        raise SystemExit(f"effects counted {effects}, expected {expected}: {figures}")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
