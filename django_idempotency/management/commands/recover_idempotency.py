"""``manage.py recover_idempotency``: apply the recovery policy of every stale lease."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency import maintenance
from django_idempotency.management.commands.purge_idempotency import (
    add_common_arguments,
    database_alias,
    positive_int,
    run_job,
)


class Command(BaseCommand):
    """A thin wrapper around :func:`django_idempotency.maintenance.recover_stale_leases`."""

    help = (
        "Find in-progress idempotency records whose lease ran out and apply each one's "
        "recovery policy: retry (release), fail, or the configured callable. Resumable "
        "records (resume) are left to their next attempt, and counted."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_common_arguments(parser, "Count stale leases by policy; change nothing.")
        parser.add_argument(
            "--limit",
            type=positive_int,
            default=None,
            help="Handle at most this many records (resumable ones, left alone, are not counted).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        result = run_job(
            "recovery",
            maintenance.recover_stale_leases,
            using=database_alias(options),
            limit=options["limit"],
            dry_run=options["dry_run"],
        )
        verbosity = int(options["verbosity"])
        if verbosity >= 2:
            for policy, count in sorted(result.policies.items()):
                self.stdout.write(f"policy {policy}: {count} stale leases")
        if verbosity >= 1:
            self.stdout.write(self.summary(result))
        if result.errors:
            raise CommandError(f"{result.errors} stale leases could not be recovered; see the log.")

    @staticmethod
    def summary(result: maintenance.RecoveryResult) -> str:
        """The final line: what was (or would be) done."""
        # Resumable records are found but never recovered here: their next attempt resumes
        # them (it runs the body; a job has none to run).
        left = f"{result.resumable} resumable left to their next attempt"
        if result.dry_run:
            return f"Would recover {result.found - result.resumable} stale leases ({left})."
        return (
            f"Recovered {result.found - result.resumable} stale leases: {result.released} "
            f"released, {result.failed} failed, {result.completed} completed, "
            f"{result.skipped} changed meanwhile, {result.errors} errors; {left}."
        )
