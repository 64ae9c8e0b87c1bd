"""``manage.py idempotency_audit``: every endpoint that takes an unsafe method, protected or
not, and how (see :mod:`django_idempotency._endpoints`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency import _check_ids, _stats
from django_idempotency._endpoints import Audit, Endpoint, audit, duration, url_prefix
from django_idempotency.management.commands.purge_idempotency import run_job

COLUMNS = ("METHOD", "URL", "PROTECTED", "BY", "OPERATION", "RECOVERY", "TTL", "KEY", "VIEW")


def _cells(endpoint: Endpoint) -> tuple[str, ...]:
    return (
        endpoint.method,
        endpoint.url,
        "yes" if endpoint.protected else "NO",
        endpoint.by or "-",
        endpoint.operation or "-",
        endpoint.recovery or "-",
        duration(endpoint.ttl) if endpoint.ttl is not None else "-",
        endpoint.key or "-",
        endpoint.view,
    )


def _prefix(text: str) -> str:
    # An argparse type: the message of the refusal, not argparse's "invalid value".
    try:
        return url_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _named(endpoints: list[Endpoint]) -> str:
    return ", ".join(f"{e.method} {e.url}" for e in endpoints)


def table(found: Audit) -> str:
    """The text report: one aligned row per endpoint, then a summary."""
    lines = []
    if found.endpoints:
        rows = [COLUMNS, *(_cells(e) for e in found.endpoints)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        lines.append("")
    unprotected = len(found.unprotected)
    total = len(found.endpoints)
    lines.append(
        f"{total} endpoint{'s' if total != 1 else ''} with unsafe methods: "
        f"{total - unprotected} protected, {unprotected} unprotected."
    )
    for operation, endpoints in found.shared.items():
        lines.append(
            f"Shared operation {operation}: {_named(endpoints)}. A key sent to one replays "
            "another's outcome: give all but one an operation of its own (check "
            f"{_check_ids.error('OPERATION_SHARED')})."
        )
    if found.left_out:
        lines.append(f"Left out: {'; '.join(found.left_out)}.")
    if found.excluded:
        lines.append(
            f"{found.excluded} pattern{'s' if found.excluded != 1 else ''} left out by --exclude."
        )
    return "\n".join(lines)


def _unique_keys() -> list[dict[str, Any]]:
    # A database that cannot be read is status 1 with its message, as for the stats.
    keys: list[dict[str, Any]] = run_job("the list of unique keys", _stats.unique_keys, limit=None)
    return keys


class Command(BaseCommand):
    help = (
        "List every URL pattern whose view takes POST or PATCH (or another method it "
        "protects): whether it is idempotent, by what, its operation, recovery policy, TTL "
        "and key source."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--fail-on-unprotected",
            action="store_true",
            help="Exit with status 1 when an unprotected endpoint is listed (for CI).",
        )
        parser.add_argument(
            "--format",
            choices=("text", "json"),
            default="text",
            help="A table (default) or one JSON object.",
        )
        parser.add_argument(
            "--unique-keys",
            action="store_true",
            help="Also list the keys of enqueue_once, each with the message that holds it.",
        )
        parser.add_argument(
            "--exclude",
            action="append",
            default=[],
            type=_prefix,
            metavar="PREFIX",
            help="Leave out the patterns under this URL prefix, e.g. api-auth/ (repeatable).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            found = audit(exclude=options["exclude"])
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if options["format"] == "json":
            data = {
                "endpoints": [e.as_dict() for e in found.endpoints],
                "protected": len(found.endpoints) - len(found.unprotected),
                "unprotected": len(found.unprotected),
                "left_out": list(found.left_out),
                "excluded": found.excluded,
                "shared_operations": [
                    {"operation": operation, "endpoints": [f"{e.method} {e.url}" for e in shared]}
                    for operation, shared in found.shared.items()
                ],
            }
            if options["unique_keys"]:
                data["unique_keys"] = _unique_keys()
            self.stdout.write(json.dumps(data, indent=2))
        elif options["verbosity"] >= 1:
            self.stdout.write(table(found))
            if options["unique_keys"]:
                self.stdout.write("")
                self.stdout.write("Keys of enqueue_once, each with the message that holds it:")
                self.stdout.write("\n".join(_stats.unique_key_lines(_unique_keys())))
        if options["fail_on_unprotected"] and (found.unprotected or found.shared):
            # An endpoint whose operation another one shares never runs its own view.
            problems = []
            if found.unprotected:
                problems.append(
                    f"{len(found.unprotected)} unprotected: {_named(found.unprotected)}"
                )
            if found.shared:
                count = len(found.shared)
                problems.append(
                    f"{count} operation{'s' if count != 1 else ''} shared by several "
                    "endpoints: "
                    + "; ".join(f"{op} by {_named(e)}" for op, e in found.shared.items())
                )
            raise CommandError("; ".join(problems), returncode=1)
