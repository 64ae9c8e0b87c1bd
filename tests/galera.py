"""A MariaDB Galera Cluster of three nodes on this machine, for tests/test_galera.py.

Each node is a ``mariadbd`` of its own: a data directory under one temporary directory,
free ports for SQL, group communication, IST and SST, and the ``wsrep_provider`` of
Debian's ``galera-4`` package. Node 1 bootstraps the cluster (``--wsrep-new-cluster``);
nodes 2 and 3 join it and receive its state by rsync (SST). The system's MariaDB on 3306
and its configuration files are never read (``--no-defaults``). Every wait is bounded, and
:func:`galera_cluster` kills the three servers and removes their directory on exit.

The settings the product needs on Galera are those of docs/scaling.md: ``binlog_format=ROW``
and ``innodb_autoinc_lock_mode=2`` (Galera's own requirements), and ``wsrep_sync_wait=1``,
so that a read on one node (the record a retry replays) waits until the node has applied
every transaction the cluster committed before it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.live import free_port, migrate, starting_a_server

#: Where Debian's galera-4 package puts the provider (``dpkg -L galera-4``).
PROVIDERS = (Path("/usr/lib/galera/libgalera_smm.so"), Path("/usr/lib/libgalera_smm.so"))
DATABASE = "galera"
NODES = 3
# A bootstrap takes seconds, a joiner's rsync SST a few more; a wedged node fails the run.
TIMEOUT = 90


def provider() -> Path | None:
    return next((path for path in PROVIDERS if path.exists()), None)


def available() -> bool:
    """Whether this machine can run the cluster: mariadbd, galera-4 and rsync (the SST)."""
    return all(
        (
            shutil.which("mariadbd") or Path("/usr/sbin/mariadbd").exists(),
            shutil.which("mariadb-install-db"),
            shutil.which("rsync"),
            provider(),
        )
    )


class Node:
    """One ``mariadbd`` of the cluster."""

    def __init__(self, root: Path, number: int) -> None:
        self.number = number
        self.dir = root / f"node{number}"
        self.data = self.dir / "data"
        self.log = self.dir / "error.log"
        self.port = free_port()
        self.gcomm_port = free_port()
        self.ist_port = free_port()
        self.sst_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def command(self, cluster_address: str, bootstrap: bool) -> list[str]:
        mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        command = [
            mariadbd,
            "--no-defaults",
            "--user=root",
            f"--datadir={self.data}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.dir / 'mysqld.sock'}",
            f"--pid-file={self.dir / 'mysqld.pid'}",
            f"--log-error={self.log}",
            "--skip-log-bin",
            # Small and fast: the cluster lives for one test run.
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=32M",
            "--innodb-flush-log-at-trx-commit=0",
            "--max-connections=200",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_unicode_ci",
            # Galera's requirements.
            "--default-storage-engine=InnoDB",
            "--binlog-format=ROW",
            "--innodb-autoinc-lock-mode=2",
            "--wsrep-on=ON",
            f"--wsrep-provider={provider()}",
            "--wsrep-cluster-name=idempotency",
            f"--wsrep-cluster-address={cluster_address}",
            f"--wsrep-node-name=node{self.number}",
            f"--wsrep-node-address=127.0.0.1:{self.gcomm_port}",
            f"--wsrep-provider-options=base_port={self.gcomm_port};"
            f"ist.recv_addr=127.0.0.1:{self.ist_port};gcache.size=64M",
            f"--wsrep-sst-receive-address=127.0.0.1:{self.sst_port}",
            "--wsrep-sst-method=rsync",
            # The product's setting (docs/scaling.md): reads see what the cluster committed.
            "--wsrep-sync-wait=1",
        ]
        if bootstrap:
            command.append("--wsrep-new-cluster")
        return command

    def start(self, cluster_address: str, bootstrap: bool) -> None:
        starting_a_server(f"Galera node {self.number}")
        self.process = subprocess.Popen(
            self.command(cluster_address, bootstrap),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def connect(self, database: str | None = DATABASE, **options: Any) -> Any:
        import MySQLdb  # type: ignore[import-untyped,import-not-found]  # make test-galera installs it

        return MySQLdb.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            database=database or "",
            connect_timeout=3,
            autocommit=True,
            **options,
        )

    def status(self, name: str) -> str | None:
        """A ``wsrep_*`` status variable, or None while the node does not answer."""
        try:
            conn = self.connect(database=None)
        except Exception:
            return None
        try:
            cursor = conn.cursor()
            cursor.execute("SHOW STATUS LIKE %s", [name])
            row = cursor.fetchone()
            return None if row is None else str(row[1])
        finally:
            conn.close()

    def wait_synced(self, size: int, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"Galera node {self.number} exited:\n{self.log_tail()}")
            if self.status("wsrep_local_state_comment") == "Synced" and self.status(
                "wsrep_cluster_size"
            ) == str(size):
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"Galera node {self.number} not synced in {timeout} s:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL: the node vanishes as in a power cut."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def server_env(self) -> dict[str, str]:
        """What ``tests.settings`` needs to point an app server at this node."""
        return {
            "TEST_DB": "mysql",
            "DB_NAME": DATABASE,
            "MYSQL_HOST": "127.0.0.1",
            "MYSQL_PORT": str(self.port),
        }


class GaleraCluster:
    """Three nodes, started in order: node 1 bootstraps, nodes 2 and 3 join by SST."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="idempotency-galera-"))
        self.nodes = [Node(self.root, number) for number in range(1, NODES + 1)]

    @property
    def address(self) -> str:
        return "gcomm://" + ",".join(f"127.0.0.1:{n.gcomm_port}" for n in self.nodes)

    def start(self) -> None:
        first = self.nodes[0]
        for node in self.nodes:
            node.dir.mkdir(parents=True)
        subprocess.run(
            [
                "mariadb-install-db",
                "--no-defaults",
                "--user=root",
                f"--datadir={first.data}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            timeout=TIMEOUT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        first.start(self.address, bootstrap=True)
        first.wait_synced(1)
        for size, node in enumerate(self.nodes[1:], start=2):
            node.data.mkdir()
            # rsync's daemon on the joiner drops root for ``nobody``, who must own it.
            nobody = pwd.getpwnam("nobody")
            os.chown(node.data, nobody.pw_uid, nobody.pw_gid)
            node.start(self.address, bootstrap=False)
            node.wait_synced(size)
        conn = first.connect(database=None)
        try:
            conn.cursor().execute(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4")
        finally:
            conn.close()

    def migrate(self) -> None:
        migrate(self.nodes[0].server_env(), TIMEOUT * 2)

    def destroy(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def galera_cluster() -> Iterator[GaleraCluster]:
    """A migrated three-node cluster, killed and removed on exit."""
    cluster = GaleraCluster()
    try:
        cluster.start()
        cluster.migrate()
        yield cluster
    finally:
        cluster.destroy()
