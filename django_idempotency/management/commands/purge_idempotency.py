"""``manage.py purge_idempotency``: expired records, old audit records and sent outbox messages."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from django.utils.connection import ConnectionDoesNotExist

from django_idempotency import maintenance
from django_idempotency._validation import MAX_INT
from django_idempotency.conf import app_settings

T = TypeVar("T")


def positive_int(value: str) -> int:
    """An argparse type: a whole number from 1 to ``MAX_INT``, as the settings of batch
    sizes and limits admit (every database's ``LIMIT`` takes it)."""
    number = int(value)
    if not 1 <= number <= MAX_INT:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer up to {MAX_INT}")
    return number


def count_or_zero(value: str) -> int:
    """An argparse type: a whole number from 0 to ``MAX_INT`` (0: none)."""
    number = int(value)
    if not 0 <= number <= MAX_INT:
        raise argparse.ArgumentTypeError(f"{value} is not a whole number from 0 to {MAX_INT}")
    return number


def database_alias(options: dict[str, Any]) -> str:
    """The alias ``--database`` names, ``IDEMPOTENCY['DATABASE']`` when it is not given.

    An alias that ``DATABASES`` does not hold is a ``CommandError`` before anything runs,
    the empty one too: ``--database "$ALIAS"`` with the variable unset names no database,
    and must not fall back on the default one (and purge it)."""
    alias = options["database"]
    if alias is None:
        return app_settings.DATABASE
    if alias not in settings.DATABASES:
        raise CommandError(f"Unknown database {alias!r}.")
    return str(alias)


def add_common_arguments(parser: CommandParser, dry_run_help: str) -> None:
    """``--dry-run`` and ``--database``, shared by the maintenance commands."""
    parser.add_argument("--dry-run", action="store_true", help=dry_run_help)
    parser.add_argument(
        "--database",
        default=None,
        help="The database alias of the records. Default: IDEMPOTENCY['DATABASE'].",
    )


def run_job(what: str, job: Callable[..., T], **kwargs: Any) -> T:
    """Run a maintenance job; a database failure becomes a ``CommandError`` (exit status 1)."""
    try:
        return job(**kwargs)
    except (DatabaseError, ConnectionDoesNotExist) as exc:
        raise CommandError(f"{what} failed: {exc}") from exc


class Command(BaseCommand):
    """A thin wrapper around :func:`django_idempotency.maintenance.purge_expired`."""

    help = (
        "Delete expired idempotency records, and audit records past their retention, in "
        "bounded batches that never block live requests for long."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="Rows per batch (one short transaction each). Default: PURGE_BATCH_SIZE.",
        )
        parser.add_argument(
            "--max-batches",
            type=positive_int,
            default=None,
            help="Stop each table after this many batches. Default: PURGE_MAX_BATCHES.",
        )
        add_common_arguments(parser, "Count what would be deleted; delete nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        verbosity = int(options["verbosity"])
        bounds = {
            "using": database_alias(options),
            "batch_size": options["batch_size"],
            "max_batches": options["max_batches"],
        }
        total = 0
        if verbosity >= 2 and not options["dry_run"]:
            # What the run will delete, counted first (one count per table), so that each
            # batch's line says how far along it is. Rows that expire meanwhile come on top.
            counted = run_job("purge", maintenance.purge_expired, dry_run=True, **bounds)
            total = counted.deleted + counted.audit_deleted + counted.outbox_deleted
            self.stdout.write(f"{total} rows to delete")

        def progress(batches: int, rows: int) -> None:
            if verbosity >= 2:
                self.stdout.write(f"batch {batches}: {rows} of {max(total, rows)} rows deleted")

        result = run_job(
            "purge",
            maintenance.purge_expired,
            dry_run=options["dry_run"],
            progress=progress,
            **bounds,
        )
        if verbosity >= 1:
            self.stdout.write(self.summary(result))

    @staticmethod
    def summary(result: maintenance.PurgeResult) -> str:
        """The final line: what was (or would be) deleted."""
        verb = "Would purge" if result.dry_run else "Purged"
        line = (
            f"{verb} {result.deleted} expired idempotency records in {result.batches} batches"
            f" and {result.audit_deleted} audit records in {result.audit_batches} batches."
        )
        if result.outbox_deleted:
            line += (
                f" {result.outbox_deleted} sent outbox messages in {result.outbox_batches} batches."
            )
        if result.archived:
            line += f" {result.archived} records were copied to the audit trail first."
        if not result.dry_run:
            line += f" Longest batch: {result.longest_batch_seconds:.3f} s."
        if not result.complete:
            line += " More remain: --max-batches stopped the run."
        return line
