"""In-process worker: one variant, Django's test client, driven by ``run.py`` over stdin/stdout.

Runs in the variant's venv: ``python -m benchmarks.inprocess <variant>``. Each line on stdin
is a JSON command; each answer is one JSON line on stdout. The coordinator sends the same
batches to every variant in turn (A/B/A/B), so slow phases of the machine hit all of them.

Commands: ``{"cmd": "create", "n": N}`` times N first requests (new keys);
``{"cmd": "replay", "n": N}`` times N retries of keys created beforehand;
``{"cmd": "noop", "n": N}`` times N calls of the authenticated no-op endpoint;
``{"cmd": "sql"}`` records the statements of one first request and one replay;
``{"cmd": "profile", "kind": "create"|"replay", "n": N, "out": PATH}`` runs cProfile;
``{"cmd": "sealing", "n": N}`` times N seals and opens of a stored response (ENCRYPTION_KEYS);
``{"cmd": "quit"}``.
"""

from __future__ import annotations

import cProfile
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import site_setup

BODY = {"amount": 1000, "currency": "EUR", "description": "bench"}
REPLAY_POOL = 200


class Worker:
    def __init__(self, variant: str, reset: bool = True) -> None:
        self.variant = variant
        token = site_setup.prepare(variant, reset=reset)
        from django.test import Client

        self.client = Client(HTTP_AUTHORIZATION=f"Token {token}")
        self.body = json.dumps(BODY)
        self.replay_keys: list[str] = []
        self.next_replay = 0
        # Warm up: imports, URL resolver, first connection, prepared caches.
        for _ in range(20):
            self._post(self._new_key())

    @staticmethod
    def _new_key() -> str:
        return str(uuid.uuid4())

    def _post(self, key: str, path: str = "/charges/") -> int:
        response = self.client.post(
            path, self.body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )
        return int(response.status_code)

    def _timed(self, keys: list[str], path: str = "/charges/") -> dict[str, Any]:
        latencies = []
        statuses: Counter[int] = Counter()
        clock = time.perf_counter
        for key in keys:
            started = clock()
            status = self._post(key, path)
            latencies.append((clock() - started) * 1000)
            statuses[status] += 1
        return {"latencies_ms": latencies, "statuses": dict(statuses)}

    def _replay_keys(self, n: int) -> list[str]:
        if not self.replay_keys:
            self.replay_keys = [self._new_key() for _ in range(REPLAY_POOL)]
            for key in self.replay_keys:
                self._post(key)
        keys = []
        for _ in range(n):
            keys.append(self.replay_keys[self.next_replay % len(self.replay_keys)])
            self.next_replay += 1
        return keys

    def create(self, n: int) -> dict[str, Any]:
        return self._timed([self._new_key() for _ in range(n)])

    def replay(self, n: int) -> dict[str, Any]:
        return self._timed(self._replay_keys(n))

    def noop(self, n: int) -> dict[str, Any]:
        return self._timed([self._new_key() for _ in range(n)], "/noop/")

    def sql(self, n: int = 30) -> dict[str, Any]:
        """The statements of one first request and of one replay, and each one's round trip.

        ``n`` first requests and ``n`` replays are traced; the times are the medians, per
        position in the request, from sending a statement to the server's ReadyForQuery.
        """
        keys = [self._new_key() for _ in range(n)]
        self._replay_keys(1)
        answer = {}
        for kind in ("create", "replay"):
            traced = [_statements(lambda key=key: self._post(key)) for key in keys]
            first = traced[0]
            same = [t for t in traced if len(t["wire"]) == len(first["wire"])]
            first["round_trip_ms"] = [
                statistics.median(t["round_trip_ms"][i] for t in same)
                for i in range(len(first["wire"]))
            ]
            answer[kind] = first
        return answer

    def sealing(self, n: int) -> dict[str, Any]:
        """Microseconds per seal and per open of a response, and its stored size, by body size.

        What ENCRYPTION_KEYS adds to a completion and to a replay, measured alone.
        """
        from django_idempotency import crypto

        headers = [["Content-Type", "application/json"], ["Location", "/charges/123/"]]
        clock = time.perf_counter
        answer: dict[str, Any] = {}
        for size in (100, 4096, 65536):
            body = os.urandom(size)
            started = clock()
            for _ in range(n):
                stored = crypto.seal_response(headers, body)
            sealed = clock()
            for _ in range(n):
                assert crypto.open_response(*stored)[1] == body
            opened = clock()
            answer[str(size)] = {
                "seal_us": (sealed - started) / n * 1e6,
                "open_us": (opened - sealed) / n * 1e6,
                "stored_bytes": len(stored[1]) + len(json.dumps(stored[0])),
                "clear_bytes": size + len(json.dumps(headers)),
            }
        return answer

    def writes(self, kind: str, n: int) -> dict[str, Any]:
        """What ``n`` requests of one kind write: WAL, row updates, HOT updates.

        WAL is read back with ``pg_walinspect`` between two LSNs and kept only where it
        touches this variant's database (its block references name the database's OID), plus
        the commit records of those transactions: other databases on the same server (the
        other variants, test suites) write WAL at the same time. Table counters come from
        ``pg_stat_user_tables`` of this database, reset before the batch.
        """
        from django.db import connection

        keys = self._replay_keys(n) if kind == "replay" else [self._new_key() for _ in range(n)]
        path = "/noop/" if kind == "noop" else "/charges/"
        tables = _tables(connection)
        with connection.cursor() as cursor:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            cursor.execute("SELECT oid FROM pg_database WHERE datname = current_database()")
            (database_oid,) = cursor.fetchone()
            for table in tables:
                cursor.execute("SELECT pg_stat_reset_single_table_counters(%s::regclass)", [table])
            cursor.execute("SELECT pg_current_wal_insert_lsn()")
            (start,) = cursor.fetchone()
        for key in keys:
            self._post(key, path)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_insert_lsn()")
            (end,) = cursor.fetchone()
        # pg_walinspect reads only what is flushed: a transaction of its own (an id, and a
        # synchronous commit, touching none of the measured tables) flushes up to ``end``.
        from django.db import transaction

        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit = on")
            cursor.execute("SELECT txid_current()")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
        time.sleep(0.2)  # the counters reach the shared statistics when the session is idle
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s::pg_lsn < %s::pg_lsn", [start, end])
            (wrote,) = cursor.fetchone()
            rows = []
            if wrote:  # no WAL at all in between: pg_walinspect needs a range
                cursor.execute(
                    _WAL_SQL, {"start": start, "end": end, "ours": f"%/{database_oid}/%"}
                )
                rows = cursor.fetchall()
            by_relation = {
                name: {"records": records, "bytes": int(size), "fpi_bytes": int(fpi)}
                for name, records, size, fpi in rows
            }
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            counters = {}
            for table in tables:
                cursor.execute(
                    "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del"
                    " FROM pg_stat_user_tables WHERE relid = %s::regclass",
                    [table],
                )
                ins, upd, hot, dele = cursor.fetchone()
                counters[table] = {
                    "inserts": ins,
                    "updates": upd,
                    "hot_updates": hot,
                    "deletes": dele,
                }
        total = sum(r["bytes"] for r in by_relation.values())
        return {
            "n": n,
            "wal_bytes_per_request": total / n,
            "fpi_bytes_per_request": sum(r["fpi_bytes"] for r in by_relation.values()) / n,
            "wal_by_relation": by_relation,
            "tables": counters,
        }

    def profile(self, kind: str, n: int, out: str) -> dict[str, Any]:
        keys = self._replay_keys(n) if kind == "replay" else [self._new_key() for _ in range(n)]
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for key in keys:
            self._post(key)
        profiler.disable()
        elapsed = time.perf_counter() - started
        profiler.dump_stats(out)
        return {"seconds": elapsed, "n": n}


