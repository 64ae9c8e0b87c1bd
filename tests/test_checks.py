"""One test per system check id; the table over every setting is in test_settings.py."""

from __future__ import annotations

import sys
from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, connections
from django.test import override_settings

from django_idempotency.checks import check_outbox_sender, check_settings, check_tenant_apps


def messages(**idempotency):
    with override_settings(IDEMPOTENCY=idempotency):
        return check_settings()


def ids(**idempotency):
    return [message.id for message in messages(**idempotency)]


def only(expected: str, **idempotency) -> str:
    """The one message that ``idempotency`` gives: it has ``expected`` as its id."""
    found = messages(**idempotency)
    assert [m.id for m in found] == [f"django_idempotency.{expected}"], found
    return str(found[0].msg)


def test_defaults_pass():
    assert ids() == []


@pytest.mark.parametrize("value", [["TTL"], "TTL", None, 5])
def test_e001_not_a_dict(value):
    with override_settings(IDEMPOTENCY=value):
        assert [m.id for m in check_settings()] == ["django_idempotency.E001"]


def test_e002_unknown_key():
    message = messages(TTLL=5)[0]
    assert message.id == "django_idempotency.E002"
    assert "'TTLL'" in message.msg
    assert "TTL" in message.hint


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("TTLL", "TTL"), ("ttl", "TTL"), ("CLAIM_DATABSE", "CLAIM_DATABASE"), ("LEASES", "LEASE")],
)
def test_e002_a_typo_gets_the_key_it_is_closest_to(typo, meant):
    assert only("E002", **{typo: 5}).endswith(f"Did you mean {meant!r}?")


def test_e002_nothing_close_gets_no_guess():
    assert "Did you mean" not in only("E002", COLOUR="blue")


def test_e002_a_key_that_is_no_string_is_named_and_gets_no_guess():
    with override_settings(IDEMPOTENCY={7: "TTL"}):
        (message,) = check_settings()
    assert message.id == "django_idempotency.E002"
    assert "7" in message.msg
    assert "Did you mean" not in message.msg


def test_e003_ttl():
    assert "IDEMPOTENCY['TTL'] must be a timedelta" in only("E003", TTL=0)


def test_e004_ttl_must_outlive_the_lease():
    assert "longer than IDEMPOTENCY['LEASE']" in only("E004", TTL=60, LEASE=timedelta(minutes=1))


@pytest.mark.parametrize("header", ["", "Idempotency Key", "Key:", 5, None])
def test_e005_header(header):
    assert "IDEMPOTENCY['HEADER'] must be an HTTP header name" in only("E005", HEADER=header)


@pytest.mark.parametrize("header", ["X_Idempotency_Key", "Idempotency_Key"])
def test_w003_a_header_name_with_an_underscore_is_one_servers_drop(header):
    """runserver, gunicorn and nginx drop a request header whose name holds an underscore:
    the key would never reach the view (a 400 for every request, or, with keys optional,
    every request run unprotected)."""
    said = only("W003", HEADER=header)
    assert header in said
    assert "underscore" in said


def test_w003_not_for_a_header_name_with_hyphens():
    assert ids(HEADER="X-Idempotency-Key") == []


def test_e006_methods():
    assert "IDEMPOTENCY['METHODS']" in only("E006", METHODS="POST")
    assert "GET has no side effect" in only("E006", METHODS=["POST", "get"])
    assert ids(METHODS=["POST", "PUT", "DELETE"]) == []


def test_e007_database():
    aliases = ", ".join(sorted(connections))
    assert f"DATABASES ({aliases})" in only("E007", DATABASE="nope")


def test_e008_account_resolver():
    assert "cannot be imported" in only("E008", ACCOUNT_RESOLVER="no.such.module.function")
    assert ids(ACCOUNT_RESOLVER=lambda request: None) == []


def test_e009_replay_headers():
    assert "set-cookie is never stored" in only("E009", REPLAY_HEADERS=["X-Trace", "Set-Cookie"])
    assert ids(REPLAY_HEADERS=["X-Trace"]) == []


def test_e010_max_response_bytes():
    assert "IDEMPOTENCY['MAX_RESPONSE_BYTES']" in only("E010", MAX_RESPONSE_BYTES=0)
    assert ids(MAX_RESPONSE_BYTES=None) == []


