"""How a waiting outbox relay wakes up: a ``NOTIFY`` on PostgreSQL, polling as the floor.

:func:`django_idempotency.outbox.enqueue` notifies :data:`CHANNEL` in the writer's
transaction, so the notification fires at the commit; the relay waits on :func:`listener`
between drains. A lost notification costs at most one poll interval.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from django_idempotency._vendors import of

logger = logging.getLogger("django_idempotency")

# The PostgreSQL channel that enqueue() notifies and a waiting relay listens on.
CHANNEL = "django_idempotency_outbox"

# A waiting relay looks at its stop flag at least this often, in seconds.
STOP_CHECK_SECONDS = 0.2

Stop = Callable[[], bool]
Wait = Callable[[float, Stop], None]


@contextlib.contextmanager
def listener(alias: str, listen: bool) -> Iterator[Wait]:
    """A wait that a ``NOTIFY`` cuts short, on a dedicated connection (PostgreSQL); a plain
    :func:`sleep` elsewhere or without ``listen``."""
    if not listen or of(alias).notify_sql is None:
        yield sleep
        return
    listener = Listener(alias)
    try:
        yield listener.wait
    finally:
        listener.close()


def sleep(seconds: float, stop: Stop) -> None:
    """Sleep ``seconds``, or less once ``stop()`` answers true (asked every 0.2 s)."""
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, STOP_CHECK_SECONDS))


class Listener:
    """``LISTEN`` on a connection of its own (psycopg 3), opened again after a failure.

    The Django connection cannot listen: it may sit in a transaction, and notifications are
    delivered between transactions only. Whatever goes wrong here, the relay falls back to
    polling, so a lost notification costs at most one poll interval.
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.connection: Any = None

    def _connect(self) -> Any:
        if self.connection is not None:
            return self.connection
        try:
            import psycopg
        except ImportError:
            return None
        django_connection = connections[self.alias]
        try:
            params = django_connection.get_connection_params()
            params.pop("cursor_factory", None)
            self.connection = psycopg.connect(**params, autocommit=True)
            self.connection.execute(f"LISTEN {CHANNEL}")
        except (psycopg.Error, TypeError) as exc:
            logger.warning("the outbox relay cannot listen (%s); polling only", exc)
            self.close()
        return self.connection

    def wait(self, seconds: float, stop: Stop) -> None:
        """Wait ``seconds`` at most: a ``NOTIFY`` or ``stop()`` ends the wait sooner."""
        connection = self._connect()
        if connection is None:
            sleep(seconds, stop)
            return
        import psycopg

        deadline = time.monotonic() + seconds
        try:
            while not stop():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                # One notification is enough: the drain that follows reads everything due.
                wait = min(left, STOP_CHECK_SECONDS)
                for _notify in connection.notifies(timeout=wait, stop_after=1):
                    return
        except psycopg.Error as exc:
            logger.warning("the outbox relay lost its listening connection: %s", exc)
            self.close()

    def close(self) -> None:
        """Close the listening connection; the next wait opens another."""
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.close()
        self.connection = None
