"""A throwaway PostgreSQL server of our own, for tests that stop, restart or cripple it.

The shared server on 127.0.0.1:5432 runs everybody's tests, so it is never restarted. This
one lives in a temporary directory, listens on a free port with trust authentication, and
is run as the ``postgres`` OS user (``initdb`` refuses root). The app's tables are created
by ``migrate`` in a database of its own; the tests count effects through :meth:`query`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from tests.live import free_port, migrate, starting_a_server

BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
DATABASE = "faults"
SUPERUSER = "postgres"
# Every pg_ctl and migrate call is bounded; a wedged server fails the test, never hangs it.
TIMEOUT = 60


def available() -> bool:
    """Whether this machine can run a private server (the binaries and the OS user)."""
    try:
        import pwd

        pwd.getpwnam(SUPERUSER)
    except (ImportError, KeyError):
        return False
    return (BIN / "initdb").exists() and shutil.which("runuser") is not None


class PostgresInstance:
    """One private server: ``start``, ``stop``, ``restart``, ``query`` and the env to reach it."""

    def __init__(self, bin_dir: Path = BIN, max_connections: int = 60) -> None:
        starting_a_server("a private PostgreSQL")
        self.bin = bin_dir
        self.max_connections = max_connections
        self.root = Path(tempfile.mkdtemp(prefix="idempotency-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        #: More ``-c name=value`` options of the server (a standby's apply delay).
        self.options = ""
        # The postgres user must reach the directory; mkdtemp makes it private to root.
        os.chmod(self.root, 0o755)
        shutil.chown(self.root, user=SUPERUSER)

    # -- lifecycle -----------------------------------------------------------------------

    def _as_postgres(self, *command: str) -> None:
        subprocess.run(
            ["runuser", "-u", SUPERUSER, "--", *command],
            check=True,
            timeout=TIMEOUT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def _pg_ctl(self, action: str, *extra: str) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root}"
            f" -c fsync=off -c full_page_writes=off -c max_connections={self.max_connections}"
            " -c shared_buffers=16MB"
            f"{self.options}"
        )
        self._as_postgres(
            str(self.bin / "pg_ctl"),
            action,
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            str(TIMEOUT - 5),
            "-o",
            options,
            *extra,
        )

    def init(self) -> None:
        self._as_postgres(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        self.start()
        self.execute(f"CREATE DATABASE {DATABASE}", dbname="postgres")

    def start(self) -> None:
        starting_a_server("a private PostgreSQL")
        self._pg_ctl("start")

    def stop(self) -> None:
        """Fast shutdown: open sessions are terminated, as in a real restart."""
        self._pg_ctl("stop", "-m", "fast")

    def crash(self) -> None:
        """Immediate shutdown: the server stops as in a power cut, without a checkpoint."""
        self._pg_ctl("stop", "-m", "immediate")

    def restart(self) -> None:
        self._pg_ctl("restart", "-m", "fast")

    def running(self) -> bool:
        status = subprocess.run(
            [
                "runuser",
                "-u",
                SUPERUSER,
                "--",
                str(self.bin / "pg_ctl"),
                "status",
                "-D",
                str(self.data),
            ],
            timeout=TIMEOUT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return status.returncode == 0

    def destroy(self) -> None:
        try:
            self._pg_ctl("stop", "-m", "immediate")
        except subprocess.CalledProcessError:
            pass  # already stopped
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- access --------------------------------------------------------------------------

    def connect(self, dbname: str = DATABASE, **options: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=SUPERUSER,
            dbname=dbname,
            autocommit=True,
            connect_timeout=5,
            **options,
        )

    def execute(self, sql: str, params: Any = None, dbname: str = DATABASE) -> None:
        with self.connect(dbname) as conn:
            conn.execute(sql, params)

    def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(sql, params).fetchall()

    def scalar(self, sql: str, params: Any = None) -> Any:
        return self.query(sql, params)[0][0]

    def server_env(self) -> dict[str, str]:
        """What ``tests.settings`` needs to point a server process at this instance."""
        return {
            "TEST_DB": "postgres",
            "DB_NAME": DATABASE,
            "PGHOST": "127.0.0.1",
            "PGPORT": str(self.port),
            "PGUSER": SUPERUSER,
        }

    def migrate(self) -> None:
        migrate(self.server_env(), TIMEOUT * 2)


@contextmanager
def postgres_instance() -> Iterator[PostgresInstance]:
    """A private, migrated PostgreSQL server, destroyed on exit."""
    instance = PostgresInstance()
    try:
        instance.init()
        instance.migrate()
        yield instance
    except subprocess.CalledProcessError as exc:
        log = instance.log.read_text() if instance.log.exists() else ""
        raise RuntimeError(f"private PostgreSQL failed: {exc.stderr!r}\n{log[-2000:]}") from exc
    finally:
        instance.destroy()


class Standby(PostgresInstance):
    """A streaming standby of ``primary``, made by ``pg_basebackup -R``; ``delay``: its
    ``recovery_min_apply_delay``. ``promote`` makes it a primary."""

    def __init__(self, primary: PostgresInstance, delay: str = "0") -> None:
        super().__init__(primary.bin)
        self.primary = primary
        self.options = f" -c recovery_min_apply_delay={delay}"

    def init(self) -> None:
        self._as_postgres(
            str(self.bin / "pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            SUPERUSER,
            "-D",
            str(self.data),
            "-R",
            "-X",
            "stream",
            "--checkpoint=fast",
            "--no-sync",
        )
        self.start()

    def promote(self) -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), "promote", "-w", "-D", str(self.data))

    def server_env(self) -> dict[str, str]:
        return {**super().server_env(), "PGPORT": str(self.port)}
