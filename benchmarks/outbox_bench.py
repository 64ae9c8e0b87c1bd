"""The outbox relay: messages/s relayed into Redis, and latency from commit to consumer start.

``python -m benchmarks.outbox_bench [--messages N] [--latency-messages N] [--rate R]
[--write]`` prints one JSON object; ``--write`` also puts its "Outbox" section into
``benchmarks/RESULTS.md`` (``make bench`` renders the same section from its own run).

It uses the PostgreSQL database ``django_idempotency_bench_outbox`` (created when missing)
and a private ``redis-server`` on a free port (stopped at the end).

- **Throughput**: ``--messages`` pending messages are inserted with one ``INSERT ...
  SELECT generate_series``, then one relay (``outbox.drain``, the function behind
  ``relay_outbox --once``, with the default Celery sender) sends them all into Redis, for
  each batch size of ``--batch-sizes``; then two relay processes at once (``SKIP LOCKED``
  shares the backlog). Nothing consumes them; the queue's length is checked afterwards:
  every message must be in Redis.
- **Latency**: a relay process (``relay_outbox``'s loop: ``outbox.relay``) and a Celery
  worker (solo pool) run; this process commits ``--latency-messages`` messages, one per
  transaction, at ``--rate`` per second. The consumer writes the time it started into Redis;
  the latency is that time minus the time the ``COMMIT`` returned. Once with ``LISTEN``/
  ``NOTIFY``, once polling only (every ``OUTBOX_POLL_INTERVAL``, 1 s by default).
- **Enqueue cost** (``--enqueue-costs``, this part alone, no Redis): one enqueue per
  transaction (``BEGIN``, the enqueue, ``COMMIT``), timed in blocks of ``--block`` and
  interleaved over ``--rounds`` rounds in a shuffled order: a plain ``enqueue``,
  ``enqueue_once`` of a new key (the key written with the message), and ``enqueue_once`` of
  a key a live message holds (nothing written: the live message's id). The statements of
  one transaction of each are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from celery import Celery

DATABASE = "django_idempotency_bench_outbox"
QUEUE = "outbox-bench"
STARTS = "outbox-bench-starts"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

app = Celery("outbox_bench", set_as_current=True)
app.conf.update(
    broker_url=os.environ.get("OUTBOX_BENCH_BROKER", "redis://127.0.0.1:6379/15"),
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.consume")
def consume(seq: int) -> None:
    """The consumer: note when it started, in Redis (no database on the measured path)."""
    started = time.time()
    _redis().hset(STARTS, str(seq), repr(started))


_client: Any = None


def _redis() -> Any:
    global _client
    if _client is None:
        import redis

        _client = redis.Redis.from_url(app.conf.broker_url)
    return _client


def configure() -> None:
    """Django on the benchmark's own database, with the outbox's defaults."""
    from benchmarks.site_setup import configure_package_only

    configure_package_only(DATABASE, "django-idempotency-outbox-bench")
    app.set_current()


# -- processes ----------------------------------------------------------------------------------


def wait_for(condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def env(broker: str) -> dict[str, str]:
    return {**os.environ, "OUTBOX_BENCH_BROKER": broker, "PYTHONPATH": str(ROOT)}


@contextmanager
def process(command: list[str], broker: str) -> Iterator[subprocess.Popen[bytes]]:
    from benchmarks.run import stop_group

    child = subprocess.Popen(command, cwd=ROOT, env=env(broker), start_new_session=True)
    try:
        yield child
    finally:
        stop_group(child, timeout=20)


@contextmanager
def worker(broker: str) -> Iterator[None]:
    name = f"outbox-bench-{os.getpid()}@localhost"
    command = [sys.executable, "-m", "celery", "-A", "benchmarks.outbox_bench", "worker"]
    command += ["--pool", "solo", "-Q", QUEUE, "-n", name, "--loglevel", "WARNING"]
    command += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    with process(command, broker):
        wait_for(lambda: app.control.ping(destination=[name], timeout=0.5), "the worker", 30)
        yield


def relay_main(mode: str) -> None:
    """The relay process of the latency part: ``outbox.relay`` until SIGTERM."""
    configure()
    from django_idempotency import outbox
    from django_idempotency.management.commands.relay_outbox import stop_on_signals

    with stop_on_signals() as stopping:
        outbox.relay(listen=mode == "notify", stop=stopping.is_set)


# -- the parts ----------------------------------------------------------------------------------

FILL_SQL = """
INSERT INTO django_idempotency_outbox
    (id, task, args, kwargs, status, attempts, available_at, created_at, sent_at, last_error,
     delivery, run_reported)
