from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection
from django.test import override_settings

from django_idempotency.checks import check_settings


def ids(**idempotency):
    with override_settings(IDEMPOTENCY=idempotency):
        return [message.id for message in check_settings()]


def test_defaults_pass():
    assert ids() == []


def test_e001_not_a_dict():
    with override_settings(IDEMPOTENCY=["TTL"]):
        assert [m.id for m in check_settings()] == ["django_idempotency.E001"]


def test_e002_unknown_key():
    assert ids(TTLL=5) == ["django_idempotency.E002"]


@pytest.mark.parametrize("value", [0, -1, "1h", None, True])
def test_e003_durations(value):
    assert "django_idempotency.E003" in ids(TTL=value)
    assert "django_idempotency.E003" in ids(LEASE=value)


def test_e003_wait_may_be_zero_but_not_negative():
    assert ids(IN_PROGRESS_WAIT=0) == []
    assert ids(IN_PROGRESS_WAIT=-1) == ["django_idempotency.E003"]


def test_e004_ttl_must_outlive_the_lease():
    assert ids(TTL=60, LEASE=timedelta(minutes=1)) == ["django_idempotency.E004"]


@pytest.mark.parametrize("header", ["", "Idempotency Key", "Key:", 5])
def test_e005_header(header):
    assert ids(HEADER=header) == ["django_idempotency.E005"]


def test_e006_safe_methods():
    assert ids(METHODS=["POST", "get"]) == ["django_idempotency.E006"]
    assert ids(METHODS=["POST", "PUT", "DELETE"]) == []


def test_e007_unknown_database():
    assert ids(DATABASE="nope") == ["django_idempotency.E007"]


@pytest.mark.parametrize("name", ["ACCOUNT_RESOLVER", "FINGERPRINT", "RECOVERY"])
def test_e008_callables(name):
    assert ids(**{name: "no.such.module.function"}) == ["django_idempotency.E008"]
    assert ids(**{name: "django_idempotency.conf.DEFAULTS"}) == ["django_idempotency.E008"]
    assert ids(**{name: lambda request: None}) == []


def test_e008_recovery_names():
    assert ids(RECOVERY="retry") == []
    assert ids(RECOVERY="fail") == []


def test_e009_never_stored_headers():
    assert ids(REPLAY_HEADERS=["X-Trace", "Set-Cookie"]) == ["django_idempotency.E009"]
    assert ids(REPLAY_HEADERS=["X-Trace"]) == []


@pytest.mark.parametrize(
    "entry",
    [
        {"MAX_RESPONSE_BYTES": 0},
        {"MAX_RESPONSE_BYTES": "1MB"},
        {"PURGE_BATCH_SIZE": 0},
        {"RETRY_AFTER": -1},
        {"TRANSIENT_STATUSES": [503]},
    ],
)
def test_e010_numbers(entry):
    assert ids(**entry) == ["django_idempotency.E010"]


def test_e010_no_body_limit_is_allowed():
    assert ids(MAX_RESPONSE_BYTES=None) == []


def test_e011_wait_shorter_than_lease():
    assert ids(IN_PROGRESS_WAIT=60) == ["django_idempotency.E011"]


def test_w001_atomic_requests():
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        messages = check_settings()
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert [m.id for m in messages] == ["django_idempotency.W001"]
    assert "non_atomic_requests" in messages[0].hint


def test_w002_other_database():
    assert ids(DATABASE="provider") == ["django_idempotency.W002"]


class WritesTo:
    """A database router sending every write to one alias."""

    alias = "provider"

    def db_for_write(self, model, **hints):
        return self.alias


class WritesToDefault(WritesTo):
    alias = "default"


class Unanswering:
    def db_for_write(self, model, **hints):
        raise RuntimeError("needs the request")


def test_w010_a_router_that_raises_does_not_break_the_check():
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.Unanswering"]):
        assert check_settings() == []


def test_w010_routers_send_writes_elsewhere():
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.WritesTo"]):
        messages = check_settings()
    assert [m.id for m in messages] == ["django_idempotency.W010"]
    assert "'provider'" in messages[0].msg


def test_w010_routers_send_writes_to_the_idempotency_database():
    # DATABASE is not 'default', but it is where the routers send the writes: no warning.
    with override_settings(
        DATABASE_ROUTERS=[f"{__name__}.WritesTo"], IDEMPOTENCY={"DATABASE": "provider"}
    ):
        assert check_settings() == []


def test_w010_routers_that_keep_writes_on_default():
    with override_settings(
        DATABASE_ROUTERS=[f"{__name__}.WritesToDefault"], IDEMPOTENCY={"DATABASE": "provider"}
    ):
        assert [m.id for m in check_settings()] == ["django_idempotency.W010"]


def test_check_command_passes_with_defaults():
    call_command("check")


def test_check_command_fails_on_an_error():
    with override_settings(IDEMPOTENCY={"TTL": 0}), pytest.raises(SystemCheckError):
        call_command("check")


def test_settings_are_read_at_call_time():
    from django_idempotency import conf

    assert conf.ttl() == timedelta(hours=24)
    with override_settings(IDEMPOTENCY={"TTL": 3600}):
        assert conf.ttl() == timedelta(hours=1)
    assert conf.ttl() == timedelta(hours=24)
