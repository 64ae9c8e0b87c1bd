"""The records table at 10 thousand, 1 million and 10 million rows, and a purge beside traffic.

``python -m benchmarks.scale [--sizes 10000,1000000,10000000] [--samples N] [--purge]``
(``make bench-scale``) fills ``django_idempotency_bench_scale`` in SQL (``generate_series``)
with a realistic mix, for each size in turn:

- 70% completed inside their 24-hour TTL, 29.5% completed and expired (waiting for the
  purge), 0.2% in progress with a live lease, 0.3% in progress with a stale one;
- 617 accounts, three operations, random 32-hex-digit keys (as clients' UUIDs are), a
  250-byte stored body;

then measures, through the engine's store (``_store.claim`` and ``_store.complete``, the
statements a request runs): the claim of a new key, a whole first request (claim, then the
fenced completion in its own transaction), and a replay (the claim statement meeting a
completed record), interleaved, one connection; the table's and each index's size; and the
WAL each first request writes. With ``--purge``, on the largest size: a claimer process at a
steady rate, first alone, then beside ``maintenance.purge_expired``; the batches' durations,
rows per second, the claim p99 with and without the purge, dead tuples and what autovacuum
did. Prints one JSON object and writes the "Scale" section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import site_setup
from benchmarks.purge_bench import INSERT_RECORDS, paced, percentile, summary

DATABASE = "django_idempotency_bench_scale"
ACCOUNTS = 617
OPERATIONS = ("charges.create", "orders.create", "refunds.create")
ALIAS = "default"
BODY = b'{"id": 1, "amount": 1000, "currency": "EUR", "description": "' + b"x" * 190 + b'"}'
HEADERS = [["Content-Type", "application/json"]]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION_BEGIN = "<!-- scale:begin -->"
SECTION_END = "<!-- scale:end -->"

# One chunk of rows i in [%(first)s, %(last)s]. The status follows i % 1000 (so the mix is
# known without reading the table back), the times are spread at random.
FILL_SQL = (
    INSERT_RECORDS
    + """SELECT
    'user:' || ((i * 7919) %% {accounts}),
    (ARRAY['charges.create', 'orders.create', 'refunds.create'])[1 + i %% 3],
    md5(i::text || 'scale'), md5(i::text), 'v1',
    CASE WHEN r < 5 THEN 'in_progress' ELSE 'completed' END,
    CASE WHEN r < 5 THEN gen_random_uuid() END,
    CASE WHEN r < 2 THEN now() + interval '50 seconds'
         WHEN r < 5 THEN created + interval '60 seconds' END,
    'retry', 0,
    CASE WHEN r >= 5 THEN 201 END,
    CASE WHEN r >= 5 THEN '[["Content-Type", "application/json"]]'::jsonb ELSE '[]'::jsonb END,
    CASE WHEN r >= 5 THEN convert_to('{{"id": ' || i || ', "amount": 1000, "currency": "EUR",'
        || ' "description": "' || repeat('x', 190) || '"}}', 'UTF8') END,
    created,
    CASE WHEN r >= 5 THEN created + interval '150 milliseconds' END,
    created + interval '24 hours'