# The WAL of one database between two LSNs, by relation: records whose block references name
# the database, and the commit records of the transactions that wrote them.
_WAL_SQL = """
WITH r AS (
    SELECT xid, resource_manager, record_length, fpi_length, block_ref,
           substring(block_ref from 'rel [0-9]+/[0-9]+/([0-9]+)')::oid AS filenode
    FROM pg_get_wal_records_info(%(start)s::pg_lsn, %(end)s::pg_lsn)
),
ours AS (SELECT DISTINCT xid FROM r WHERE block_ref LIKE %(ours)s AND xid <> '0')
SELECT CASE WHEN r.block_ref LIKE %(ours)s
            THEN coalesce(c.relname, 'relfilenode ' || r.filenode::text)
            ELSE 'commit records' END,
       count(*), coalesce(sum(r.record_length), 0), coalesce(sum(r.fpi_length), 0)
FROM r LEFT JOIN pg_class c ON c.relfilenode = r.filenode
WHERE r.block_ref LIKE %(ours)s
   OR (r.resource_manager = 'Transaction' AND r.xid IN (SELECT xid FROM ours))
GROUP BY 1 ORDER BY 3 DESC
"""


def _tables(connection: Any) -> list[str]:
    names = connection.introspection.table_names()
    wanted = (
        "benchsite_charge",
        "benchsite_floorrecord",
        "django_idempotency_record",
        "drf_idempotency_idempotencyrecord",
    )
    return [name for name in wanted if name in names]


