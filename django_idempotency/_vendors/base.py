"""The interface of every vendor: :class:`Vendor`, whose members are the checklist of a new
one (see :mod:`django_idempotency._vendors`)."""

from __future__ import annotations

from typing import Any

from django.db import Error
from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["Vendor", "at_most"]


def at_most(options: dict[str, Any], name: str, seconds: int) -> None:
    """Bound the timeout ``options[name]`` of a claim connection of the package's own to
    ``seconds``: set where the project's entry has none, lowered where its own is longer
    (or none at all: ``0``), kept where it is shorter."""
    given = options.get(name)
    try:
        number = float(given) if given is not None else None
    except (TypeError, ValueError):
        number = None
    if number is None or number <= 0 or number > seconds:
        options[name] = seconds


class Vendor:
    """A database as the package uses it. Every member is an item of the checklist of a new
    vendor; the defaults are the portable ones."""

    #: Django's name of the backends this vendor serves (``connection.vendor``).
    name: str = ""

    def __init__(self, name: str | None = None) -> None:
        if name is not None:  # a database the package has no module for: its own name
            self.name = name

    # -- the claim and the completion: the hot path reads these as attributes ---------------

    #: The claim is one call of the server-side function that migration 0011 creates
    #: (``postgresql.CLAIM``), its values bound as the driver adapts them: the insert, or
    #: the record in the way handed back, in one round trip. Otherwise the portable claim:
    #: an ``INSERT``, and the record read back when the unique constraint refused it.
    claim_function: bool = False
    #: The driver takes the lease token (a ``UUID``) and the headers as JSON text as they
    #: are (psycopg), so the completion and the owner's statements skip the fields'
    #: preparation. Otherwise each value is prepared as its field stores it.
    native_values: bool = False
    #: What the completion's headers, sent as JSON text, are cast to in SQL (``::jsonb``).
    headers_cast: str = ""
    #: The takeover of a replaceable record is one ``UPDATE`` whose ``WHERE`` takes the row
    #: only when nobody holds it (a ``FOR UPDATE SKIP LOCKED`` subquery on the table it
    #: updates) and returns the new row. Otherwise (MySQL refuses a subquery on the table
    #: it updates) the row is locked first where the database skips locked rows, then
    #: updated, then read back.
    takeover_returning: bool = False
    #: The clause of a read that holds the rows it reads in share mode (a step recorded
    #: against its record, which a takeover's ``UPDATE`` then waits for), where the
    #: database locks rows at all (``features.has_select_for_update``).
    share_lock: str = " FOR SHARE"
    #: The engine's statements may run prepared on the server when the alias's
    #: ``OPTIONS["prepare_threshold"]`` is set (psycopg's prepared statements).
    prepares: bool = False

    #: A statement takes a batch's rows as one JSON parameter (``jsonb_array_elements``,
    #: ``->``), rather than one parameter a value, each quoted by the client: the relay's
    #: hand-over into django-tasks-db and the update that marks a batch sent.
    json_rows: bool = False

    def carries_commit(self, connection: BaseDatabaseWrapper) -> bool:
        """Whether the completion may carry its transaction's ``COMMIT`` in the same round
        trip on ``connection``'s driver, when its statements are sent as text with their
        values (no prepared statements, no server-side binding): the driver sends several
        statements in one, and its ``commit()`` sends nothing once the transaction has
        ended, so that Django's atomic block ends as usual; and, in the same cases, the
        transaction's ``BEGIN`` may ride with its first statement (``_store.claiming``'s
        rider): the driver sends no ``BEGIN`` of its own while in autocommit, and leaves a
        statement's several results to be stepped through. Asked once per alias."""
        return False

    def statement_limit(
        self, connection: BaseDatabaseWrapper, body: bytes, headers: str
    ) -> int | None:
        """The server's limit on the size of one statement, in bytes, where a completion
        carrying ``body`` and ``headers`` (as stored: JSON text) would pass it; else
        ``None``. Such a completion is refused before it is sent (``OutcomeTooLarge``): the
        server would refuse it every time (MariaDB drops the connection), and a retry would
        run the operation again for nothing. ``None`` where one value may take a gigabyte
        (PostgreSQL, SQLite)."""
        return None

    # -- the claim connection (a claim inside a caller's transaction) -----------------------

    #: A second connection can commit a claim while the caller's transaction is open
    #: (a lock per row, not per database), so that the claim commits on its own.
    separate_claims: bool = True
    #: A watchdog interrupts a claim connection's statements past ``CLAIM_TIMEOUT`` (a
    #: cancel, then a close), and the claim's writes carry the deadline, compared with the
    #: server's clock (``postgresql.LATE``). Otherwise the driver's own timeouts bound
    #: them (:meth:`claim_connection_options`).
    watchdog: bool = False

    def claim_connection_options(self, options: dict[str, Any], seconds: int) -> str | None:
        """Bound, in ``options`` (a copy of the caller's ``OPTIONS`` for a claim connection
        of the package's own), its connect and its statements to about ``seconds``. Returns
        a statement to run after each connect, where the bound needs one that ``options``
        cannot hold (the project's own ``init_command``), else ``None``."""
        return None

    def lock_wait_bound(self, seconds: int) -> str | None:
        """The statement that makes a session give a lock wait up after ``seconds``, where
        the server goes on waiting after the client left (else a claim the caller gave up
        on could commit later); ``None`` where no such statement is needed."""
        return None

    def snapshot_isolation(self, connection: BaseDatabaseWrapper) -> str | None:
        """The caller's isolation level where it keeps a claim committed on its own out of
        the caller's sight (or makes the caller's reads lock what the claim must write),
        else ``None``: a caller's transaction at that level is refused."""
        return None

    # -- errors: each vendor knows its driver's, and answers False for another's ------------

    def retryable(self, exc: Error, bounded: bool) -> bool:
        """Whether ``exc`` is a deadlock or a serialization failure (a certification
        conflict on Galera), which the database rolled back and asks the client to run
        again. ``bounded``: inside a claim whose waits ``CLAIM_TIMEOUT`` bounds, where a
        lock wait that timed out is the bound at work, never run again."""
        return False

    def connection_lost(self, exc: Error) -> bool:
        """Whether ``exc`` says that the connection itself was lost (the server gone, the
        backend terminated, the session killed, a cluster node not ready), rather than that
        its statement failed: the transaction on it did not commit."""
        return False

    # -- maintenance and figures -------------------------------------------------------------

    #: How the purge deletes a batch of rows it picked and locked: ``"statement"``, one
    #: statement that picks (skipping locked rows), deletes and returns them
    #: (``_purge._postgres_batch``); ``"by key"``, one ``DELETE`` per primary key, so that a
    #: cost-based plan never scans (and locks) the whole key (``_purge._mysql_delete``);
    #: ``"orm"``, the ORM's delete of the batch.
    purge_batch: str = "orm"
    #: The statement that gives the records table's size on disk with its indexes (one
    #: parameter: the quoted table name), or ``None`` where the figure is not known.
    table_bytes_sql: str | None = None
    #: The distinct operations are read by hopping through the index from one name to the
    #: next (a recursive query), not by reading every index entry.
    loose_index_scan: bool = False
    #: What a plain read appends to see the newest committed row where the transaction's
    #: snapshot may be older (MariaDB's ``REPEATABLE READ``): ``enqueue_once`` reading the
    #: key's holder after the unique constraint refused its insert.
    fresh_read: str = ""
    #: What a read appends to see the newest committed row whatever the isolation level
    #: (a shared row lock; under ``REPEATABLE READ`` on PostgreSQL, a serialization failure
    #: when the row changed after the snapshot): ``enqueue_once`` deciding, under the key's
    #: row lock, that the key's holder is no longer live.
    newest_read: str = ""
    #: ``enqueue_once`` writes its key and its message in one statement
    #: (``INSERT ... ON CONFLICT DO NOTHING``); otherwise both inserts in a savepoint,
    #: rolled back when the unique constraint refuses the key.
    insert_on_conflict: bool = False
    #: The relay can wait for a notification (``LISTEN``) instead of polling, and
    #: ``enqueue`` sends one on commit (``notify_sql``, one parameter: the channel).
    notify_sql: str | None = None

    # -- checks ----------------------------------------------------------------------------

    #: The database is the file its ``NAME`` names: two aliases reach the same database
    #: exactly when their names are equal (E051).
    single_file: bool = False
    #: The statement that names the database and the server an alias reaches, to tell
    #: whether two aliases reach the same one (E051), or ``None``. Its first two columns
    #: name the database and the server; a third, where the vendor has one, the schema in
    #: which the connection finds the record table (``%(table)s``, its name).
    identity_sql: str | None = None
    #: The statement that gives ``synchronous_standby_names``, ``synchronous_commit``, the
    #: number of streaming standbys and how many of them are asynchronous, for W020 (a claim
    #: that a failover may lose), or
    #: ``None`` where the database has no such replication to ask about.
    replication_sql: str | None = None
    #: The statement that gives the largest statement the session accepts, in bytes, for
    #: :meth:`statement_limit` and W040, or ``None`` where one value may take a gigabyte.
    packet_limit_sql: str | None = None
