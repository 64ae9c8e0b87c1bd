"""The pooled runs really go through their pooler (``python -m tests.poolers``).

Without these, a run named ``pgbouncer`` or ``postgres-pool`` that quietly connected straight
to PostgreSQL would pass for a pooler test.
"""

from __future__ import annotations

import subprocess

import pytest
from django.conf import settings
from django.db import connection


def server_port_and_pid() -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT inet_server_port(), pg_backend_pid()")
        port, pid = cursor.fetchone()
    return int(port), int(pid)


@pytest.mark.skipif(settings.TEST_DB != "pgbouncer", reason="the PgBouncer run only")
@pytest.mark.django_db
def test_pgbouncer_stands_between_django_and_postgres_in_transaction_mode():
    server_port, _ = server_port_and_pid()
    bouncer_port = int(connection.settings_dict["PORT"])
    assert server_port != bouncer_port  # the backend listens elsewhere: a proxy is between
    console = ["psql", "-h", "127.0.0.1", "-p", str(bouncer_port), "-U", "postgres"]
    pools = subprocess.run(
        [*console, "-d", "pgbouncer", "-AtF", "|", "-c", "SHOW POOLS"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    modes = {line.split("|")[0]: line.split("|")[-1] for line in pools.splitlines()}
    assert modes[connection.settings_dict["NAME"]] == "transaction"


@pytest.mark.skipif(settings.TEST_DB != "postgres-pool", reason="the Django pool run only")
@pytest.mark.django_db(transaction=True)
def test_django_pool_hands_server_connections_back():
    assert connection.pool is not None
    pids = set()
    for _ in range(10):
        pids.add(server_port_and_pid()[1])
        connection.close()  # back to the pool; a direct connection would end its backend
    assert len(pids) <= 3, pids  # a few pooled connections, not one backend per cycle
