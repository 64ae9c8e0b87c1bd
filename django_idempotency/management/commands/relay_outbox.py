"""``manage.py relay_outbox``: send the outbox's messages, until stopped or once."""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency import outbox
from django_idempotency.management.commands.purge_idempotency import (
    database_alias,
    positive_int,
    run_job,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM or SIGINT while the block runs (main thread only)."""
    stopping = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopping
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield stopping
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Command(BaseCommand):
    """A thin wrapper around :func:`django_idempotency.outbox.relay`."""

    help = (
        "Send the outbox's messages with OUTBOX_SENDER. Runs until SIGTERM or SIGINT (the "
        "batch in hand is finished first); --once drains what is due and exits."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="Drain what is due now, then exit.")
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="Messages per batch (one transaction each). Default: OUTBOX_BATCH_SIZE.",
        )
        parser.add_argument(
            "--database",
            default=None,
            help="The database alias of the outbox. Default: IDEMPOTENCY['DATABASE'].",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            # A wrong setting (the sender's or any other) is a command error, like a wrong option.
            alias = database_alias(options)
            sender = outbox.configured_sender()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        # -v 2: a line per message, once its batch committed.
        report = self.report if int(options["verbosity"]) >= 2 else None
        with stop_on_signals() as stopping:
            result = run_job(
                "relay",
                outbox.relay,
                using=alias,
                batch_size=options["batch_size"],
                once=options["once"],
                stop=stopping.is_set,
                sender=sender,
                report=report,
            )
        if int(options["verbosity"]) >= 1:
            self.stdout.write(self.summary(result))

    def report(self, message_id: uuid.UUID, task: str, outcome: str, error: str) -> None:
        """One message's line: ``sent <id> <task>``, or ``failed``/``dead`` with the error."""
        line = f"{outcome} {message_id} {task}"
        if error:
            line += f": {error}"
        style = self.style.SUCCESS if outcome == "sent" else self.style.WARNING
        self.stdout.write(style(line))
        self.stdout.flush()

    @staticmethod
    def summary(result: outbox.RelayResult) -> str:
        """The final line: sent, failed (retried later) and dead messages, and the unexpected
        errors the relay went on after (logged), if any."""
        line = (
            f"Sent {result.sent} outbox messages; {result.failed} failed (to be retried), "
            f"{result.dead} dead"
        )
        if result.errors:
            line += f"; {result.errors} error{'' if result.errors == 1 else 's'}"
        return line + "."
