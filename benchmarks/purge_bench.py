"""Purge a million expired records while claims run beside it.

``python -m benchmarks.purge_bench [--rows N] [--batch-size N] [--baseline S] [--rate R]``
prints one JSON object. It fills ``django_idempotency_bench_purge`` with ``--rows`` expired
records (``INSERT ... SELECT generate_series``, then ``VACUUM ANALYZE``), starts a claimer
process that claims keys at a steady ``--rate`` through ``_store.claim`` (half new keys, half
keys of the expired records, which the purge may be deleting at that moment), lets it run
``--baseline`` seconds without a purge, then runs ``maintenance.purge_expired`` and stops
the claimer a second after the purge ends. Claim latencies are split into "no purge" and
"during the purge" by their wall-clock time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import site_setup

DATABASE = "django_idempotency_bench_purge"
ACCOUNTS = 10_000
OPERATION = "charge.create"

# The columns a generated record fills (benchmarks/scale.py generates them too).
INSERT_RECORDS = """
INSERT INTO django_idempotency_record (
    account, operation, key, request_hash, fingerprint_version, status,
    lease_token, lease_expires_at, recovery_policy, recovery_attempts,
    response_status, response_headers, response_body, created_at, completed_at, expires_at
)
"""

FILL_SQL = (
    INSERT_RECORDS
    + """SELECT
    'user:' || (i %% {accounts}), '{operation}', md5(i::text || 'purge'), md5(i::text), 'v1',
    'completed', NULL, NULL, 'retry', 0, 201,
    '[["Content-Type", "application/json"]]'::jsonb,
    convert_to('{{"id": ' || i || ', "amount": 1000, "currency": "EUR", "description": "'
               || repeat('x', 200) || '"}}', 'UTF8'),
    created, created + interval '150 milliseconds', created + interval '24 hours'
FROM (
    -- created between 48 and 25 hours ago: every record is past its 24 hour TTL
    SELECT i, now() - interval '25 hours' - (i::float / %(rows)s) * interval '23 hours'
           AS created
    FROM generate_series(1, %(rows)s) AS i
) AS source
"""
)


def setup_django() -> None:
    os.environ["BENCH_DB"] = DATABASE
    site_setup.configure("ours")
    site_setup.ensure_database(DATABASE)
    import django

    django.setup()


def expired_key(i: int) -> tuple[str, str]:
    return f"user:{i % ACCOUNTS}", hashlib.md5(f"{i}purge".encode()).hexdigest()


def fill(rows: int) -> float:
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE django_idempotency_record, django_idempotency_step, django_idempotency_audit"
        )
        cursor.execute(FILL_SQL.format(accounts=ACCOUNTS, operation=OPERATION), {"rows": rows})
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE django_idempotency_record")
    return time.perf_counter() - started


def claimer(rate: float, rows: int, stop_file: str, out: str, cap: float) -> None:
    """Claim at a steady rate until ``stop_file`` exists; dump (time, kind, ms) samples."""
    from datetime import timedelta

    from django.utils import timezone

    from django_idempotency import _store
    from django_idempotency._context import Operation

    samples: list[tuple[float, str, float]] = []
    _store.fetch(
        Operation(
            "default", "warm", "up", "connection", "", "v1", "retry", timedelta(0), timedelta(0)
        )
    )
    for n in paced(rate, stop_file, cap):
        if n % 2:
            kind = "new"
            account, key = f"user:{n % ACCOUNTS}", f"claim-{os.getpid()}-{n}"
        else:
            kind = "expired"
            # A prime stride: every expired record is claimed at most once.
            account, key = expired_key((n // 2 * 7919) % rows + 1)
        request = Operation(
            alias="default",
            account=account,
            operation=OPERATION,
            key=key,
            request_hash=hashlib.sha256(key.encode()).hexdigest(),
            fingerprint_version="v1",
            recovery_policy="retry",
            lease=timedelta(seconds=60),
            ttl=timedelta(hours=24),
        )
        started = time.perf_counter()
        result = _store.claim(request, timezone.now())
        elapsed = time.perf_counter() - started
        if not result.claimed:
            kind += "-not-claimed"
        samples.append((time.time(), kind, elapsed * 1000))
    Path(out).write_text(json.dumps(samples))


def paced(rate: float, stop_file: str, cap: float) -> Iterator[int]:
    """Yield 1, 2, ... at a steady ``rate`` per second until ``stop_file`` exists."""
    interval = 1.0 / rate
    next_at = time.perf_counter()
    deadline = time.monotonic() + cap
    n = 0
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        n += 1
        yield n
        next_at += interval
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        else:
            next_at = time.perf_counter()  # fell behind: no catch-up burst


def server_counters() -> dict[str, int]:
    """The server's WAL position and checkpoint count: a purge writes WAL for every row."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn,"
            " checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
        )
        wal, checkpoints = cursor.fetchone()
    return {"wal": int(wal), "checkpoints": int(checkpoints)}


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) if values else float("nan"),
        "p99_ms": percentile(values, 99),
        "max_ms": max(values) if values else float("nan"),
    }


