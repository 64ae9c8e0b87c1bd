"""The runs of ``python -m tests.poolers`` really reach what they name.

Without these, a run named ``pgbouncer`` or ``postgres-pool`` that quietly connected straight
to PostgreSQL would pass for a pooler test, and a ``pg16`` run on 15 for a run on 16.
"""

from __future__ import annotations

import os
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
        [*console, "-d", "pgbouncer", "-AF", "|", "-P", "footer=off", "-c", "SHOW POOLS"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    header, *rows = (line.split("|") for line in pools.splitlines())
    mode = header.index("pool_mode")  # later versions add columns after it
    modes = {row[0]: row[mode] for row in rows}
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


@pytest.mark.skipif("TEST_PG_MAJOR" not in os.environ, reason="a run on a chosen version only")
@pytest.mark.django_db
def test_the_server_is_the_major_version_asked_for():
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version_num")
        (version,) = cursor.fetchone()
    assert int(version) // 10000 == int(os.environ["TEST_PG_MAJOR"])
