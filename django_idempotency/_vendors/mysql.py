"""MariaDB and MySQL (Django's ``mysql`` backends, through mysqlclient), and a MariaDB Galera
Cluster, which Django sees as MariaDB: its answers to the checklist of
:class:`.base.Vendor`.

Galera's differences, and where they are met:

- two nodes may accept the same key at once; the transaction certified second is rolled
  back with error 1213, InnoDB's deadlock: :meth:`MySQL.retryable` runs a claim again, and
  the work's own transaction answers ``503`` with ``Retry-After``;
- a node that is not (or no longer) part of the cluster's primary component refuses every
  statement with error 1047 ("WSREP has not yet prepared node for application use"), and
  a node killed loses its connections (2013, 2006): :meth:`MySQL.connection_lost`;
- row locks are a node's own (``SKIP LOCKED`` included): two relays or purgers on two nodes
  may pick the same row, and one of them loses at certification (1213);
- a read on one node may not yet see a commit certified on another:
  ``wsrep_sync_wait=1`` in the idempotency database's ``init_command`` (docs/scaling.md)
  makes a replay's read wait for it. A setting of the deployment, not a member here.
"""

from __future__ import annotations

import weakref
from typing import Any

from django.db import Error
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency._vendors.base import Vendor, at_most

__all__ = ["ANY_SERVER", "MySQL"]

# InnoDB's deadlock (and Galera's certification conflict), and a lock wait that timed out.
_DEADLOCK, _LOCK_WAIT_TIMEOUT = 1213, 1205
#: "Record has changed since last read": under ``innodb_snapshot_isolation`` (MariaDB's
#: default from 11.6), a locking read or write of a row changed after the transaction's
#: snapshot; the transaction is to be retried, as after a deadlock.
_CHANGED_SINCE_READ = 1020
# The connection itself lost: 2002 and 2003 (cannot connect), 2006 (the server has gone
# away), 2013 (lost during a query; also a read_timeout that expired), 1053 (the server is
# shutting down), 1927 (the connection was killed), 4031 (disconnected by the server for
# inactivity), and Galera's 1047 (the node is not ready for application use).
_LOST = frozenset({2002, 2003, 2006, 2013, 1053, 1927, 4031, 1047})


# A completion's statement without its body and headers: its SQL and its other values.
_STATEMENT_ROOM = 16 * 1024
# A statement every server takes: max_allowed_packet starts at 16 MiB on MariaDB and 64 MiB
# on MySQL 8, and check --database reports a server set below this (W040).
ANY_SERVER = 1024 * 1024
# Each driver connection's max_allowed_packet, read the first time an outcome may not fit.
_packet_limits: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _error_number(exc: Error) -> int | None:
    """The error number of the mysqlclient error under ``exc``, or ``None``."""
    args: tuple[Any, ...] = getattr(exc.__cause__, "args", ())
    number = args[0] if args else None
    return number if number.__class__ is int else None


class MySQL(Vendor):
    """MariaDB 10.6+ and MySQL 8 (``SKIP LOCKED``), InnoDB, and Galera on MariaDB."""

    name = "mysql"

    share_lock = " LOCK IN SHARE MODE"

    def claim_connection_options(self, options: dict[str, Any], seconds: int) -> str | None:
        for name in ("connect_timeout", "read_timeout", "write_timeout"):
            at_most(options, name, seconds + 1)
        # The server gives up a lock wait too, or it would commit the claim after the
        # client left (read_timeout ends only the client's wait): a claim that fails closed
        # leaves nothing behind. The project's own init_command is left as it wrote it (a
        # SET of its own may not take another assignment: SET TRANSACTION ...; it may be no
        # SET at all): the bound then follows it, once per connect.
        if options.get("init_command") is None:
            options["init_command"] = self.lock_wait_bound(seconds)
            return None
        return self.lock_wait_bound(seconds)

    def lock_wait_bound(self, seconds: int) -> str:
        return f"SET SESSION innodb_lock_wait_timeout = {seconds}"

    def snapshot_isolation(self, connection: BaseDatabaseWrapper) -> str | None:
        # InnoDB's UPDATE reads the latest committed row under REPEATABLE READ; SERIALIZABLE
        # turns the caller's reads into shared locks that the claim's insert would wait on.
        # Django sets the level per session from OPTIONS["isolation_level"].
        level = getattr(connection, "isolation_level", None)
        return "serializable" if level == "serializable" else None

    def retryable(self, exc: Error, bounded: bool) -> bool:
        number = _error_number(exc)
        if number == _LOCK_WAIT_TIMEOUT:
            return not bounded
        return number in (_DEADLOCK, _CHANGED_SINCE_READ)

    def connection_lost(self, exc: Error) -> bool:
        return _error_number(exc) in _LOST

    def statement_limit(
        self, connection: BaseDatabaseWrapper, body: bytes, headers: str
    ) -> int | None:
        # mysqlclient sends a statement with its values quoted into it, each byte that
        # needs it escaped (two bytes for one at most). Below ANY_SERVER nothing is asked;
        # above it the session's max_allowed_packet is read once per connection, and the
        # values are escaped to be counted only where twice their size would not fit.
        sent = (body, headers.encode())
        most = 2 * sum(len(value) for value in sent) + _STATEMENT_ROOM
        if most <= ANY_SERVER:
            return None
        connection.ensure_connection()
        raw = connection.connection
        limit = _packet_limits.get(raw)
        if limit is None:
            with connection.cursor() as cursor:
                cursor.execute(self.packet_limit_sql)
                limit = int(cursor.fetchone()[0])
            _packet_limits[raw] = limit
        if most <= limit:
            return None
        needed = sum(len(raw.escape_string(bytes(value))) for value in sent) + _STATEMENT_ROOM
        return limit if needed > limit else None

    purge_batch = "by key"
    fresh_read = " LOCK IN SHARE MODE"
    newest_read = " LOCK IN SHARE MODE"

    identity_sql = "SELECT DATABASE(), @@hostname, @@port, @@datadir"
    packet_limit_sql = "SELECT @@max_allowed_packet"