def test_e011_wait_shorter_than_lease():
    assert "shorter than IDEMPOTENCY['LEASE']" in only("E011", IN_PROGRESS_WAIT=60)


def test_e012_required():
    assert "IDEMPOTENCY['REQUIRED'] must be True or False" in only("E012", REQUIRED="false")


def test_e013_lease():
    assert "IDEMPOTENCY['LEASE']" in only("E013", LEASE=timedelta(0))


def test_e014_in_progress_wait():
    assert "zero or more" in only("E014", IN_PROGRESS_WAIT=-1)
    assert ids(IN_PROGRESS_WAIT=0) == []


def test_e015_fingerprint():
    assert "IDEMPOTENCY['FINGERPRINT']" in only("E015", FINGERPRINT="no.such.module.function")


def test_e016_recovery():
    assert "IDEMPOTENCY['RECOVERY']" in only("E016", RECOVERY="retry_")
    assert ids(RECOVERY="retry") == ids(RECOVERY="fail") == []


def test_e017_transient_statuses():
    assert "IDEMPOTENCY['TRANSIENT_STATUSES']" in only("E017", TRANSIENT_STATUSES=409)
    assert "503 (int) is not a 4xx" in only("E017", TRANSIENT_STATUSES=[503])
    assert ids(TRANSIENT_STATUSES=[]) == []


def test_e018_retry_after():
    assert "at least 1" in only("E018", RETRY_AFTER=0)


def test_e020_audit():
    assert "IDEMPOTENCY['AUDIT'] must be True or False" in only("E020", AUDIT=1)


def test_e021_audit_retention():
    assert "IDEMPOTENCY['AUDIT_RETENTION']" in only("E021", AUDIT_RETENTION=-3600)


def test_e022_purge_max_batches():
    assert "or None" in only("E022", PURGE_MAX_BATCHES=0)


def test_e023_purge_batch_size():
    assert "IDEMPOTENCY['PURGE_BATCH_SIZE']" in only("E023", PURGE_BATCH_SIZE=None)


def test_e024_encryption_keys():
    assert "IDEMPOTENCY['ENCRYPTION_KEYS'] must be a list" in only("E024", ENCRYPTION_KEYS="k")


