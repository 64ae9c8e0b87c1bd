"""``manage.py ensure_demo_user``: create the demo superuser, or reset it; safe to rerun."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = (
        "Create the demo user, a superuser so the admin shows the idempotency records, or "
        "reset its password. Running it again changes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo")
        parser.add_argument("--email", default="demo@example.com", help="receipts go there")

    def handle(self, *args: Any, **options: Any) -> None:
        user, created = get_user_model().objects.get_or_create(username=options["username"])
        up_to_date = (
            user.is_superuser
            and user.email == options["email"]
            and user.check_password(options["password"])
        )
        if not up_to_date:
            user.set_password(options["password"])
            user.email = options["email"]
            user.is_staff = user.is_superuser = True
            user.save(update_fields=["password", "email", "is_staff", "is_superuser"])
        if options["verbosity"] >= 1:
            state = "created" if created else "already there"
            self.stdout.write(f"Demo user {user.get_username()!r}: {state}.")
