"""Agents' tool calls: a protected MCP tool call against the same tool unprotected.

``python -m benchmarks.mcp_bench [--calls N] [--rounds R]`` prints one JSON object. It uses
the PostgreSQL database ``django_idempotency_bench_mcp`` (created when missing) and the MCP
Python SDK's own client, in process (``Client(server)``: the SDK's memory transport, so the
figures are the server's work and the SDK's, without a network).

Three tools share one body, an ``INSERT`` of one row (the side effect every call counts):

- ``plain``: the tool as written, no protection: the baseline;
- ``protected``: the same body under ``@idempotent_tool(account=...)``, each call with a
  new ``idempotency_key`` (a first call: the claim, the body's transaction, the fenced
  completion);
- ``replay``: the protected tool called again with a key it has seen (one indexed read).

Each round runs ``--calls`` sequential calls of each variant, the order rotating from round
to round (interleaved); the figures are the medians of the rounds' per-call times, and the
ratios are against ``plain`` within the same round.
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


def configure() -> None:
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
            }
        },
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"],
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


def server() -> Any:
    from django.db import connection
    from mcp.server.mcpserver import MCPServer

    from django_idempotency.mcp import idempotent_tool

    shop = MCPServer("bench")

    def effect() -> dict[str, int]:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO mcp_bench_effect DEFAULT VALUES RETURNING id")
            (row_id,) = cursor.fetchone()
        return {"id": row_id}

    @shop.tool()
    def plain(amount: int) -> dict[str, int]:
        return effect()

    @shop.tool()
    @idempotent_tool(account="bench")
    def protected(amount: int, idempotency_key: str) -> dict[str, int]:
        return effect()

    return shop


async def measure(calls: int, rounds: int) -> dict[str, Any]:
    from mcp import Client

    variants = ["plain", "protected", "replay"]
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {"protected": [], "replay": []}
    seen = str(uuid.uuid4())
    async with Client(server()) as client:
        await client.call_tool("protected", {"amount": 1, "idempotency_key": seen})
        for name in variants:  # warm-up
            await call(client, name, 20, seen)
        for index in range(rounds):
            order = variants[index % 3 :] + variants[: index % 3]
            per_call = {name: await call(client, name, calls, seen) for name in order}
            for name in variants:
                times[name].append(per_call[name])
            for name in ratios:
                ratios[name].append(per_call[name] / per_call["plain"])
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


async def call(client: Any, name: str, calls: int, seen: str) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        if name == "plain":
            result = await client.call_tool("plain", {"amount": 1})
        else:
            key = seen if name == "replay" else str(uuid.uuid4())
            result = await client.call_tool("protected", {"amount": 1, "idempotency_key": key})
        if result.is_error:
            raise RuntimeError(f"{name} answered an error: {result}")
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    configure()
    figures = asyncio.run(measure(args.calls, args.rounds))
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM mcp_bench_effect")
        (effects,) = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM django_idempotency_record")
        (records,) = cursor.fetchone()
    # Every plain and protected call made one row; no replay did.
    expected = 1 + 20 * 2 + args.rounds * args.calls * 2
    figures["effects"] = {"rows": effects, "expected": expected, "records": records}
    if effects != expected:
        raise SystemExit(f"effects counted {effects}, expected {expected}: {figures}")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