def run(rows: int, batch_size: int, baseline: float, rate: float) -> dict[str, Any]:
    from django_idempotency.maintenance import purge_expired

    fill_seconds = fill(rows)
    workdir = tempfile.mkdtemp(prefix="purge-bench-")
    stop_file = os.path.join(workdir, "stop")
    out = os.path.join(workdir, "claims.json")
    command = [sys.executable, "-m", "benchmarks.purge_bench", "claimer"]
    command += ["--rows", str(rows), "--rate", str(rate), "--stop-file", stop_file, "--out", out]
    process = subprocess.Popen(command, env=os.environ.copy())
    try:
        time.sleep(baseline)
        batch_ends: list[float] = []
        before = server_counters()
        purge_started = time.time()
        clock_started = time.perf_counter()
        result = purge_expired(
            batch_size=batch_size, progress=lambda b, r: batch_ends.append(time.perf_counter())
        )
        purge_seconds = time.perf_counter() - clock_started
        purge_ended = time.time()
        after = server_counters()
        time.sleep(1.0)
    finally:
        Path(stop_file).touch()
        process.wait(timeout=60)
    samples = json.loads(Path(out).read_text())
    batches = [b - a for a, b in zip([clock_started, *batch_ends], batch_ends, strict=False)]
    no_purge = [s for s in samples if s[0] < purge_started]
    during = [s for s in samples if purge_started <= s[0] <= purge_ended]

    def split(chosen: list[Any]) -> dict[str, Any]:
        return {
            "all": summary([s[2] for s in chosen]),
            "new": summary([s[2] for s in chosen if s[1] == "new"]),
            "expired": summary([s[2] for s in chosen if s[1] == "expired"]),
        }

    return {
        "rows": rows,
        "batch_size": batch_size,
        "fill_seconds": fill_seconds,
        "deleted": result.deleted,
        "batches": result.batches,
        "purge_seconds": purge_seconds,
        "rows_per_second": result.deleted / purge_seconds,
        "longest_batch_ms": result.longest_batch_seconds * 1000,
        "batch_p50_ms": statistics.median(batches) * 1000 if batches else float("nan"),
        "batch_p99_ms": percentile(batches, 99) * 1000,
        # (batch number, ms) of every batch over 100 ms: where in the run they happen.
        "slow_batches": [(i + 1, round(b * 1000, 1)) for i, b in enumerate(batches) if b > 0.1],
        "claim_rate": rate,
        "claims_no_purge": split(no_purge),
        # What PostgreSQL did meanwhile (the whole server: other databases' work counts too).
        "wal_mb": (after["wal"] - before["wal"]) / 2**20,
        "checkpoints": after["checkpoints"] - before["checkpoints"],
        "claims_during_purge": split(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "claimer"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--baseline", type=float, default=15.0)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--stop-file")
    parser.add_argument("--out")
    args = parser.parse_args()
    setup_django()
    if args.mode == "claimer":
        claimer(args.rate, args.rows, args.stop_file, args.out, cap=600)
        return
    print(json.dumps(run(args.rows, args.batch_size, args.baseline, args.rate)))


if __name__ == "__main__":
    main()
