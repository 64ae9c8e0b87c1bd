"""``manage.py send_statements --month 2026-11``: one statement per customer and month,
safe to run twice.

Each customer's statement is sent under ``run_once``, keyed by the month and the customer:
a second run, or a rerun after a crash halfway, sends only what is not sent yet. The
e-mail is sent inside the customer's transaction, so a crash between the send and the
commit sends it again on the next run ("retry", the default recovery); use
``recovery="fail"`` where a second e-mail is worse than none.
"""

from __future__ import annotations

import re
from typing import Any

from django.contrib.auth import get_user_model
from django.core.mail import send_mail
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Sum

from django_idempotency import IdempotencyError, run_once
from example_project.payments.models import Charge
from example_project.recipes.models import Statement

MONTH = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")


def send_statement(user_id: int, month: str) -> dict[str, Any]:
    """Total the customer's charges of ``month``, mail it and record the statement."""
    user = get_user_model().objects.get(pk=user_id)
    year, number = month.split("-")
    total = (
        Charge.objects.filter(
            user_id=user_id, created_at__year=int(year), created_at__month=int(number)
        ).aggregate(total=Sum("amount"))["total"]
        or 0
    )
    send_mail(
        f"Your statement for {month}",
        f"Charges in {month}: {total} (minor units).",
        None,
        [user.email or f"{user.get_username()}@example.com"],
    )
    statement = Statement.objects.create(user_id=user_id, month=month, charges_total=total)
    return {"statement": statement.pk, "total": total}


class Command(BaseCommand):
    help = "Send every customer their statement for one month; running it again sends none twice."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--month", required=True, help="YYYY-MM")

    def handle(self, *args: Any, **options: Any) -> None:
        month: str = options["month"]
        if not MONTH.match(month):
            raise CommandError(f"--month must be YYYY-MM, not {month!r}")
        sent = already = failed = 0
        for user_id in get_user_model().objects.order_by("pk").values_list("pk", flat=True):
            ran = False

            def send(user_id: int = user_id) -> dict[str, Any]:
                nonlocal ran
                ran = True
                return send_statement(user_id, month)

            try:
                run_once(
                    send,
                    account="command:send_statements",
                    operation="statements.send",
                    key=f"{month}:{user_id}",
                )
            except IdempotencyError as exc:  # another run is on it, or it needs a person
                failed += 1
                self.stderr.write(f"customer {user_id}: {exc}")
                continue
            if ran:
                sent += 1
            else:
                already += 1
        if options["verbosity"] >= 1:
            self.stdout.write(f"{month}: {sent} sent, {already} already sent, {failed} not sent")
        if failed:
            raise CommandError(f"{failed} statements were not sent; run the command again")
