"""The code of docs/tasks.md runs as shown: example_project/docs_examples/tasks_framework.py."""

from __future__ import annotations

from typing import Any, cast

import pytest
from django.conf import settings

if not settings.HAS_DJANGO_TASKS:  # tests/settings.py: django-tasks-db and a Tasks framework
    pytest.skip(
        "Django's Tasks framework (Django 6, or the django-tasks backport) with django-tasks-db "
        "is not installed",
        allow_module_level=True,
    )
pytest.importorskip(
    "example_project", reason="the example project is not here (tox tests the wheel)"
)

from django.core import mail
from django.db import transaction
from django.utils import timezone
from django_tasks_db.models import DBTaskResult

from django_idempotency import outbox
from django_idempotency.models import OutboxMessage, OutboxStatus
from example_project.docs_examples import tasks_framework as shown
from tests.helpers import work_tasks

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def test_the_settings_shown_are_the_tests_settings() -> None:
    configured = cast(dict[str, dict[str, Any]], settings.TASKS)
    assert shown.TASKS["default"] == configured["default"]
    assert shown.TASKS["worker"] == {"BACKEND": configured["worker"]["BACKEND"]}
    assert set(shown.INSTALLED_APPS[-2:]) <= set(settings.INSTALLED_APPS)
    assert "django_tasks_db" in settings.INSTALLED_APPS


def test_a_sign_up_mails_its_welcome_once_however_often_it_is_delivered() -> None:
    def failed_sign_up() -> Any:
        with transaction.atomic():
            shown.sign_up("ghost", "ghost@example.com")
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        failed_sign_up()
    user, message_id = shown.sign_up("ada", "ada@example.com")
    assert str(OutboxMessage.objects.get().id) == message_id
    for _ in range(2):  # delivered twice
        outbox.relay(once=True)
        work_tasks("docs")
        OutboxMessage.objects.update(status=OutboxStatus.PENDING, available_at=timezone.now())
    assert DBTaskResult.objects.count() == 2
    assert [m.to for m in mail.outbox] == [[user.email]]
    assert {row.return_value for row in DBTaskResult.objects.all()} == {"ada@example.com"}


def test_the_example_projects_receipt_goes_through_django_tasks_once() -> None:
    pytest.importorskip("rest_framework", reason="the example project needs DRF")
    from django.contrib.auth.models import User

    from example_project.payments.models import Charge
    from example_project.payments.receipts import mail_receipt

    user = User.objects.create_user("grace", "grace@example.com")
    with transaction.atomic():
        charge = Charge.objects.create(
            user=user, amount=1000, currency="EUR", provider_charge_id="ch_1"
        )
        result = mail_receipt.enqueue(charge.pk)
    assert str(OutboxMessage.objects.get().id) == result.id
    for _ in range(2):  # delivered twice
        outbox.relay(once=True)
        work_tasks("docs")
        OutboxMessage.objects.update(status=OutboxStatus.PENDING, available_at=timezone.now())
    assert [m.to for m in mail.outbox] == [["grace@example.com"]]
    assert "1000 EUR" in mail.outbox[0].subject
