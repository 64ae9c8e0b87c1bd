"""Run every benchmark on this machine's PostgreSQL and write ``benchmarks/RESULTS.md``.

``make bench`` runs ``.venv/bin/python -m benchmarks.run``; ``--quick`` is a smoke run of a
minute or two. See ``benchmarks/README.md`` for what each part measures and why.

Parts (``--only`` picks some): ``inprocess`` (Django's test client, A/B/A/B, statements
per request, cProfile), ``server`` (gunicorn + wrk: throughput and latency, then the
retry storm), ``purge`` (a million expired records and claims beside the purge), ``outbox``
(the relay into Redis: messages/s, and commit-to-consumer latency; ``outbox_bench.py``),
``steps`` (what a step of ``"resume"`` costs next to the same work in one transaction;
``steps_bench.py``), ``tasks`` (the relay's hand-over into django-tasks-db and into Celery
against a sender that does nothing; ``tasks_bench.py``), ``entries`` (every entry point
against its unprotected twin; ``entries_bench.py``).
``--patched DIR`` adds a variant ``patched``: the mixin with the ``django_idempotency``
package of another checkout (a patch applied in a scratch copy), measured in the same
interleaved run as this checkout's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from benchmarks import loadgen, report, scale
from benchmarks.site_setup import TOKEN, database_name

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS_DIR = BENCH / ".results"
ALT_VENV = BENCH / ".venv-alternatives"
WRK_SCRIPT = BENCH / "wrk" / "post.lua"

# "sealed" is the mixin with ENCRYPTION_KEYS set: measured in-process only (its cost is
# CPU in the request, which the real-server runs would only blur with more noise).
# "unprepared" is the mixin on a connection without prepared statements (Django's default).
VARIANTS = ("plain", "floor", "ours", "unprepared", "sealed", "dik", "dfi")
IN_PROCESS_ONLY = ("sealed",)
ALTERNATIVES = ("dik", "dfi")
BODY = {"amount": 1000, "currency": "EUR", "description": "bench"}
# Pinned in the alternatives' venv to the main venv's versions: the same framework code.
SHARED_PACKAGES = {
    "Django": "Django",
    "djangorestframework": "djangorestframework",
    "psycopg": "psycopg[binary]",
    "gunicorn": "gunicorn",
}


@dataclass(frozen=True)
class Plan:
    quick: bool
    inprocess_rounds: int
    inprocess_batch: int
    profile_requests: int
    server_rounds: int
    server_seconds: int
    server_warmup_seconds: int
    concurrency: int
    workers: int
    replay_keys: int
    storm_rounds: int
    storm_size: int
    purge_rows: int
    purge_baseline: float
    purge_rate: float
    purge_batch_sizes: tuple[int, ...]
    writes_batches: int = 5
    writes_requests: int = 200
    # Worker processes per variant in the in-process part, taking the rounds in turn: the
    # same code runs up to 3 % faster or slower in one process than in another (its memory
    # layout, its hash seed), which one process per variant would put into every ratio.
    inprocess_processes: int = 3

    @classmethod
    def make(cls, quick: bool, batch_sizes: tuple[int, ...]) -> Plan:
        if quick:
            return cls(
                True, 3, 30, 200, 1, 2, 1, 8, 4, 50, 5, 50, 50_000, 3, 200, batch_sizes, 2, 100, 1
            )
        return cls(
            False, 15, 100, 1000, 3, 5, 1, 8, 4, 200, 100, 50, 1_000_000, 15, 200, batch_sizes
        )


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- environment ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def variant_env(variant: str, patched: Path | None, redis_url: str | None) -> dict[str, str]:
    path = [str(ROOT)]
    if variant == "patched":
        assert patched is not None
        path.insert(0, str(patched))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "BENCH_VARIANT": variant,
        "BENCH_DB": database_name(variant),
        "DJANGO_SETTINGS_MODULE": "benchmarks.benchsite.settings",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if redis_url:
        env["BENCH_REDIS_URL"] = redis_url
    return env


def ensure_alternatives_venv() -> tuple[Path | None, str]:
    """The separate venv with the alternatives from PyPI; ``(None, why)`` when it cannot be made."""
    python = ALT_VENV / "bin" / "python"
    requirements = [
        line.strip()
        for line in (BENCH / "requirements-alternatives.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    requirements += [f"{spec}=={metadata.version(name)}" for name, spec in SHARED_PACKAGES.items()]
    stamp = ALT_VENV / ".requirements-stamp"
    wanted = "\n".join(sorted(requirements))
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python, ""
    log(f"installing the alternatives into {ALT_VENV.relative_to(ROOT)}: {', '.join(requirements)}")
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(ALT_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
            check=True,
        )
        subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True)
    except subprocess.CalledProcessError as exc:
        return None, f"could not install the alternatives ({exc})"
    stamp.write_text(wanted)
    return python, ""


def workdir(env: dict[str, str]) -> Path:
    """Where a variant's process starts: its own package must come first on ``sys.path``.

    ``python -m`` and gunicorn put the working directory first, so the patched variant
    starts in its scratch copy (``benchmarks`` is found through ``PYTHONPATH``).
    """
    return Path(env["PYTHONPATH"].split(os.pathsep)[0])


def python_for(variant: str, alt_python: Path | None) -> Path:
    if variant in ALTERNATIVES:
        assert alt_python is not None
        return alt_python
    return Path(sys.executable)


@contextmanager
def redis_server() -> Iterator[str | None]:
    """A throwaway Redis of our own (django-idempotency-key's storage and lock)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def connect(database: str) -> Any:
    """An autocommit psycopg connection to ``database`` on the benchmarks' PostgreSQL."""
    import psycopg

    return psycopg.connect(
        host=os.environ.get("PGHOST", "127.0.0.1"),
        port=os.environ.get("PGPORT", "5432"),
        user=os.environ.get("PGUSER", "postgres"),
        dbname=database,
        autocommit=True,
    )


def analyze(variants: list[str]) -> None:
    """Statistics for every table of each variant's database, once the tables hold rows.

    As autovacuum would take them in production. Where it is off (as on the machines the
    benchmarks run on), tables emptied by ``site_setup`` would otherwise keep no statistics
    all run long, and the plan of a lookup would be the planner's guess: with none, it has
    looked a key up through the records table's operation index, reading every record of
    the operation (350 against 174 µs for a replay's claim, measured).
    """
    for variant in variants:
        with connect(database_name(variant)) as connection:
            connection.execute("ANALYZE")


def prepare_database(variant: str, python: Path, env: dict[str, str]) -> None:
    subprocess.run(
        [str(python), "-m", "benchmarks.site_setup", variant],
        env=env,
        cwd=workdir(env),
        check=True,
        stdout=subprocess.DEVNULL,
    )


# -- in-process ---------------------------------------------------------------------------


class Worker:
    """One ``benchmarks.inprocess`` process, spoken to in JSON lines."""

    def __init__(
        self,
        variant: str,
        python: Path,
        env: dict[str, str],
        stderr: IO[str],
        keep: bool = False,
    ) -> None:
        self.variant = variant
        # keep: another process of the variant has emptied its tables already (and made its
        # keys): this one must not empty them under it.
        self.process = subprocess.Popen(
            [str(python), "-m", "benchmarks.inprocess", variant, *(["--keep"] if keep else [])],
            env=env,
            cwd=workdir(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        ready = self._read()
        assert ready["ready"] == variant, ready
        self.package: str | None = ready["package"]
        if variant == "patched":
            assert self.package is not None
            assert self.package.startswith(env["PYTHONPATH"].split(os.pathsep)[0]), self.package

    def _read(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.variant} worker died; see {RESULTS_DIR}/*.log")
        return json.loads(line)

    def ask(self, cmd: str, **args: Any) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write('{"cmd": "quit"}\n')
            self.process.stdin.flush()
            self.process.wait(timeout=30)


def rotated(items: list[str], by: int) -> list[str]:
    """A different order each round, so that no variant always runs first."""
    by %= len(items)
    return items[by:] + items[:by]


def run_inprocess(
    plan: Plan, variants: list[str], envs: dict[str, dict[str, str]], pythons: dict[str, Path]
) -> dict[str, Any]:
    protected = [v for v in variants if v != "plain"]
    latencies: dict[str, list[float]] = defaultdict(list)
    round_medians: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, Counter[str]] = defaultdict(Counter)
    with ExitStack() as stack:
        # Each variant's processes take the rounds in turn (round r: process r mod N); the
        # first of them serves the statements, the writes, the profiles.
        pools: dict[str, list[Worker]] = defaultdict(list)
        for variant in variants:
            for i in range(plan.inprocess_processes):
                log(f"in-process: starting {variant} worker {i + 1}/{plan.inprocess_processes}")
                name = f"inprocess-{variant}" + (f"-{i + 1}" if i else "")
                stderr = stack.enter_context(open(RESULTS_DIR / f"{name}.log", "w"))
                worker = Worker(variant, pythons[variant], envs[variant], stderr, keep=i > 0)
                stack.callback(worker.close)
                pools[variant].append(worker)
            log(f"in-process: {variant} runs django_idempotency from {pools[variant][0].package}")
        workers = {variant: pool[0] for variant, pool in pools.items()}
        for r in range(plan.inprocess_rounds):
            # The first time: the workers' warm-ups wrote the first rows. Then each round, as
            # autovacuum would after the tables grew by a tenth.
            analyze(variants)
            steps = [(v, "create") for v in rotated(variants, r)]
            steps += [(v, "replay") for v in rotated(protected, r)]
            if "plain" in workers:
                steps.append(("plain", "noop"))
            for variant, kind in steps:
                pool = pools[variant]
                answer = pool[r % len(pool)].ask(kind, n=plan.inprocess_batch)
                name = f"{variant}.{kind}"
                latencies[name].extend(answer["latencies_ms"])
                round_medians[name].append(statistics.median(answer["latencies_ms"]))
                statuses[name].update(answer["statuses"])
            log(f"in-process: round {r + 1}/{plan.inprocess_rounds} done")
        sql = {variant: worker.ask("sql") for variant, worker in workers.items()}
        writes: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
        for r in range(plan.writes_batches):
            for variant in rotated(variants, r):
                kinds = ["create"] + (["replay"] if variant != "plain" else ["noop"])
                for kind in kinds:
                    answer = workers[variant].ask("writes", kind=kind, n=plan.writes_requests)
                    writes[variant][kind].append(answer)
            log(f"in-process: writes batch {r + 1}/{plan.writes_batches} done")
        sealing = workers["sealed"].ask("sealing", n=2000) if "sealed" in workers else None
        profiles: dict[str, Any] = {}
        chosen = [("plain", "create"), ("ours", "create"), ("ours", "replay")]
        chosen += [("patched", "create"), ("patched", "replay")]
        for variant, kind in chosen:
            if variant in workers:
                out = RESULTS_DIR / f"profile-{variant}-{kind}.prof"
                log(f"in-process: cProfile of {plan.profile_requests} {variant} {kind}s")
                answer = workers[variant].ask(
                    "profile", kind=kind, n=plan.profile_requests, out=str(out)
                )
                profiles[f"{variant}.{kind}"] = {**answer, **profile_summary(out, answer["n"])}
    return {
        "median_ms": {name: statistics.median(values) for name, values in latencies.items()},
        "p90_ms": {name: quantile(values, 0.9) for name, values in latencies.items()},
        "requests": {name: len(values) for name, values in latencies.items()},
        "round_medians_ms": dict(round_medians),
        "statuses": {name: dict(counter) for name, counter in statuses.items()},
        "sql": sql,
        "writes": {variant: dict(kinds) for variant, kinds in writes.items()},
        "profiles": profiles,
        "sealing": sealing,
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def profile_summary(path: Path, requests: int) -> dict[str, Any]:
    """Per-request milliseconds of the package's own functions and of the database driver."""
    stats = pstats.Stats(str(path))
    entries = stats.stats  # type: ignore[attr-defined]
    total = max(ct for (_, _, _), (_, _, _, ct, _) in entries.items())
    own: list[tuple[float, float, str]] = []
    for (filename, line, name), (_, _, tottime, cumtime, _) in entries.items():
        if "django_idempotency" in filename and "benchmarks" not in filename:
            where = filename.split("django_idempotency/")[-1]
            own.append((cumtime, tottime, f"{where}:{line}({name})"))
    own.sort(reverse=True)
    wait = sum(
        tottime
        for (filename, _, name), (_, _, tottime, _, _) in entries.items()
        if "psycopg" in filename and name in ("wait", "_execute_send", "_exec_command")
    )
    return {
        "total_ms_per_request": total * 1000 / requests,
        "driver_wait_ms_per_request": wait * 1000 / requests,
        "top": [
            {"function": name, "cum_ms": cum * 1000 / requests, "own_ms": tot * 1000 / requests}
            for cum, tot, name in own[:15]
        ],
    }


# -- real server ----------------------------------------------------------------------------


@dataclass
class Server:
    variant: str
    port: int
    process: subprocess.Popen[bytes]


@contextmanager
def gunicorn(
    variant: str, python: Path, env: dict[str, str], workers: int, log_file: IO[str]
) -> Iterator[Server]:
    port = free_port()
    command = [
        str(python),
        "-m",
        "gunicorn",
        "benchmarks.benchsite.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        "--timeout",
        "60",
        "--graceful-timeout",
        "2",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(
        command, cwd=workdir(env), env=env, stdout=log_file, stderr=log_file, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"gunicorn for {variant} exited; see its log in {RESULTS_DIR}")
            if post(port, "/noop/", str(uuid.uuid4()))[0]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn for {variant} did not start within 30 s")
            time.sleep(0.2)
        yield Server(variant, port, process)
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[Any], timeout: float = 15) -> None:
    """SIGTERM a process group (started with ``start_new_session``), SIGKILL if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)


def post(port: int, path: str, key: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    payload = loadgen.raw_request(
        path,
        json.dumps(body or BODY).encode(),
        {"Authorization": f"Token {TOKEN}", "Idempotency-Key": key},
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(payload)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError:
        return 0, b""
    data = b"".join(chunks)
    return loadgen._status(data), data


def load_run(
    server: Server, plan: Plan, mode: str, keys_file: Path | None, seconds: int
) -> dict[str, Any]:
    """One closed-loop run: wrk when installed, else the Python load generator."""
    url = f"http://127.0.0.1:{server.port}/charges/"
    prefix = f"{mode}-{server.variant}-{uuid.uuid4().hex[:12]}"
    if shutil.which("wrk"):
        argument = str(keys_file) if mode == "replay" else prefix
        command = ["wrk", "-t1", f"-c{plan.concurrency}", f"-d{seconds}s", "--timeout", "10s"]
        command += ["-s", str(WRK_SCRIPT), url, "--", mode, TOKEN, argument]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        summary = json.loads(output.strip().splitlines()[-1])
        duration = summary["duration_us"] / 1e6
        ok = summary["requests"] - summary["status_errors"]
        return {
            "requests": summary["requests"],
            # Only answers with a 2xx/3xx status count: a quick 423 is no throughput.
            "rps": ok / duration,
            "p50_ms": summary["p50_us"] / 1000,
            "p99_ms": summary["p99_us"] / 1000,
            "non_2xx_3xx": summary["status_errors"],
            "errors": summary["connect_errors"]
            + summary["read_errors"]
            + summary["write_errors"]
            + summary["timeouts"],
        }
    keys = keys_file.read_text().split() if keys_file else []
    headers = {"Authorization": f"Token {TOKEN}"}
    body = json.dumps(BODY).encode()

    def make(n: int) -> bytes:
        key = keys[n % len(keys)] if mode == "replay" else f"{prefix}-{n}"
        return loadgen.raw_request("/charges/", body, {**headers, "Idempotency-Key": key})

    return loadgen.load(server.port, make, plan.concurrency, seconds)


def run_server(
    plan: Plan,
    variants: list[str],
    envs: dict[str, dict[str, str]],
    pythons: dict[str, Path],
) -> dict[str, Any]:
    protected = [v for v in variants if v != "plain"]
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    storm: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        servers: dict[str, Server] = {}
        for variant in variants:
            log_file = stack.enter_context(open(RESULTS_DIR / f"gunicorn-{variant}.log", "w"))
            servers[variant] = stack.enter_context(
                gunicorn(variant, pythons[variant], envs[variant], plan.workers, log_file)
            )
        log(f"server: {len(servers)} gunicorns up ({plan.workers} sync workers each)")
        keys_files: dict[str, Path] = {}
        for variant in protected:
            keys = [f"replay-{variant}-{uuid.uuid4()}" for _ in range(plan.replay_keys)]
            for key in keys:
                status, _ = post(servers[variant].port, "/charges/", key)
                assert status == 201, (variant, status)
            keys_files[variant] = RESULTS_DIR / f"replay-keys-{variant}.txt"
            keys_files[variant].write_text("\n".join(keys) + "\n")
        analyze(variants)
        for variant in variants:  # warm every worker of every server
            load_run(servers[variant], plan, "new", None, plan.server_warmup_seconds)
        for r in range(plan.server_rounds):
            if r:
                analyze(variants)  # as autovacuum would, once the tables have grown
            steps = [(v, "new") for v in rotated(variants, r)]
            steps += [(v, "replay") for v in rotated(protected, r)]
            for variant, mode in steps:
                result = load_run(
                    servers[variant], plan, mode, keys_files.get(variant), plan.server_seconds
                )
                runs[f"{variant}.{'create' if mode == 'new' else 'replay'}"].append(result)
            log(f"server: load round {r + 1}/{plan.server_rounds} done")
        storm = run_storm(plan, servers, variants)
    return {"runs": dict(runs), "storm": storm}


def side_effects(variant: str, marker: str, connection: Any) -> int:
    row = connection.execute(
        "SELECT count(*) FROM benchsite_charge WHERE description = %s", [marker]
    ).fetchone()
    return int(row[0])


def run_storm(plan: Plan, servers: dict[str, Server], variants: list[str]) -> dict[str, Any]:

    run_id = uuid.uuid4().hex[:8]
    effects: dict[str, list[int]] = defaultdict(list)
    seconds: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    connections = {v: connect(database_name(v)) for v in variants}
    try:
        for r in range(plan.storm_rounds):
            for variant in rotated(variants, r):
                marker = f"storm-{run_id}-{r}-{variant}"
                payload = loadgen.raw_request(
                    "/storm/charges/",
                    json.dumps({**BODY, "description": marker}).encode(),
                    {"Authorization": f"Token {TOKEN}", "Idempotency-Key": marker},
                )
                answer = loadgen.storm(servers[variant].port, payload, plan.storm_size)
                effects[variant].append(side_effects(variant, marker, connections[variant]))
                seconds[variant].append(answer.seconds_to_last_answer)
                statuses[variant].update(answer.statuses)
            if (r + 1) % 10 == 0 or r + 1 == plan.storm_rounds:
                log(f"server: storm round {r + 1}/{plan.storm_rounds} done")
    finally:
        for connection in connections.values():
            connection.close()
    return {
        v: {
            "rounds": len(effects[v]),
            "side_effects": effects[v],
            "seconds_to_last_answer": seconds[v],
            "statuses": {str(k): n for k, n in sorted(statuses[v].items())},
        }
        for v in variants
    }


# -- purge ----------------------------------------------------------------------------------


def run_purge(plan: Plan, env: dict[str, str]) -> list[dict[str, Any]]:
    results = []
    for batch_size in plan.purge_batch_sizes:
        log(f"purge: {plan.purge_rows:,} expired records, batches of {batch_size}")
        command = [sys.executable, "-m", "benchmarks.purge_bench"]
        command += ["--rows", str(plan.purge_rows), "--batch-size", str(batch_size)]
        command += ["--baseline", str(plan.purge_baseline), "--rate", str(plan.purge_rate)]
        output = subprocess.run(
            command, cwd=workdir(env), env=env, check=True, capture_output=True, text=True
        ).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
    return results


# -- outbox ---------------------------------------------------------------------------------


def run_outbox(plan: Plan) -> dict[str, Any]:
    if shutil.which("redis-server") is None:
        log("outbox: skipped, redis-server is not installed")
        return {"throughput": [], "latency": [], "skipped": "redis-server is not installed"}
    log("outbox: relay throughput into Redis, then commit-to-consumer latency")
    quick = ["--messages", "2000", "--latency-messages", "50"]
    return run_alone("benchmarks.outbox_bench", quick if plan.quick else [])


def run_alone(module: str, args: list[str]) -> dict[str, Any]:
    """A benchmark that runs alone (``python -m module args``); the JSON of its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    output = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    data: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return data


# -- steps ----------------------------------------------------------------------------------


def run_steps(plan: Plan) -> dict[str, Any]:
    log("steps: a step against the same INSERT in one transaction, interleaved")
    quick = ["--rounds", "2", "--batch", "20"]
    return run_alone("benchmarks.steps_bench", quick if plan.quick else [])


# -- the relay's hand-over, every entry point -------------------------------------------------


def run_tasks(plan: Plan) -> dict[str, Any]:
    log("tasks: the relay into django-tasks-db and into Celery against a no-op sender")
    quick = ["--messages", "500", "--rounds", "2"]
    # RabbitMQ as well where one answers (TASKS_BENCH_AMQP, guest on this machine's by default).
    amqp = os.environ.get("TASKS_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
    host, _, port = amqp.split("@")[-1].split("/")[0].partition(":")
    try:
        socket.create_connection((host, int(port or 5672)), timeout=1).close()
        brokers = ["--broker", amqp]
    except OSError:
        brokers = []
    return run_alone(
        "benchmarks.tasks_bench", ["--celery", *brokers, *(quick if plan.quick else [])]
    )


def run_entries(plan: Plan) -> dict[str, Any]:
    log("entries: every entry point against its unprotected twin, interleaved")
    quick = ["--rounds", "2", "--batch", "20"]
    return run_alone("benchmarks.entries_bench", quick if plan.quick else [])


# -- ATOMIC_REQUESTS ------------------------------------------------------------------------


def run_connections(plan: Plan) -> dict[str, Any]:
    log("connections: each entry point with ATOMIC_REQUESTS off and on, interleaved")
    quick = ["--rounds", "2", "--batch", "20"]
    return run_alone("benchmarks.connections_bench", quick if plan.quick else [])


# -- machine and versions -------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = "unknown"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory": memory,
        "os": platform.platform(),
        "load_average_start": os.getloadavg(),
    }


def versions(alt_python: Path | None) -> dict[str, Any]:
    import psycopg

    main = {name: metadata.version(name) for name in SHARED_PACKAGES}
    main["Python"] = platform.python_version()
    params = {
        "host": os.environ.get("PGHOST", "127.0.0.1"),
        "user": os.environ.get("PGUSER", "postgres"),
    }
    with psycopg.connect(dbname="postgres", **params) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        main["PostgreSQL"] = row[0] if row else "?"
    alternatives: dict[str, str] = {}
    if alt_python is not None:
        names = [*SHARED_PACKAGES, "django-idempotency-key", "drf-idempotency", "django-redis"]
        code = (
            "import json, platform; from importlib import metadata; "
            f"print(json.dumps({{n: metadata.version(n) for n in {names!r}}} | "
            "{'Python': platform.python_version()}))"
        )
        out = subprocess.run([str(alt_python), "-c", code], capture_output=True, text=True)
        alternatives = json.loads(out.stdout) if out.returncode == 0 else {}
    tools: dict[str, str] = {}
    for tool, flag in (("wrk", "-v"), ("redis-server", "--version")):
        if shutil.which(tool):
            out = subprocess.run([tool, flag], capture_output=True, text=True)
            tools[tool] = (out.stdout or out.stderr).strip().splitlines()[0]
    return {"main": main, "alternatives": alternatives, "tools": tools}


# -- main -----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a minute or two")
    parser.add_argument(
        "--only", default="inprocess,server,purge,outbox,steps,connections,tasks,entries"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--patched", type=Path, help="also measure django_idempotency from this checkout"
    )
    parser.add_argument("--patched-label", help="what the patched variant is called in RESULTS.md")
    parser.add_argument("--purge-batch-sizes", default="1000")
    for name in (
        "inprocess-rounds",
        "server-rounds",
        "storm-rounds",
        "profile-requests",
        "writes-batches",
    ):
        parser.add_argument(f"--{name}", type=int, help="override the plan's number")
    parser.add_argument("--output", type=Path, default=BENCH / "RESULTS.md")
    parser.add_argument(
        "--section",
        help="write only this section (its heading, e.g. 'Stored responses encrypted') into "
        "--output, in place of an older one; the rest of the file stays",
    )
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "results.json")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    plan = Plan.make(args.quick, tuple(int(s) for s in args.purge_batch_sizes.split(",")))
    overrides = {
        name: getattr(args, name)
        for name in (
            "inprocess_rounds",
            "server_rounds",
            "storm_rounds",
            "profile_requests",
            "writes_batches",
        )
        if getattr(args, name) is not None
    }
    plan = dataclasses.replace(plan, **overrides)
    RESULTS_DIR.mkdir(exist_ok=True)
    started = time.monotonic()
    variants = [v for v in args.variants.split(",") if v in VARIANTS]
    if args.patched:
        variants.insert(variants.index("ours") + 1 if "ours" in variants else 0, "patched")
    skipped: dict[str, str] = {}
    alt_python: Path | None = None
    if not parts & {"inprocess", "server"}:
        variants = []  # the other parts run on databases of their own
    if any(v in ALTERNATIVES for v in variants):
        alt_python, why = ensure_alternatives_venv()
        if alt_python is None:
            skipped.update({v: why for v in ALTERNATIVES if v in variants})
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
        "plan": asdict(plan),
        "machine": machine(),
        "patched": str(args.patched) if args.patched else None,
        "patched_label": args.patched_label,
    }
    with redis_server() as redis_url:
        if redis_url is None and "dik" in variants:
            skipped["dik"] = "redis-server is not installed (its storage and lock need Redis)"
        variants = [v for v in variants if v not in skipped]
        results["skipped"] = skipped
        envs = {v: variant_env(v, args.patched, redis_url) for v in variants}
        pythons = {v: python_for(v, alt_python) for v in variants}
        for variant in variants:
            log(f"preparing {database_name(variant)}")
            prepare_database(variant, pythons[variant], envs[variant])
        if "inprocess" in parts:
            results["inprocess"] = run_inprocess(plan, variants, envs, pythons)
        if "server" in parts:
            served = [v for v in variants if v not in IN_PROCESS_ONLY]
            results["server"] = run_server(plan, served, envs, pythons)
    if "purge" in parts:
        results["purge"] = [
            {**p, "variant": "ours"} for p in run_purge(plan, variant_env("ours", None, None))
        ]
        if args.patched:
            patched_env = {**variant_env("patched", args.patched, None), "BENCH_VARIANT": "ours"}
            results["purge"] += [{**p, "variant": "patched"} for p in run_purge(plan, patched_env)]
    if "outbox" in parts:
        results["outbox"] = run_outbox(plan)
    if "steps" in parts:
        results["steps"] = run_steps(plan)
    if "connections" in parts:
        results["connections"] = run_connections(plan)
    if "tasks" in parts:
        results["tasks"] = run_tasks(plan)
    if "entries" in parts:
        results["entries"] = run_entries(plan)
    results["versions"] = versions(alt_python)
    results["load_generator"] = "wrk" if shutil.which("wrk") else "benchmarks/loadgen.py (asyncio)"
    results["machine"]["load_average_end"] = os.getloadavg()
    results["seconds"] = time.monotonic() - started
    results["finished_at"] = time.time()
    args.json.write_text(json.dumps(results, indent=1))
    rendered = report.render(results)
    if args.section:
        old = args.output.read_text() if args.output.exists() else ""
        args.output.write_text(report.replace_section(old, rendered, args.section))
    else:
        # The Scale section is written by benchmarks/scale.py (make bench-scale): kept as is.
        args.output.write_text(scale.keep_section(rendered, args.output))
    log(f"wrote {args.output} and {args.json} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