SELECT gen_random_uuid(), 'bench.consume', jsonb_build_array(i), '{}'::jsonb, 'pending', 0,
       now() - interval '1 minute', now() - interval '1 minute', NULL, '', '{}'::jsonb, false
FROM generate_series(1, %s) AS i
"""


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_outbox_key, django_idempotency_outbox")


def fill(messages: int) -> None:
    from django.db import connection

    reset()
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, [messages])
        cursor.execute("VACUUM ANALYZE django_idempotency_outbox")
    _redis().delete(QUEUE)


def throughput(messages: int, batch_size: int, relays: int, broker: str) -> dict[str, Any]:
    """Drain a backlog of ``messages`` with ``relays`` relays at once (processes if > 1)."""
    from django_idempotency import outbox

    fill(messages)
    if relays == 1:
        started = time.time()
        result = outbox.drain(batch_size=batch_size)
        ended, sent, failed = time.time(), result.sent, result.failed
    else:
        figures = drain_in_processes(relays, batch_size, broker)
        started = min(f["started"] for f in figures)
        ended = max(f["ended"] for f in figures)
        sent, failed = sum(f["sent"] for f in figures), sum(f["failed"] for f in figures)
    client = _redis()
    queued = int(client.llen(QUEUE))
    client.delete(QUEUE)
    seconds = ended - started
    return {
        "batch_size": batch_size,
        "relays": relays,
        "messages": messages,
        "sent": sent,
        "failed": failed,
        "in_redis": queued,
        "seconds": seconds,
        "messages_per_second": sent / seconds,
    }


def drain_in_processes(relays: int, batch_size: int, broker: str) -> list[dict[str, Any]]:
    """``relays`` processes drain at once (they start together on a go file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        go = Path(scratch) / "go"
        command = [sys.executable, "-m", "benchmarks.outbox_bench", "--drain", str(batch_size)]
        children = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env={**env(broker), "OUTBOX_BENCH_GO": str(go)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(relays)
        ]
        time.sleep(3)  # every child has set Django up and waits for the go file
        go.touch()
        outputs = [child.communicate(timeout=300)[0] for child in children]
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def drain_main(batch_size: int) -> None:
    """A relay process of the throughput part: wait for the go file, drain, print figures."""
    configure()
    from django.db import connection

    from django_idempotency import outbox

    connection.ensure_connection()
    outbox.relay_batch(batch_size=1, now=datetime_min())  # warm: imports, connections
    go = Path(os.environ["OUTBOX_BENCH_GO"])
    wait_for(go.exists, "the go file", 60)
    started = time.time()
    result = outbox.drain(batch_size=batch_size)
    ended = time.time()
    print(json.dumps({"started": started, "ended": ended, **asdict(result)}))


def datetime_min() -> Any:
    # A batch "due before the epoch" takes nothing: it only opens what a real one uses.
    from datetime import UTC, datetime

    return datetime(1970, 1, 1, tzinfo=UTC)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def latency(mode: str, count: int, rate: float, broker: str) -> dict[str, Any]:
    from django.db import connection, transaction

    from django_idempotency import outbox

    reset()
    client = _redis()
    client.delete(STARTS, QUEUE)
    committed: dict[str, float] = {}
    relay = [sys.executable, "-m", "benchmarks.outbox_bench", "--relay", mode]
    with worker(broker), process(relay, broker):
        if mode == "notify":
            wait_for(lambda: _listening(connection), "the relay to listen", 30)
        time.sleep(1.5)  # past the relay's first drain (and, polling, in its rhythm)
        gap = 1 / rate
        next_at = time.perf_counter()
        for seq in range(count):
            with transaction.atomic():
                outbox.enqueue(consume, seq)
            committed[str(seq)] = time.time()
            next_at += gap
            time.sleep(max(0.0, next_at - time.perf_counter()))
        wait_for(lambda: client.hlen(STARTS) >= count, "every consumer to start", 120)
    starts = {k.decode(): float(v) for k, v in client.hgetall(STARTS).items()}
    waits = [(starts[seq] - at) * 1000 for seq, at in committed.items()]
    return {
        "mode": mode,
        "messages": count,
        "rate": rate,
        "p50_ms": statistics.median(waits),
        "p99_ms": percentile(waits, 0.99),
        "max_ms": max(waits),
    }


def _listening(connection: Any) -> bool:
    from django_idempotency.outbox import CHANNEL

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s", [f"LISTEN {CHANNEL}"]
        )
        (n,) = cursor.fetchone()
    return bool(n)


