from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings


@pytest.mark.django_db
@pytest.mark.parametrize(
    "auto_field", ["django.db.models.AutoField", "django.db.models.BigAutoField"]
)
def test_no_missing_migrations(auto_field):
    out = StringIO()
    with override_settings(DEFAULT_AUTO_FIELD=auto_field):
        call_command("makemigrations", "django_idempotency", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
