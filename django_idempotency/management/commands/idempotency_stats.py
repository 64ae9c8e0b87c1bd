"""``manage.py idempotency_stats``: how big the records table is and how healthy."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import TextChoices

from django_idempotency import _stats
from django_idempotency.management.commands.purge_idempotency import (
    count_or_zero,
    database_alias,
    run_job,
)
from django_idempotency.models import OutboxStatus, RecordStatus


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{seconds:.1f} s"


def _label(labels: type[TextChoices], status: str) -> str:
    # A status this release does not know (a newer release's, a hand edit) is named as
    # stored: the figures of a damaged table are what the command is run for.
    if status in labels.values:
        return str(labels(status).label)
    return f"{status} (unknown status)"


def _counts(labels: type[TextChoices], counts: dict[str, int]) -> list[tuple[str, str]]:
    # One indented line per status, under the heading before it.
    return [(f"  {_label(labels, status)}", f"{n:,}") for status, n in counts.items()]


class Command(BaseCommand):
    help = (
        "Show the size of the idempotency records table, records by status, the oldest "
        "in-progress record, stale leases, expired records not yet purged, the records "
        "whose outcome no key of ENCRYPTION_KEYS opens, the resumable "
        "records (recovery policy resume), and the outbox."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default=None,
            help="Database alias to inspect (default: IDEMPOTENCY['DATABASE'], or 'default').",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")
        parser.add_argument(
            "--unique-keys",
            type=count_or_zero,
            default=20,
            metavar="N",
            help="List the N newest keys of enqueue_once with the message holding each "
            "(default 20; 0 for none).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias = database_alias(options)
        # A database that cannot be read (down, not migrated) is status 1 with its message.
        snapshot = run_job("statistics", _stats.collect, using=alias)
        messages = run_job("statistics", _stats.outbox, using=alias, now=snapshot.taken_at)
        keys = run_job(
            "statistics",
            _stats.unique_keys,
            using=alias,
            limit=options["unique_keys"],
            now=snapshot.taken_at,
        )
        if options["json"]:
            data = {**snapshot.as_dict(), "outbox": messages.as_dict(), "unique_keys": keys}
            self.stdout.write(json.dumps(data, indent=2))
            return
        rows = [
            ("database", alias),
            ("rows", f"{snapshot.rows:,}"),
            (
                "table size",
                _size(snapshot.table_bytes) if snapshot.table_bytes is not None else "n/a",
            ),
        ]
        rows += _counts(RecordStatus, snapshot.by_status)
        rows += [
            ("oldest in progress", _duration(snapshot.oldest_in_progress_seconds)),
            ("stale leases", f"{snapshot.stale_leases:,}"),
            ("expired, not purged", f"{snapshot.expired:,}"),
            ("unreadable", f"{snapshot.unreadable:,}"),
            *[
                (f"  sealed with key {kid}", f"{n:,}")
                for kid, n in sorted(snapshot.unreadable_by_key.items())
            ],
            ("unreadable step results", f"{snapshot.unreadable_steps:,}"),
            *[
                (f"  sealed with key {kid}", f"{n:,}")
                for kid, n in sorted(snapshot.unreadable_steps_by_key.items())
            ],
            ("resumable", ""),
            *_counts(RecordStatus, snapshot.resumable),
            ("  stale leases", f"{snapshot.resumable_stale:,}"),
            ("outbox", ""),
            *_counts(OutboxStatus, messages.by_status),
        ]
        rows += [
            ("  due now", f"{messages.due:,}"),
            ("  oldest pending", _duration(messages.oldest_pending_seconds)),
        ]
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            self.stdout.write(f"{label.ljust(width)}  {value}")
        if keys:
            self.stdout.write("")
            self.stdout.write("unique keys (newest first): which message holds each")
            for line in _stats.unique_key_lines(keys):
                self.stdout.write(f"  {line}")