ENQUEUES = ("plain", "once_new_key", "once_held_key")


def enqueue_costs(rounds: int, block: int) -> dict[str, Any]:
    """Microseconds per enqueue transaction of each kind, interleaved; statements of each."""
    import random
    from datetime import timedelta

    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from django_idempotency import outbox

    hold = timedelta(hours=1)
    counter = iter(range(10**9))

    def one(kind: str) -> None:
        n = next(counter)
        with transaction.atomic():
            if kind == "plain":
                outbox.enqueue("bench.consume", n)
            elif kind == "once_new_key":
                outbox.enqueue_once(f"key-{n}", "bench.consume", n, unique_until=hold)
            else:
                outbox.enqueue_once("held", "bench.consume", n, unique_until=hold)

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_outbox_key, django_idempotency_outbox")
    statements = {}
    for kind in ENQUEUES:  # warm, and the held key taken
        for _ in range(50):
            one(kind)
        with CaptureQueriesContext(connection) as queries:
            one(kind)
        statements[kind] = len(queries)
    timings: dict[str, list[float]] = {kind: [] for kind in ENQUEUES}
    shuffler = random.Random(46)
    for _ in range(rounds):
        order = list(ENQUEUES)
        shuffler.shuffle(order)
        for kind in order:
            started = time.perf_counter()
            for _ in range(block):
                one(kind)
            timings[kind].append((time.perf_counter() - started) / block * 1e6)
    plain = statistics.median(timings["plain"])
    return {
        "rounds": rounds,
        "block": block,
        "kinds": {
            kind: {
                "median_us": statistics.median(values),
                "min_us": min(values),
                "over_plain_us": statistics.median(values) - plain,
                "statements": statements[kind],
            }
            for kind, values in timings.items()
        },
        "messages_written": outbox.pending_count(),
    }


def prepare() -> None:
    from benchmarks.site_setup import ensure_database

    ensure_database(DATABASE)
    configure()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def run(
    messages: int, batch_sizes: list[int], latency_messages: int, rate: float
) -> dict[str, Any]:
    """Every part, on a private Redis; the figures as one dict."""
    from benchmarks.run import redis_server

    with redis_server() as broker:
        if broker is None:
            raise RuntimeError("the outbox benchmark needs redis-server")
        os.environ["OUTBOX_BENCH_BROKER"] = broker
        app.conf.broker_url = broker
        prepare()
        results: dict[str, Any] = {
            "throughput": [
                throughput(messages, size, relays, broker)
                for relays in (1, 2)
                for size in batch_sizes
            ],
            "latency": [
                latency(mode, latency_messages, rate, broker) for mode in ("notify", "poll")
            ],
        }
        reset()
    return results


def write_section(results: dict[str, Any]) -> None:
    """Put the "Outbox" section into RESULTS.md, in place of an older one."""
    from benchmarks import report

    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(report.replace_section(text, report.outbox(results), "Outbox"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch-sizes", default="100,500")
    parser.add_argument("--latency-messages", type=int, default=300)
    parser.add_argument("--rate", type=float, default=50, help="messages per second (latency)")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument(
        "--enqueue-costs", action="store_true", help="only the enqueue cost part (no Redis)"
    )
    parser.add_argument("--rounds", type=int, default=15, help="rounds (enqueue costs)")
    parser.add_argument("--block", type=int, default=200, help="enqueues per block")
    parser.add_argument("--relay", choices=("notify", "poll"), help=argparse.SUPPRESS)
    parser.add_argument("--drain", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        relay_main(args.relay)
        return 0
    if args.drain:
        drain_main(args.drain)
        return 0
    if args.enqueue_costs:
        prepare()
        costs = enqueue_costs(args.rounds, args.block)
        costs["load_average"] = os.getloadavg()
        print(json.dumps(costs, indent=2))
        if args.write:
            from benchmarks import report

            text = RESULTS.read_text()
            rendered = report.outbox_placeholder() + report.unique_enqueues(costs)
            RESULTS.write_text(report.replace_section(text, rendered, "Unique enqueues"))
        return 0
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    results = run(args.messages, sizes, args.latency_messages, args.rate)
    results["load_average"] = os.getloadavg()
    print(json.dumps(results))
    if args.write:
        write_section(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
