"""The code of docs/unique-tasks.md ("One live task per key"), run by tests/test_docs_unique.py."""

from __future__ import annotations

import uuid
from datetime import timedelta

from celery import shared_task
from django.db import transaction

from django_idempotency.tasks import idempotent_task


# --8<-- [start:periodic-task]
@shared_task(acks_late=True)
@idempotent_task(lease=15 * 60)  # longer than a run ever takes
def rebuild_search_index() -> int:
    """Takes a few minutes; beat (or cron) asks for it every minute."""
    return 0
    # --8<-- [end:periodic-task]


# --8<-- [start:periodic-enqueue]
from django_idempotency.outbox import enqueue_once


@shared_task
def every_minute() -> str:
    """Beat's entry: at most one rebuild waiting or running, whatever beat does."""
    with transaction.atomic():
        message_id = enqueue_once("search-index", rebuild_search_index)
    return str(message_id)  # the new message's id, or the one still live
    # --8<-- [end:periodic-enqueue]


@shared_task
@idempotent_task()
def export_report(account_id: int) -> None:
    """A report a user asks for with a button."""


# --8<-- [start:user-triggered]
from django_idempotency import TaskAlreadyQueued


def request_export(account_id: int) -> tuple[uuid.UUID, bool]:
    """A second click while the first export waits is told so; once it has started, a
    new export may be queued behind it."""
    try:
        with transaction.atomic():
            message_id = enqueue_once(
                f"export:{account_id}",
                export_report,
                account_id,
                unique_until="started",
                on_conflict="raise",
            )
    except TaskAlreadyQueued as already:
        return already.message_id, False
    return message_id, True
    # --8<-- [end:user-triggered]


@shared_task
def send_digest(user_id: int) -> None:
    """Mails a digest; not under @idempotent_task: a duration needs no record of its runs."""


# --8<-- [start:duration]
def digest_soon(user_id: int) -> uuid.UUID:
    """At most one digest per user every ten minutes, whatever became of the last one."""
    with transaction.atomic():
        return enqueue_once(
            f"digest:{user_id}", send_digest, user_id, unique_until=timedelta(minutes=10)
        )
    # --8<-- [end:duration]