FROM (
    SELECT i, i %% 1000 AS r,
        CASE
            -- live leases: claimed seconds ago; stale ones: minutes ago, lease long gone
            WHEN i %% 1000 < 2 THEN now() - interval '10 seconds'
            WHEN i %% 1000 < 5 THEN now() - interval '10 minutes' - random() * interval '1 hour'
            -- expired: created 25 to 48 hours ago, so past the 24-hour TTL
            WHEN i %% 1000 < 300 THEN now() - interval '25 hours' - random() * interval '23 hours'
            -- inside the TTL: created in the last 23 hours
            ELSE now() - random() * interval '23 hours'
        END AS created
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
) AS source
"""
)
CHUNK = 1_000_000


def setup_django() -> None:
    os.environ["BENCH_DB"] = DATABASE
    site_setup.configure("ours")
    site_setup.ensure_database(DATABASE)
    import django

    django.setup()


def log(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the engine's statements ----------------------------------------------------------------


def claim_request(account: str, key: str, operation: str = OPERATIONS[0]) -> Any:
    from django_idempotency._context import Operation

    return Operation(
        alias=ALIAS,
        account=account,
        operation=operation,
        key=key,
        request_hash=hashlib.sha256(key.encode()).hexdigest(),
        fingerprint_version="v1",
        recovery_policy="retry",
        lease=timedelta(seconds=60),
        ttl=timedelta(hours=24),
    )


def claim(account: str, key: str) -> tuple[Any, float]:
    """One claim statement; (its result, milliseconds)."""
    from django.utils import timezone

    from django_idempotency import _store

    request = claim_request(account, key)
    started = time.perf_counter()
    result = _store.claim(request, timezone.now())
    return result, (time.perf_counter() - started) * 1000


def complete(result: Any) -> float:
    """The fenced completion in its own transaction, as a view's would be; milliseconds."""
    from django.db import transaction
    from django.utils import timezone

    from django_idempotency import _store

    started = time.perf_counter()
    with transaction.atomic(using=ALIAS):
        done = _store.complete(
            ALIAS,
            result.state.id,
            result.state.lease_token,
            status="completed",
            response_status=201,
            response_headers=HEADERS,
            response_body=BODY,
            now=timezone.now(),
        )
    assert done, "the completion lost its lease"
    return (time.perf_counter() - started) * 1000


def new_key() -> tuple[str, str]:
    return f"user:{random.randrange(ACCOUNTS)}", uuid.uuid4().hex


def stored_key(rows: int) -> tuple[str, str, str]:
    """A random record of the fill that is completed and inside its TTL."""
    while True:
        i = random.randint(1, rows)
        if i % 1000 >= 300:
            account = f"user:{(i * 7919) % ACCOUNTS}"
            operation = OPERATIONS[i % 3]
            return account, operation, hashlib.md5(f"{i}scale".encode()).hexdigest()


# -- filling and sizing ---------------------------------------------------------------------


def execute(sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def fill(rows: int) -> float:
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    started = time.perf_counter()
    execute("TRUNCATE django_idempotency_record, django_idempotency_step, django_idempotency_audit")
    for first in range(1, rows + 1, CHUNK):
        last = min(rows, first + CHUNK - 1)
        execute(FILL_SQL.format(accounts=ACCOUNTS), {"first": first, "last": last})
        log(f"filled {last:,} of {rows:,} rows")
    execute("VACUUM ANALYZE django_idempotency_record")
    return time.perf_counter() - started


def sizes(rows: int) -> dict[str, Any]:
    table, indexes, total = execute(
        "SELECT pg_relation_size(%s), pg_indexes_size(%s), pg_total_relation_size(%s)",
        ["django_idempotency_record"] * 3,
    )[0]
    each = execute(
        "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes"
        " WHERE relname = 'django_idempotency_record' ORDER BY 1"
    )
    per_million = 1_000_000 / rows / 2**20
    return {
        "table_mb": table / 2**20,
        "indexes_mb": indexes / 2**20,
        "total_mb": total / 2**20,
        "table_mb_per_million": table * per_million,
        "indexes_mb_per_million": indexes * per_million,
        "total_mb_per_million": total * per_million,
        "index_mb_per_million": {name: size * per_million for name, size in each},
    }


def wal_position() -> int:
    return int(execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0][0])


# -- latency --------------------------------------------------------------------------------