def test_e025_keys_without_cryptography(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography.fernet", None)
    key = "qBVrZ0nW2kkE7z5Q8y6Hn3m1uXc9d0T4aJfLsR2pVYo="
    assert "cryptography package cannot be imported" in only("E025", ENCRYPTION_KEYS=[key])


def test_atomic_requests_is_no_longer_a_warning():
    """W001 said that protected requests under ATOMIC_REQUESTS held two connections; they
    hold one now (tests/test_connections.py), so nothing is reported."""
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        found = check_settings()
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert found == []


def test_w002_other_database():
    assert ids(DATABASE="provider") == ["django_idempotency.W002"]


def test_every_wrong_entry_is_reported_at_once():
    found = ids(METHODS="POST", TRANSIENT_STATUSES=409, REPLAY_HEADERS=[1], TTL=None)
    assert sorted(found) == [
        "django_idempotency.E003",
        "django_idempotency.E006",
        "django_idempotency.E009",
        "django_idempotency.E017",
    ]


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


TENANT_APPS = ["django.contrib.contenttypes", "tests.testapp"]


@pytest.mark.parametrize(
    "app", ["django_idempotency", "django_idempotency.apps.DjangoIdempotencyConfig"]
)
def test_w030_records_in_the_shared_schema_only(app):
    with override_settings(SHARED_APPS=["django_tenants", app], TENANT_APPS=TENANT_APPS):
        found = check_tenant_apps()
    assert [m.id for m in found] == ["django_idempotency.W030"]
    assert "TENANT_APPS" in found[0].hint


@pytest.mark.parametrize(
    ("shared", "tenant"),
    [
        (["django_tenants"], [*TENANT_APPS, "django_idempotency"]),  # each tenant's own
        (["django_tenants", "django_idempotency"], [*TENANT_APPS, "django_idempotency"]),
        (["django_tenants"], TENANT_APPS),  # not installed under the tenants' apps at all
        (None, None),  # no schemas per tenant
    ],
)
def test_w030_not_reported_where_each_tenant_has_its_records(shared, tenant):
    values = {} if shared is None else {"SHARED_APPS": shared, "TENANT_APPS": tenant}
    with override_settings(**values):
        assert check_tenant_apps() == []


@pytest.mark.parametrize(
    ("default", "claims", "reported"),
    [
        ("django_tenants.postgresql_backend", "django.db.backends.postgresql", True),
        ("django_tenants.postgresql_backend", "django_tenants.postgresql_backend", False),
        ("django.db.backends.postgresql", "django_tenants.postgresql_backend", False),
    ],
)
def test_e038_a_claim_database_that_cannot_follow_the_tenant(
    monkeypatch, default, claims, reported
):
    """Where DATABASE's connection keeps a tenant schema (django-tenants), CLAIM_DATABASE's
    must take one too, or its claims land outside the caller's tenant. (The ENGINE entries
    are changed in place, read by the check only: no connection is made with them.)"""
    pytest.importorskip("django_tenants")
    monkeypatch.setitem(django_settings.DATABASES["default"], "ENGINE", default)
    monkeypatch.setitem(django_settings.DATABASES["claims"], "ENGINE", claims)
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        found = [m for m in check_settings() if m.id == "django_idempotency.E038"]
    assert [m.id for m in found] == (["django_idempotency.E038"] if reported else [])
    if reported:
        assert "'claims'" in found[0].msg
        assert "tenant" in found[0].msg


@pytest.mark.parametrize(
    ("entry", "value", "said"),
    [("ATOMIC_REQUESTS", True, "ATOMIC_REQUESTS"), ("AUTOCOMMIT", False, "AUTOCOMMIT")],
)
def test_e038_a_claim_database_that_opens_transactions(monkeypatch, entry, value, said):
    """A CLAIM_DATABASE whose DATABASES entry opens a transaction (ATOMIC_REQUESTS, as a
    copy of DATABASE's entry often carries, or AUTOCOMMIT off) holds its claims until that
    transaction ends: every claim made inside a caller's transaction would be refused at
    run time. Told by the settings, before any request."""
    monkeypatch.setitem(django_settings.DATABASES["claims"], entry, value)
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        found = [m for m in check_settings() if m.id == "django_idempotency.E038"]
    assert [m.id for m in found] == ["django_idempotency.E038"]
    assert "'claims'" in found[0].msg
    assert said in found[0].msg
    monkeypatch.setitem(django_settings.DATABASES["claims"], entry, not value)
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        assert [m for m in check_settings() if m.id == "django_idempotency.E038"] == []


def test_check_command_passes_with_defaults():
    call_command("check", stdout=StringIO())


@pytest.fixture
def no_celery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery as if it were not installed: ``None`` in ``sys.modules`` is how Python marks a
    module that cannot be imported (``find_spec`` answers ``None``, ``import`` fails)."""
    monkeypatch.setitem(sys.modules, "celery", None)


# Tasks that never go through the outbox: its relay would need OUTBOX_SENDER for every message.
WORKER_ONLY = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}


def sender_ids(tasks=WORKER_ONLY, **idempotency):
    with override_settings(IDEMPOTENCY=idempotency, TASKS=tasks):
        return [message.id for message in check_outbox_sender()]


@pytest.mark.usefixtures("no_celery")
def test_e037_the_default_sender_without_celery():
    with override_settings(IDEMPOTENCY={}, TASKS=WORKER_ONLY):
        (message,) = check_outbox_sender()
    assert message.id == "django_idempotency.E037"
    assert "Celery is not installed" in message.msg
    assert "SILENCED_SYSTEM_CHECKS" in message.hint
    # Named explicitly, it is the same sender and the same Error.
    assert sender_ids(OUTBOX_SENDER="django_idempotency.celery_sender.send") == [message.id]
    # A sender of one's own needs no Celery; a setting that is no dict is E001's.
    assert sender_ids(OUTBOX_SENDER="tests.testapp.outbox.record") == []
    with override_settings(IDEMPOTENCY=None):
        assert check_outbox_sender() == []
    # Not a wrong value: the settings stay readable, so requests are not refused over it.
    assert ids() == []


@pytest.mark.usefixtures("no_celery")
def test_e037_not_when_the_outbox_serves_django_tasks():
    # A project on Django's Tasks framework alone: the relay hands its messages to a Tasks
    # backend and needs neither Celery nor an OUTBOX_SENDER.
    through_outbox = {
        "default": {
            "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
            "OPTIONS": {"DELIVER_TO": "worker"},
        },
        "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    }
    assert sender_ids(tasks=through_outbox) == []
    assert sender_ids(tasks=WORKER_ONLY) == ["django_idempotency.E037"]


def test_e037_not_with_celery_installed():
    pytest.importorskip("celery")
    assert sender_ids() == []


@pytest.mark.usefixtures("no_celery")
def test_e037_stops_the_check_command_unless_silenced():
    errors = override_settings(IDEMPOTENCY={}, SILENCED_SYSTEM_CHECKS=[], TASKS=WORKER_ONLY)
    with errors, pytest.raises(SystemCheckError, match="E037"):
        call_command("check", stdout=StringIO(), stderr=StringIO())
    silenced = override_settings(
        IDEMPOTENCY={}, SILENCED_SYSTEM_CHECKS=["django_idempotency.E037"], TASKS=WORKER_ONLY
    )
    with silenced:
        call_command("check", stdout=StringIO())


def test_check_command_fails_on_an_error():
    with override_settings(IDEMPOTENCY={"TTL": 0}), pytest.raises(SystemCheckError, match="E003"):
        call_command("check", stdout=StringIO(), stderr=StringIO())


def test_w011_a_claim_database_that_may_wait_longer_than_claim_timeout(settings, monkeypatch):
    claims = settings.DATABASES["claims"]
    monkeypatch.setitem(claims, "OPTIONS", {})
    with override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"}):
        found = [m for m in check_settings() if m.id == "django_idempotency.W011"]
        if connection.vendor == "sqlite":
            assert found == []  # SQLite has no connect to wait for
            return
        (warning,) = found
        assert "no connect_timeout" in warning.msg
        monkeypatch.setitem(claims, "OPTIONS", {"connect_timeout": 2})
        assert [m for m in check_settings() if m.id == "django_idempotency.W011"] == []
        monkeypatch.setitem(claims, "OPTIONS", {"connect_timeout": 2, "pool": {"timeout": 30}})
        (pool,) = [m for m in check_settings() if m.id == "django_idempotency.W011"]
        assert "pool's timeout (30 s)" in pool.msg
        # A pool of Django's defaults (OPTIONS["pool"] = True) waits psycopg-pool's 30 s.
        monkeypatch.setitem(claims, "OPTIONS", {"connect_timeout": 2, "pool": True})
        (pool,) = [m for m in check_settings() if m.id == "django_idempotency.W011"]
        assert "pool's timeout (30 s)" in pool.msg
        monkeypatch.setitem(claims, "OPTIONS", {"connect_timeout": 2, "pool": {"timeout": 2}})
        assert [m for m in check_settings() if m.id == "django_idempotency.W011"] == []
        # 0 is no connect timeout at all (libpq, mysqlclient).
        monkeypatch.setitem(claims, "OPTIONS", {"connect_timeout": 0})
        (forever,) = [m for m in check_settings() if m.id == "django_idempotency.W011"]
        assert "connect_timeout (0 s)" in forever.msg


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({}, "must name the backend"),
        ({"DELIVER_TO": "missing"}, "is unusable"),
        ({"DELIVER_TO": "default"}, "another outbox backend"),
    ],
)
def test_e050_the_tasks_backend_delivers_to_a_backend_that_runs_tasks(options, said):
    if not django_settings.HAS_DJANGO_TASKS:
        pytest.skip("Django's Tasks framework with django-tasks-db is not installed")
    from django_idempotency._tasks_compat import InvalidTask, task_backends

    tasks = {
        "default": {
            "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
            "OPTIONS": options,
        },
        "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    }
    with override_settings(TASKS=tasks):
        backend = task_backends["default"]
        (message,) = backend.check()
        assert message.id == "django_idempotency.E050"
        assert said in message.msg
        # Nothing can be enqueued on it either: the refusal names the same problem.
        with pytest.raises(InvalidTask, match=said):
            backend.target  # noqa: B018
    with override_settings(
        TASKS={**tasks, "default": {**tasks["default"], "OPTIONS": {"DELIVER_TO": "worker"}}}
    ):
        assert list(task_backends["default"].check()) == []


@pytest.mark.django_db
@override_settings(IDEMPOTENCY={"RECOVERY": "fail"})
def test_no_synchronous_standby_is_not_reported_of_a_server_without_standbys():
    """W020 needs standbys to fail over to (tests/test_standby.py shows it reported of an
    asynchronous one, and not of a synchronous one)."""
    from django_idempotency.checks import check_synchronous_standby

    assert check_synchronous_standby(databases=["default"]) == []
    assert check_synchronous_standby(databases=[]) == []


def streaming_asynchronously(monkeypatch) -> None:
    """The server of ``default`` as a primary with one asynchronous standby, as W020 reads it
    (tests/test_standby.py reads a real one)."""
    from django_idempotency import _vendors, checks

    monkeypatch.setattr(type(_vendors.of("default")), "replication_sql", "SELECT 1")
    monkeypatch.setattr(checks, "_server_row", lambda alias, sql: ("", "on", 1, 1))


@pytest.mark.parametrize(
    "recovery", ["fail", "resume", "tests.testapp.views.recover_by_asking_provider"]
)
@pytest.mark.django_db
def test_no_synchronous_standby_is_reported_of_each_policy_whose_claim_must_be_durable(
    monkeypatch, recovery
):
    """A claim lost in a failover is never recovered: its retry runs afresh. That breaks
    "fail" and "resume", and bypasses a callable policy, which is never asked; "retry"
    runs again by design."""
    from django_idempotency.checks import check_synchronous_standby

    streaming_asynchronously(monkeypatch)
    with override_settings(
        IDEMPOTENCY={"RECOVERY": recovery}, ROOT_URLCONF="tests.no_such_urlconf"
    ):
        (warning,) = check_synchronous_standby(databases=["default"])
        assert warning.id == "django_idempotency.W020"
        assert f"IDEMPOTENCY['RECOVERY'] ({recovery!r})" in warning.msg
    with override_settings(IDEMPOTENCY={"RECOVERY": "retry"}, ROOT_URLCONF="tests.no_such_urlconf"):
        assert check_synchronous_standby(databases=["default"]) == []
    # The URL audit's operations: the test URLconf's callable policy among them.
    with override_settings(IDEMPOTENCY={"RECOVERY": "retry"}):
        (warning,) = check_synchronous_standby(databases=["default"])
        assert "'charges.create-callable'" in warning.msg


@pytest.mark.parametrize(
    ("row", "warned"),
    [
        (("s1", "on", 1, 0), False),  # the one standby is synchronous
        (("s1", "on", 2, 1), True),  # a second, asynchronous standby could be promoted
        (("s1", "local", 1, 0), True),  # named, but commits do not wait for it
        (("", "on", 0, 0), False),  # no physical standby (a logical subscriber is not one)
    ],
)
@pytest.mark.django_db
def test_no_synchronous_standby_is_reported_while_any_standby_streams_asynchronously(
    monkeypatch, row: tuple[object, ...], warned: bool
):
    from django_idempotency import _vendors, checks
    from django_idempotency.checks import check_synchronous_standby

    monkeypatch.setattr(type(_vendors.of("default")), "replication_sql", "SELECT 1")
    monkeypatch.setattr(checks, "_server_row", lambda alias, sql: row)
    with override_settings(IDEMPOTENCY={"RECOVERY": "fail"}):
        found = check_synchronous_standby(databases=["default"])
    assert [w.id for w in found] == (["django_idempotency.W020"] if warned else [])
    if row == ("s1", "on", 2, 1):
        assert "does not name 1 of them" in found[0].msg


@pytest.mark.django_db
@override_settings(IDEMPOTENCY={"RECOVERY": "fail"}, ROOT_URLCONF="tests.no_such_urlconf")
def test_no_synchronous_standby_survives_a_urlconf_that_does_not_import():
    """Django's own checks report such a URLconf; W020 still reads RECOVERY, and says
    nothing of a server without standbys rather than fail the whole check run."""
    from django_idempotency.checks import check_synchronous_standby

    with pytest.raises(ImportError):
        __import__("tests.no_such_urlconf")
    assert check_synchronous_standby(databases=["default"]) == []
