"""``manage.py rotate_idempotency_encryption``: seal every stored response with the first key."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency import crypto, maintenance
from django_idempotency.management.commands.purge_idempotency import (
    add_common_arguments,
    database_alias,
    positive_int,
    run_job,
)


class Command(BaseCommand):
    """A thin wrapper around :func:`django_idempotency.maintenance.rotate_encryption`."""

    help = (
        "Seal every stored idempotency response (records and audit records) and every "
        "recorded step result with the first key of IDEMPOTENCY['ENCRYPTION_KEYS']: those in "
        "the clear and those sealed with an older key, in bounded batches beside live traffic."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help=(
                "Rows per batch (one short transaction each, holding at most this many bodies "
                f"in memory). Default: {crypto.ROTATE_BATCH_SIZE}."
            ),
        )
        add_common_arguments(parser, "Count what would be sealed; change nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        alias = database_alias(options)
        verbosity = int(options["verbosity"])

        def progress(batches: int, sealed: int) -> None:
            if verbosity >= 2:
                self.stdout.write(f"batch {batches}: {sealed} responses sealed so far")

        try:
            result = run_job(
                "rotation",
                maintenance.rotate_encryption,
                using=alias,
                batch_size=options["batch_size"],
                dry_run=options["dry_run"],
                progress=progress,
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if verbosity >= 1:
            self.stdout.write(self.summary(result))

    @staticmethod
    def summary(result: crypto.RotationResult) -> str:
        """The final line: what was (or would be) sealed, and what was left as it was."""
        verb = "Would seal" if result.dry_run else "Sealed"
        line = (
            f"{verb} {result.records} idempotency records and {result.audit_records} audit "
            f"records with key {result.key_id}"
        )
        line += "." if result.dry_run else f" in {result.batches} batches."
        line += f" {verb} {result.steps} step results with it."
        line += f" {result.current} were sealed with it already."
        if result.unreadable:
            line += (
                f" {result.unreadable} are sealed with a key ENCRYPTION_KEYS no longer holds:"
                " they cannot be read, and were left as they are."
            )
        if result.changed:
            line += f" {result.changed} changed meanwhile and were left to that change."
        if result.in_use:
            line += (
                f" {result.in_use} were in use by another transaction and left as they are:"
                " run it again."
            )
        if result.too_large:
            line += (
                f" {result.too_large} would be larger sealed than one statement the database"
                " takes (max_allowed_packet): they were left in the clear."
            )
        if not result.dry_run:
            line += f" Longest batch: {result.longest_batch_seconds:.3f} s."
        return line