def _statements(call: Any) -> dict[str, Any]:
    """What one request sends to PostgreSQL, seen by Django and on the wire.

    Django's ``execute_wrapper`` sees the statements Django executes (SAVEPOINTs included);
    psycopg sends ``BEGIN`` and ``COMMIT`` itself, so the libpq protocol trace is read too:
    every ``ReadyForQuery`` the server sends ends one round trip.
    """
    from django.db import connection

    seen: list[str] = []
    bound: list[int] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(" ".join(sql.split()))
        bound.append(len(params) if params else 0)
        return execute(sql, params, many, context)

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            with connection.execute_wrapper(wrapper):
                status = call()
        finally:
            pgconn.untrace()
        trace.seek(0)
        wire, round_trips = _wire(trace.read(), _prepared_statements(connection))
    return {
        "status": status,
        "django": seen,
        "wire": wire,
        "round_trip_ms": round_trips,
        "parameters": _parameters(wire, seen, bound),
    }


def _parameters(wire: list[str], seen: list[str], bound: list[int]) -> list[int]:
    """The values bound to each statement on the wire: those Django passed with it (``BEGIN``,
    ``COMMIT`` and savepoints that psycopg or Django send without parameters count 0)."""
    counts = []
    position = 0
    for statement in wire:
        head = statement.split(None, 1)[0].upper() if statement else ""
        if head in ("BEGIN", "COMMIT", "ROLLBACK") and not (
            position < len(seen) and seen[position].upper().startswith(head)
        ):
            counts.append(0)
            continue
        counts.append(bound[position] if position < len(bound) else 0)
        position += 1
    return counts


def _prepared_statements(connection: Any) -> dict[str, str]:
    """The statements prepared on ``connection``, by name (the trace names them only)."""
    with connection.connection.cursor() as cursor:
        cursor.execute("SELECT name, statement FROM pg_prepared_statements")
        return {str(name): str(text) for name, text in cursor.fetchall()}


def _clock(stamp: str) -> float:
    hours, minutes, seconds = stamp.split(" ")[-1].split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _wire(text: str, prepared: dict[str, str] | None = None) -> tuple[list[str], list[float]]:
    """The statements the client sent, and the time until the server was ready again.

    One entry per simple Query, extended-protocol Parse (psycopg's client-side binding sends
    Query; server-side binding sends Parse), or Bind of a statement prepared earlier (its
    text from ``prepared``, by name); its time runs to the next ReadyForQuery.
    """
    sent: list[str] = []
    times: list[float] = []
    started = 0.0
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) < 4:
            continue
        stamp, direction, message = parts[0], parts[1], parts[3]
        if direction == "F" and message in ("Query", "Parse") and len(parts) > 4:
            rest = parts[4].strip()
            if message == "Parse":
                rest = rest.split('"', 2)[-1]
            sent.append(" ".join(rest.strip().strip('"').split())[:4000])
            started = _clock(stamp)
        elif direction == "F" and message == "Bind" and len(times) == len(sent):
            # No Parse before it since the last round trip: a prepared statement's execution.
            name = parts[4].split('"')[3] if len(parts) > 4 and parts[4].count('"') >= 4 else ""
            if name:
                sent.append(" ".join((prepared or {}).get(name, f"EXECUTE {name}").split())[:4000])
                started = _clock(stamp)
        elif direction == "B" and message == "ReadyForQuery" and len(times) < len(sent):
            times.append((_clock(stamp) - started) * 1000)
    return sent, times


def main() -> None:
    variant = sys.argv[1]
    # Answers go to the real stdout; anything Django prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    # --keep: another process of this variant emptied the tables already.
    worker = Worker(variant, reset="--keep" not in sys.argv[2:])
    package = sys.modules.get("django_idempotency")
    where = str(Path(package.__file__).parent) if package and package.__file__ else None
    out.write(json.dumps({"ready": variant, "package": where}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("cmd")
        if name == "quit":
            break
        answer = getattr(worker, name)(**command)
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
