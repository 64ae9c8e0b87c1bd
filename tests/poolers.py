"""Connection poolers and a second PostgreSQL version for the test suite, started here.

``python -m tests.poolers MODE [pytest arguments]`` runs pytest against:

- ``pgbouncer``: a PgBouncer of our own in **transaction** mode on a free port, in front of
  the PostgreSQL on 127.0.0.1:5432 (or ``PGPORT``). Its configuration is written into a
  temporary directory; the system's ``/etc/pgbouncer`` is never read.
- ``postgres-pool``: Django's own connection pool (``OPTIONS["pool"]``, psycopg-pool); no
  process to start, the settings do it all.
- ``pg16``: a private PostgreSQL 16 server (the ``pgserver`` package's binaries) on a free
  port, started with ``initdb``/``pg_ctl`` as ``tests/pg_instance.py`` does for 15.
  ``python -m tests.poolers pg16 -- COMMAND [args]`` runs another command than pytest
  against it, with the same environment (``make tox-pg16``: tox envs on PostgreSQL 16).

The tests that start a private PostgreSQL of their own (``tests/test_faults_database.py``)
put the same pooler in front of it through :func:`server_env`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from tests.live import ROOT, free_port, starting_a_server

SUPERUSER = "postgres"
# Every start and stop is bounded: a wedged pooler fails the run, never hangs it.
TIMEOUT = 30
POOLED_MODES = ("pgbouncer", "postgres-pool")


class PgBouncer:
    """One PgBouncer in transaction mode, forwarding every database name to one upstream.

    ``pool_size``: server connections per database and user. ``pools``: more database names,
    each a pool of its own onto a database of the upstream (``{"claims": ("app", 8)}``: the
    name ``claims`` is the database ``app`` through 8 server connections).
    """

    def __init__(
        self,
        upstream_port: int,
        upstream_host: str = "127.0.0.1",
        pool_size: int = 20,
        pools: dict[str, tuple[str, int]] | None = None,
        query_wait_timeout: int = 5,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.pool_size = pool_size
        self.query_wait_timeout = query_wait_timeout
        self.pools = dict(pools or {})
        self.root = Path(tempfile.mkdtemp(prefix="idempotency-pgbouncer-"))
        self.port = free_port()
        self.log = self.root / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        # PgBouncer refuses to run as root: it runs as the postgres user, who must reach
        # the directory (mkdtemp makes it private to its creator).
        os.chmod(self.root, 0o755)
        shutil.chown(self.root, user=SUPERUSER)

    def config(self) -> str:
        host, port = self.upstream
        return "\n".join(
            [
                "[databases]",
                *(
                    f"{name} = host={host} port={port} dbname={dbname} pool_size={size}"
                    for name, (dbname, size) in self.pools.items()
                ),
                # A wildcard: the test database's name is only known once pytest runs.
                f"* = host={host} port={port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                f"unix_socket_dir = {self.root}",
                "auth_type = trust",
                f"auth_file = {self.root / 'userlist.txt'}",
                f"admin_users = {SUPERUSER}",
                "pool_mode = transaction",
                "max_client_conn = 400",
                f"default_pool_size = {self.pool_size}",
                # When PostgreSQL is down, a client waits for a server connection this long
                # (the default is 120 s) and then gets an error: the app answers 503 promptly
                # instead of hanging past its workers' timeout. Retry the server every second.
                f"query_wait_timeout = {self.query_wait_timeout}",
                "server_login_retry = 1",
                # psycopg sends none of these by default; a client that does is not refused.
                "ignore_startup_parameters = extra_float_digits",
                f"logfile = {self.log}",
                "",
            ]
        )

    def start(self) -> None:
        starting_a_server("PgBouncer")
        ini = self.root / "pgbouncer.ini"
        ini.write_text(self.config())
        (self.root / "userlist.txt").write_text(f'"{SUPERUSER}" ""\n')
        for path in (ini, self.root / "userlist.txt"):
            shutil.chown(path, user=SUPERUSER)
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        self.process = subprocess.Popen(
            ["runuser", "-u", SUPERUSER, "--", binary, str(ini)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited during start-up:\n{self.log_tail()}")
            try:
                psycopg.connect(
                    host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="pgbouncer",
                    connect_timeout=2,
                ).close()  # fmt: skip
                return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise RuntimeError(f"pgbouncer did not accept connections within {TIMEOUT} s")

    def log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def pgbouncer(
    upstream_port: int,
    pool_size: int = 20,
    pools: dict[str, tuple[str, int]] | None = None,
    query_wait_timeout: int = 5,
) -> Iterator[PgBouncer]:
    """A running PgBouncer in front of ``127.0.0.1:upstream_port``, stopped on exit."""
    bouncer = PgBouncer(
        upstream_port, pool_size=pool_size, pools=pools, query_wait_timeout=query_wait_timeout
    )
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()


@contextmanager
def server_env(direct: dict[str, str]) -> Iterator[dict[str, str]]:
    """The environment a server process needs to reach a PostgreSQL the way this run does.

    ``direct`` points at the server itself (``tests.pg_instance.PostgresInstance.server_env``).
    Under ``TEST_DB=pgbouncer`` a PgBouncer of its own is put in front of it; under
    ``postgres-pool`` the server process uses Django's pool; otherwise it connects directly.
    """
    mode = os.environ.get("TEST_DB", "postgres")
    if mode == "pgbouncer":
        with pgbouncer(int(direct["PGPORT"])) as bouncer:
            yield {**direct, "TEST_DB": "pgbouncer", "PGPORT": str(bouncer.port)}
    elif mode == "postgres-pool":
        yield {**direct, "TEST_DB": "postgres-pool"}
    else:
        yield direct


# -- PostgreSQL 16 -------------------------------------------------------------------------


def pg16_bin() -> Path:
    """The PostgreSQL 16 binaries of the ``pgserver`` wheel installed in this environment."""
    # Found, not imported: importing pgserver sets up things of its own that are not needed.
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pgserver is not installed: `make test-pg16` installs it")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


# -- the command line ----------------------------------------------------------------------


def run_pytest(env: dict[str, str], args: list[str]) -> int:
    command = [sys.executable, "-m", "pytest", *args]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, check=False).returncode


def drop_database(port: int, name: str) -> None:
    with psycopg.connect(
        host="127.0.0.1", port=port, user=SUPERUSER, dbname="postgres", autocommit=True,
        connect_timeout=5,
    ) as conn:  # fmt: skip
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("pgbouncer", "postgres-pool", "pg16"):
        print(
            "usage: python -m tests.poolers {pgbouncer,postgres-pool,pg16} [pytest args]\n"
            "       python -m tests.poolers pg16 -- COMMAND [args]"
        )
        return 2
    mode, args = argv[0], argv[1:]
    upstream = int(os.environ.get("PGPORT", "5432"))
    if mode in POOLED_MODES:
        # Django drops its test database at the end, which the pooled server connections
        # still open to it would refuse; the database is kept (--reuse-db) and dropped here,
        # directly on the server, once the pooler has gone.
        name = f"test_django_idempotency_{mode.replace('-', '_')}_{os.getpid()}"
        env = {"TEST_DB": mode, "TEST_DB_NAME": name}
        try:
            if mode == "postgres-pool":
                return run_pytest(env, ["--reuse-db", *args])
            with pgbouncer(upstream) as bouncer:
                return run_pytest({**env, "PGPORT": str(bouncer.port)}, ["--reuse-db", *args])
        finally:
            drop_database(upstream, name)
    from tests.pg_instance import PostgresInstance

    os.environ["PG_BIN"] = str(pg16_bin())
    instance = PostgresInstance(bin_dir=pg16_bin())
    try:
        instance.init()
        version = instance.scalar("SHOW server_version")
        print(f"PostgreSQL {version} on 127.0.0.1:{instance.port}", flush=True)
        env = {**instance.server_env(), "PG_BIN": str(pg16_bin()), "TEST_PG_MAJOR": "16"}
        if args[:1] == ["--"]:  # another command than pytest: tox envs, say (make tox-pg16)
            return subprocess.run(args[1:], cwd=ROOT, env={**os.environ, **env}).returncode
        return run_pytest(env, args)
    finally:
        instance.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
