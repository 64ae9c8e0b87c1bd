"""Recovery points: what a step costs next to the same work in one ``atomic()`` block.

``python -m benchmarks.steps_bench [--rounds R] [--batch N] [--write]`` prints one JSON
object; ``--write`` also puts its section into ``benchmarks/RESULTS.md`` (``make bench``
renders the same section from its own run).

It uses the PostgreSQL database ``django_idempotency_bench_steps`` (created when missing) and
a table of its own, one ``INSERT`` per unit of work. Each operation does ``n`` units (1 and
3), in three ways, in one process:

- ``plain``: the ``n`` INSERTs in one ``transaction.atomic()``, no idempotency;
- ``retry``: ``run_once(..., recovery="retry")`` doing the ``n`` INSERTs in its one
  transaction (the claim, the work and the fenced completion);
- ``resume``: ``run_once(..., recovery="resume")`` doing ``n`` steps, each one INSERT
  (the claim, the read of the recorded steps, each step's transaction with its fenced
  record, then the completion in a transaction of its own).

Every operation has a new key. Statements are counted with Django's
``CaptureQueriesContext`` on one operation of each kind, transaction control (``BEGIN``,
``COMMIT``) apart: transactions are the commits of ``atomic()`` blocks plus the statements
run outside any, each a transaction of its own. Latency: ``--rounds`` rounds, each running a batch
of ``--batch`` operations of every kind back to back in an order that rotates from round to
round; the median per operation over all rounds, and per round. From the figures at 1 and 3
units, the cost of one more unit: ``(x(3) - x(1)) / 2``, per way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATABASE = "django_idempotency_bench_steps"
TABLE = "bench_step_unit"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
WAYS = ("plain", "retry", "resume")
UNITS = (1, 3)
# Transaction control, which Django logs beside the statements: counted as transactions.
CONTROL = {"BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT"}


def configure() -> None:
    """Django on the benchmark's own database, every setting of the package at its default."""
    from benchmarks.site_setup import configure_package_only

    configure_package_only(DATABASE, "django-idempotency-steps-bench")


def prepare() -> None:
    from benchmarks.site_setup import ensure_database

    ensure_database(DATABASE)
    configure()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, label text NOT NULL)"
        )
    reset()


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE}, django_idempotency_step, django_idempotency_record")


# -- the work ---------------------------------------------------------------------------------


def unit(label: str) -> int:
    """One unit of work: one INSERT."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {TABLE} (label) VALUES (%s) RETURNING id", [label])
        (pk,) = cursor.fetchone()
    return int(pk)


def operation(way: str, units: int) -> Callable[[], Any]:
    """One operation of ``units`` units, done ``way``."""
    from django.db import transaction

    from django_idempotency import run_once, step

    def in_one_block() -> list[int]:
        return [unit(f"{way}-{n}") for n in range(units)]

    def in_steps() -> list[int]:
        return [step(f"unit:{n}", unit, f"{way}-{n}") for n in range(units)]

    def plain() -> list[int]:
        with transaction.atomic():
            return in_one_block()

    def once() -> list[int]:
        body = in_steps if way == "resume" else in_one_block
        key = str(uuid.uuid4())
        return run_once(body, account="bench", operation=f"bench.{way}", key=key, recovery=way)

    return plain if way == "plain" else once


def kinds() -> list[str]:
    return [f"{way}.{units}" for units in UNITS for way in WAYS]


def counted(kind: str) -> dict[str, Any]:
    """The statements and commits of one operation of ``kind``."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from benchmarks.report import statement_kind

    way, units = kind.split(".")
    run = operation(way, int(units))
    alone: list[str] = []

    def outside_transactions(execute: Any, sql: str, *args: Any) -> Any:
        if not connection.in_atomic_block:
            alone.append(sql)
        return execute(sql, *args)

    commits = 0
    commit = connection.commit

    def counting_commit() -> None:
        nonlocal commits
        commits += 1
        commit()

    connection.commit = counting_commit  # type: ignore[method-assign]
    try:
        with (
            CaptureQueriesContext(connection) as captured,
            connection.execute_wrapper(outside_transactions),
        ):
            run()
    finally:
        del connection.commit
    sent = [statement_kind(query["sql"]) for query in captured.captured_queries]
    statements = [name for name in sent if name not in CONTROL]
    return {
        "statements": len(statements),
        "by_kind": dict(Counter(statements)),
        # A statement outside any transaction is a transaction of its own.
        "transactions": commits + len(alone),
    }


def timed(kind: str, batch: int) -> list[float]:
    """Milliseconds per operation, ``batch`` operations of ``kind``."""
    way, units = kind.split(".")
    run = operation(way, int(units))
    times = []
    for _ in range(batch):
        began = time.perf_counter()
        run()
        times.append((time.perf_counter() - began) * 1000)
    return times


def run(rounds: int, batch: int) -> dict[str, Any]:
    """Every kind, interleaved; the figures as one dict."""
    prepare()
    every = kinds()
    for kind in every:  # warm-up: connections, prepared caches, imports
        timed(kind, 20)
    reset()
    sql = {kind: counted(kind) for kind in every}
    latencies: dict[str, list[float]] = {kind: [] for kind in every}
    round_medians: dict[str, list[float]] = {kind: [] for kind in every}
    for r in range(rounds):
        for kind in every[r % len(every) :] + every[: r % len(every)]:
            times = timed(kind, batch)
            latencies[kind] += times
            round_medians[kind].append(statistics.median(times))
        reset()
    return {
        "rounds": rounds,
        "batch": batch,
        "sql": sql,
        "median_ms": {kind: statistics.median(values) for kind, values in latencies.items()},
        "round_medians_ms": round_medians,
        "load_average": os.getloadavg(),
    }


def write_section(results: dict[str, Any]) -> None:
    """Put this benchmark's section into RESULTS.md, in place of an older one."""
    from benchmarks import report

    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(report.replace_section(text, report.steps(results), report.SECTION_STEPS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=100, help="operations per kind and round")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    results = run(args.rounds, args.batch)
    print(json.dumps(results))
    if args.write:
        write_section(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