def latency(rows: int, samples: int, window: int = 50) -> dict[str, Any]:
    """Interleaved first requests and replays; WAL per first request by windows.

    The WAL position is the whole server's, which other databases' work moves too: it is
    read around windows of ``window`` first requests and the median window is kept, so a
    burst elsewhere spoils one window, not the figure.
    """
    claims, firsts, replays, wal_per_request = [], [], [], []
    for _ in range(200):  # warm the connection, the plans and the cache
        result, _ms = claim(*new_key())
        complete(result)
        claim_stored(rows)
    started = time.perf_counter()
    for _ in range(samples // window):
        before = wal_position()
        for _ in range(window):
            result, claim_ms = claim(*new_key())
            assert result.claimed
            claims.append(claim_ms)
            firsts.append(claim_ms + complete(result))
        wal_per_request.append((wal_position() - before) / window)
        for _ in range(window):
            replays.append(claim_stored(rows))
    seconds = time.perf_counter() - started
    return {
        "claim": summary(claims),
        "first_request": summary(firsts),
        "replay": summary(replays),
        "wal_bytes_per_first_request": statistics.median(wal_per_request),
        "first_requests_per_second": len(firsts) / sum(firsts) * 1000,
        "seconds": seconds,
    }


def claim_stored(rows: int) -> float:
    from django.utils import timezone

    from django_idempotency import _store, states

    account, operation, key = stored_key(rows)
    request = claim_request(account, key, operation)
    started = time.perf_counter()
    result = _store.claim(request, timezone.now())
    elapsed = (time.perf_counter() - started) * 1000
    assert not result.claimed, result
    assert result.state.status == states.COMPLETED, result
    return elapsed


# -- the purge beside traffic ---------------------------------------------------------------


def claimer(rate: float, stop_file: str, out: str, cap: float) -> None:
    """Claim and complete new keys at a steady rate until ``stop_file`` exists."""
    samples: list[tuple[float, float]] = []
    for _ in range(50):
        result, _ms = claim(*new_key())
        complete(result)
    for _ in paced(rate, stop_file, cap):
        result, ms = claim(*new_key())
        samples.append((time.time(), ms))
        complete(result)
    Path(out).write_text(json.dumps(samples))


def table_stats() -> dict[str, Any]:
    row = execute(
        "SELECT n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count,"
        " last_autovacuum::text, last_autoanalyze::text, vacuum_count"
        " FROM pg_stat_user_tables WHERE relname = 'django_idempotency_record'"
    )[0]
    names = ("live", "dead", "autovacuums", "autoanalyzes", "last_autovacuum")
    names += ("last_autoanalyze", "manual_vacuums")
    return dict(zip(names, row, strict=True))


def purge(rows: int, rate: float, baseline: float, batch_size: int) -> dict[str, Any]:
    from django_idempotency.maintenance import purge_expired

    workdir = tempfile.mkdtemp(prefix="scale-bench-")
    stop_file, out = os.path.join(workdir, "stop"), os.path.join(workdir, "claims.json")
    command = [sys.executable, "-m", "benchmarks.scale", "claimer", "--rate", str(rate)]
    command += ["--stop-file", stop_file, "--out", out]
    before_stats = table_stats()
    process = subprocess.Popen(command, env=os.environ.copy())
    batch_ends: list[float] = []
    try:
        time.sleep(baseline)
        log("purging")
        wal_before = wal_position()
        purge_started = time.time()
        clock = time.perf_counter()
        result = purge_expired(
            batch_size=batch_size, progress=lambda b, r: batch_ends.append(time.perf_counter())
        )
        purge_seconds = time.perf_counter() - clock
        purge_ended = time.time()
        wal = wal_position() - wal_before
        time.sleep(1.0)
    finally:
        Path(stop_file).touch()
        process.wait(timeout=120)
    samples = json.loads(Path(out).read_text())
    # Statistics reach the shared counters up to a second after each backend's transaction.
    execute("SELECT pg_stat_force_next_flush()")
    time.sleep(1.5)
    after_purge = table_stats()
    batches = [b - a for a, b in zip([clock, *batch_ends], batch_ends, strict=False)]
    # What autovacuum does with the dead tuples within a few minutes of the purge (when the
    # server runs it at all), then what a manual VACUUM costs and leaves.
    autovacuum = execute("SHOW autovacuum")[0][0] == "on"
    watched = []
    for _ in range(18 if autovacuum else 0):
        time.sleep(10)
        watched.append(table_stats())
        if watched[-1]["autovacuums"] > after_purge["autovacuums"]:
            break
    clock = time.perf_counter()
    execute("VACUUM django_idempotency_record")
    vacuum_seconds = time.perf_counter() - clock
    execute("SELECT pg_stat_force_next_flush()")
    time.sleep(1.5)
    return {
        "rows": rows,
        "batch_size": batch_size,
        "deleted": result.deleted,
        "batches": result.batches,
        "purge_seconds": purge_seconds,
        "rows_per_second": result.deleted / purge_seconds,
        "longest_batch_ms": result.longest_batch_seconds * 1000,
        "batch_p50_ms": statistics.median(batches) * 1000 if batches else float("nan"),
        "batch_p99_ms": percentile(batches, 99) * 1000,
        "batches_over_100ms": sum(b > 0.1 for b in batches),
        "wal_mb": wal / 2**20,
        "claim_rate": rate,
        "claims_no_purge": summary([ms for t, ms in samples if t < purge_started]),
        "claims_during_purge": summary(
            [ms for t, ms in samples if purge_started <= t <= purge_ended]
        ),
        "table_before": before_stats,
        "table_after_purge": after_purge,
        "autovacuum": autovacuum,
        "table_watched": watched,
        "vacuum_seconds": vacuum_seconds,
        "table_after_vacuum": table_stats(),
        "sizes_after_vacuum": sizes(rows),
        "autovacuum_settings": dict(
            execute(
                "SELECT name, setting || coalesce(' ' || unit, '') FROM pg_settings"
                " WHERE name IN ('autovacuum', 'autovacuum_naptime',"
                " 'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_threshold',"
                " 'autovacuum_vacuum_cost_limit', 'autovacuum_vacuum_cost_delay',"
                " 'shared_buffers', 'max_wal_size')"
            )
        ),
    }


# -- the report -----------------------------------------------------------------------------


def render(figures: dict[str, Any]) -> str:
    from benchmarks.scale_report import render as render_section

    return render_section(figures)


def write_section(section: str, path: Path = RESULTS) -> None:
    """Put the section between its markers in ``path``, or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{SECTION_BEGIN}\n{section.rstrip()}\n{SECTION_END}\n"
    if SECTION_BEGIN in text and SECTION_END in text:
        head, rest = text.split(SECTION_BEGIN, 1)
        text = head + block + rest.split(SECTION_END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text)


def keep_section(rendered: str, path: Path = RESULTS) -> str:
    """``rendered`` with the Scale section of the file at ``path`` carried over."""
    if not path.exists():
        return rendered
    text = path.read_text()
    if SECTION_BEGIN not in text or SECTION_END not in text:
        return rendered
    section = text.split(SECTION_BEGIN, 1)[1].split(SECTION_END, 1)[0]
    return f"{rendered.rstrip()}\n\n{SECTION_BEGIN}{section}{SECTION_END}\n"


def machine() -> dict[str, Any]:
    import django
    import psycopg

    load = os.getloadavg()
    return {
        "postgresql": execute("SHOW server_version")[0][0],
        "django": django.get_version(),
        "psycopg": psycopg.__version__,
        "cores": os.cpu_count(),
        "load_at_start": [round(x, 2) for x in load],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "claimer"])
    parser.add_argument("--sizes", default="10000,1000000,10000000")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--purge", action="store_true", help="the purge on the largest size")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--baseline", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--stop-file")
    parser.add_argument("--out")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-write", action="store_true", help="leave RESULTS.md alone")
    args = parser.parse_args()
    setup_django()
    if args.mode == "claimer":
        claimer(args.rate, args.stop_file, args.out, cap=900)
        return
    started = time.monotonic()
    figures: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join(["python -m benchmarks.scale", *sys.argv[1:]]),
        "sizes": [],
    }
    sizes_wanted = [int(s) for s in args.sizes.split(",")]
    for rows in sizes_wanted:
        log(f"filling {rows:,} rows")
        fill_seconds = fill(rows)
        log(f"measuring {rows:,} rows")
        size = {"rows": rows, "fill_seconds": fill_seconds, **sizes(rows)}
        size.update(latency(rows, args.samples))
        figures["sizes"].append(size)
        log(json.dumps(size))
    if args.purge:
        # The largest table, as measured above (plus the few thousand records the latency
        # runs added, all inside their TTL): its expired 29.5% are purged.
        figures["purge"] = purge(sizes_wanted[-1], args.rate, args.baseline, args.batch_size)
    figures["machine"]["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    figures["minutes"] = (time.monotonic() - started) / 60
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    if not args.no_write:
        write_section(render(figures))


if __name__ == "__main__":
    main()
