"""Schemas per tenant with django-tenants, on PostgreSQL.

The package is one of the tenant apps (``TENANT_APPS``): each tenant's schema has its own
records, outbox and audit trail, and the public schema has none. Two tenants, ``alpha``
and ``beta`` (plus the public tenant that django-tenants projects usually have):

- the same key from the same caller id in both tenants runs once in each (two effects),
  and each tenant's retries replay its own outcome, never the other's: over HTTP through
  django-tenants' middleware, and through ``run_once`` inside a caller's transaction, where
  the claim commits on a connection of its own that must follow the caller's schema;
- the engine's statements run in the schema set last, also where they are prepared on a
  cursor of their own (``TEST_DB_PREPARE=0``: make test-tenants runs the file both ways);
- the maintenance commands cover every tenant when run as the docs say
  (``all_tenants_command --no-public``): the purge, the recovery of stale leases (after a
  real crash in each tenant) and the relay, each effect counted; the database gauges read
  the schema they are collected in.

Run by ``make test-tenants`` (``pytest --ds=tests.tenants.settings``); skipped under the
suite's own settings.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings

if "django_tenants" not in settings.INSTALLED_APPS:
    pytest.skip("make test-tenants runs it (--ds=tests.tenants.settings)", allow_module_level=True)

from django.core.management import ManagementUtility
from django.db import connection, connections, transaction
from django.test import Client as HttpClient
from django.test import override_settings
from django.test.utils import setup_databases, teardown_databases
from django.utils import timezone
from django_tenants.utils import schema_context

from django_idempotency import InProgress, OutcomeUnknown, run_once
from django_idempotency.models import IdempotencyRecord, OutboxMessage, OutboxStatus, RecordStatus
from tests.live import ROOT
from tests.tenants.models import Client, Delivery, Domain
from tests.testapp.models import Charge, ProviderCall

TENANTS = ("alpha", "beta")
TIMEOUT = 30


@pytest.fixture(scope="module")
def tenants(django_test_environment: None, django_db_blocker: Any) -> Iterator[None]:
    """A test database with the public tenant and two others, each schema made and migrated
    by django-tenants. (Made here, not by pytest-django's ``django_db``, whose flush after
    each test would empty the shared schema's tenants and leave their schemas behind.)"""
    with django_db_blocker.unblock():
        made = setup_databases(verbosity=0, interactive=False, aliases={"default"})
        try:
            Client.objects.create(schema_name="public", name="public")
            for name in TENANTS:
                tenant = Client.objects.create(schema_name=name, name=name)
                Domain.objects.create(domain=f"{name}.test", tenant=tenant, is_primary=True)
            yield
        finally:
            connection.set_schema_to_public()
            connections.close_all()
            teardown_databases(made, verbosity=0)


@pytest.fixture
def database(tenants: None, django_db_blocker: Any) -> Iterator[None]:
    """The test database, the public schema set, emptied of every tenant's rows after the
    test. (A request through django-tenants' middleware leaves its tenant set.)"""
    with django_db_blocker.unblock():
        connection.set_schema_to_public()
        yield
        connection.set_schema_to_public()
        for name in TENANTS:
            with schema_context(name):
                for model in (IdempotencyRecord, OutboxMessage, Charge, ProviderCall):
                    model.objects.all().delete()
        Delivery.objects.all().delete()
        connections.close_all()


def count(model: Any, schema: str, **filters: Any) -> int:
    with schema_context(schema):
        return int(model.objects.filter(**filters).count())


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def manage(*args: str) -> Ran:
    """``manage.py ARGS`` as a user types it (Django's command-line entry point, with its
    exit status), in this process: on the test database, without a second start of Django
    per command. It starts in the public schema, as a new process would."""
    out, err = io.StringIO(), io.StringIO()
    status = 0
    connection.set_schema_to_public()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            ManagementUtility(["manage.py", *args]).execute()
    except SystemExit as exc:
        status = int(exc.code or 0)
    finally:
        connection.set_schema_to_public()
    return Ran(status, out.getvalue(), err.getvalue())


def post(schema: str, key: str, caller: str = "1") -> tuple[int, dict[str, Any]]:
    """A charge through django-tenants' middleware, on the tenant's domain."""
    response = HttpClient().post(
        "/charges/",
        data=json.dumps({"amount": 100}),
        content_type="application/json",
        headers={"Idempotency-Key": key, "X-Caller": caller, "Host": f"{schema}.test"},
    )
    return response.status_code, json.loads(response.content)


def test_the_same_key_in_two_tenants_runs_once_in_each_over_http(database):
    """Eight requests at once per tenant with one key and one caller id: one charge and one
    record in each tenant's schema; every retry replays its own tenant's charge."""

    def attempt(schema: str) -> tuple[str, int, dict[str, Any]]:
        try:
            return (schema, *post(schema, "order-1"))
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(attempt, [name for name in TENANTS for _ in range(8)]))

    assert {status for _, status, _ in answers} <= {201, 409}
    for name in TENANTS:
        assert count(Charge, name) == 1
        assert count(IdempotencyRecord, name, key="order-1", status=RecordStatus.COMPLETED) == 1
        with schema_context(name):
            charge = Charge.objects.get().pk
        for _ in range(2):
            status, body = post(name, "order-1")
            assert (status, body) == (201, {"charge": charge, "schema": name})
        # Its receipt waits in its own outbox, naming its own schema.
        with schema_context(name):
            assert list(OutboxMessage.objects.values_list("args", flat=True)) == [[charge, name]]
    assert count(Charge, "alpha") + count(Charge, "beta") == 2


@pytest.mark.parametrize("claims", [None, "claims"], ids=["own-connection", "CLAIM_DATABASE"])
def test_a_claim_inside_a_callers_transaction_lands_in_the_callers_schema(database, claims):
    """``run_once`` inside ``transaction.atomic()`` claims on a second connection (or on
    ``CLAIM_DATABASE``): the claim lands in the caller's schema, visible there at once (a
    duplicate in that tenant gets ``InProgress``) and nowhere else (the same key in the
    other tenant runs). One thread then serves the other tenant with the same key: its
    second connection follows the switch."""
    started, finish = threading.Event(), threading.Event()
    runs: list[str] = []

    def charge(schema: str, wait: bool) -> int:
        runs.append(schema)
        pk = Charge.objects.create(account="user:1", amount=1, currency="EUR").pk
        if wait:
            started.set()
            assert finish.wait(TIMEOUT)
        return pk

    def call(schema: str, wait: bool = False) -> Any:
        try:
            with schema_context(schema), transaction.atomic():
                return run_once(
                    charge, schema, wait, account="user:1", operation="charges.create", key="k"
                )
        except InProgress as exc:
            return exc
        finally:
            connections.close_all()

    config = {**getattr(settings, "IDEMPOTENCY", {}), "CLAIM_DATABASE": claims}
    with override_settings(IDEMPOTENCY=config), ThreadPoolExecutor(max_workers=1) as first:
        holder = first.submit(call, "alpha", True)
        while not started.wait(0.05):
            assert not holder.done(), holder.result()
        with ThreadPoolExecutor(max_workers=1) as other:
            assert isinstance(other.submit(call, "alpha").result(TIMEOUT), InProgress)
            beta = other.submit(call, "beta").result(TIMEOUT)
        finish.set()
        alpha = holder.result(TIMEOUT)
        # One thread, both tenants, one after the other: each replays its own charge.
        assert first.submit(call, "beta").result(TIMEOUT) == beta
        assert first.submit(call, "alpha").result(TIMEOUT) == alpha

    assert sorted(runs) == ["alpha", "beta"]
    for name, pk in (("alpha", alpha), ("beta", beta)):
        with schema_context(name):
            assert list(Charge.objects.values_list("pk", flat=True)) == [pk]
            assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_the_engines_statements_run_in_the_schema_set_last(database):
    """A thread reads in beta's schema, then switches to alpha's and calls ``run_once``
    before any query of Django's: the claim, the completion and the work land in alpha's
    schema, nothing in beta's. (The connection still has beta's ``search_path`` until a
    cursor sets alpha's; with ``prepare_threshold`` set the engine's statements use a
    cursor of their own, which must set it too: make test-tenants runs this file both
    ways.)"""

    def charge() -> int:
        return int(Charge.objects.create(account="user:1", amount=1, currency="EUR").pk)

    with schema_context("beta"):
        assert Charge.objects.count() == 0
        connection.set_schema("alpha")
        first = run_once(charge, account="user:1", operation="charges.create", key="k")
        again = run_once(charge, account="user:1", operation="charges.create", key="k")
    assert again == first
    assert (count(Charge, "alpha"), count(IdempotencyRecord, "alpha")) == (1, 1)
    assert (count(Charge, "beta"), count(IdempotencyRecord, "beta")) == (0, 0)


def test_purge_covers_every_tenant(database):
    """``all_tenants_command --no-public purge_idempotency`` deletes the expired records and
    the sent outbox messages of each tenant, and keeps the live ones."""
    for name in TENANTS:
        for key in ("old-1", "old-2", "live"):
            post(name, key)
        with schema_context(name):
            IdempotencyRecord.objects.exclude(key="live").update(
                expires_at=timezone.now() - timedelta(minutes=1)
            )
            OutboxMessage.objects.update(
                status=OutboxStatus.SENT, sent_at=timezone.now() - timedelta(days=30)
            )

    done = manage("all_tenants_command", "--no-public", "purge_idempotency")

    assert done.returncode == 0, done.stderr
    for name in TENANTS:
        assert f"Applying command to: {name}" in done.stdout
        with schema_context(name):
            assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["live"]
        assert count(OutboxMessage, name) == 0
        assert count(Charge, name) == 3
    assert done.stdout.count("Purged 2 expired idempotency records") == 2
    assert done.stdout.count("3 sent outbox messages") == 2


def test_the_commands_refuse_the_public_schema_rather_than_do_nothing(database):
    """Run without django-tenants' wrapper, a command runs in the public schema, which has
    no records: it fails with the reason (exit status 1), never reports 0 purged."""
    post("alpha", "k")
    with schema_context("alpha"):
        IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(minutes=1))

    for command in ("purge_idempotency", "recover_idempotency", "relay_outbox"):
        done = manage(command, *(["--once"] if command == "relay_outbox" else []))
        assert done.returncode == 1, (command, done.stdout)
        assert 'relation "django_idempotency_' in done.stderr, (command, done.stderr)
    assert count(IdempotencyRecord, "alpha") == 1
    assert count(OutboxMessage, "alpha", status=OutboxStatus.PENDING) == 1


def test_recovery_covers_every_tenant(database):
    """A process dies inside ``run_once`` in each tenant (``"retry"`` in alpha, ``"fail"``
    in beta), after calling the provider. ``all_tenants_command --no-public
    recover_idempotency`` applies each tenant's policy: alpha's key runs again (the provider
    called with the same downstream key), beta's answers ``OutcomeUnknown``; one charge in
    alpha, none in beta."""
    for name, policy in (("alpha", "retry"), ("beta", "fail")):
        crashed = subprocess.run(
            [sys.executable, "-m", "tests.tenants.crash", name, "order-7", policy],
            cwd=ROOT,
            env={
                **os.environ,
                "DB_NAME": connection.settings_dict["NAME"],
                "PYTHONPATH": str(ROOT),
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert crashed.returncode == -9, crashed.stderr
        assert count(IdempotencyRecord, name, status=RecordStatus.IN_PROGRESS) == 1
        assert count(Charge, name) == 0
        assert count(ProviderCall, name) == 1
    time.sleep(1.2)  # their 1 s leases run out

    done = manage("all_tenants_command", "--no-public", "recover_idempotency")

    assert done.returncode == 0, done.stderr
    assert "Recovered 1 stale leases: 1 released, 0 failed" in done.stdout
    assert "Recovered 1 stale leases: 0 released, 1 failed" in done.stdout
    assert count(IdempotencyRecord, "alpha") == 0
    assert count(IdempotencyRecord, "beta", status=RecordStatus.FAILED) == 1

    def charge() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_schema()")
            (schema,) = cursor.fetchone()
        Charge.objects.create(account="user:1", amount=1, currency="EUR")
        return str(schema)

    for name in TENANTS:
        with schema_context(name):
            try:
                answer: Any = run_once(
                    charge, account="user:1", operation="charges.create", key="order-7"
                )
            except OutcomeUnknown as exc:
                answer = exc
        assert (answer == "alpha") if name == "alpha" else isinstance(answer, OutcomeUnknown)
    assert (count(Charge, "alpha"), count(Charge, "beta")) == (1, 0)
    assert (count(ProviderCall, "alpha"), count(ProviderCall, "beta")) == (1, 1)


def test_the_relay_covers_every_tenant(database):
    """Three receipts enqueued in alpha, two in beta: ``all_tenants_command --no-public
    relay_outbox --once`` sends each once, from its own tenant's relay; a second run sends
    nothing. One tenant alone (beta, first): ``tenant_command relay_outbox --schema=beta``."""
    charges = {
        name: [post(name, f"order-{i}")[1]["charge"] for i in range(n)]
        for name, n in (("alpha", 3), ("beta", 2))
    }

    done = manage("tenant_command", "relay_outbox", "--schema=beta", "--once")
    assert done.returncode == 0, done.stderr
    assert "Sent 2 outbox messages" in done.stdout
    assert Delivery.objects.count() == 2

    done = manage("all_tenants_command", "--no-public", "relay_outbox", "--once")
    assert done.returncode == 0, done.stderr
    again = manage("all_tenants_command", "--no-public", "relay_outbox", "--once")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("Sent 0 outbox messages") == 2

    sent = sorted(Delivery.objects.values_list("schema", "args"))
    assert sent == [(name, [pk, name]) for name in TENANTS for pk in charges[name]]
    for name in TENANTS:
        assert count(OutboxMessage, name, status=OutboxStatus.SENT) == count(OutboxMessage, name)


def test_the_database_gauges_read_the_schema_they_are_collected_in(database):
    """The gauges read the schema the collecting thread's connection is set to: in the
    public one (a metrics server's own thread) they find no table, NaN; inside a tenant's
    ``schema_context``, or after its request set it, that tenant's figure."""
    pytest.importorskip("prometheus_client")
    from django_idempotency import metrics

    post("alpha", "order-1")

    def pending() -> float:
        (family,) = metrics.outbox_pending.collect()
        return float(family.samples[0].value)

    assert pending() == 1  # the request left the thread's connection in alpha's schema
    connection.set_schema_to_public()
    assert math.isnan(pending())
    with schema_context("alpha"):
        assert pending() == 1
    with schema_context("beta"):
        assert pending() == 0


@contextlib.contextmanager
def tenant_without_tables(name: str) -> Iterator[None]:
    """A tenant whose schema exists but was never migrated (``auto_create_schema`` off, the
    schema made by hand): what a failed or skipped ``migrate_schemas`` leaves."""
    tenant = Client(schema_name=name, name=name)
    tenant.auto_create_schema = False
    tenant.save()
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE SCHEMA {name}")
    Domain.objects.create(domain=f"{name}.test", tenant=tenant, is_primary=True)
    try:
        yield
    finally:
        connection.set_schema_to_public()
        Client.objects.filter(schema_name=name).delete()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def test_check_database_reads_the_tables_in_each_tenants_schema(database):
    """``check --database default`` on the layout above: the public schema has no records
    by design, and says nothing of it (exit status 0); a tenant whose schema lacks the
    tables is named, with django-tenants' command that migrates it."""
    done = manage("check", "--database", "default")
    assert done.returncode == 0, done.stderr
    assert "E052" not in done.stdout + done.stderr

    with tenant_without_tables("bare"):
        done = manage("check", "--database", "default")
        assert done.returncode == 1, done.stdout
        (line,) = [line for line in done.stderr.splitlines() if "E052" in line]
        assert "'bare'" in line
        assert not any(other in line for other in ("alpha", "beta", "public"))
        assert "migrate_schemas --schema=bare" in done.stderr
        # What it warns of: that tenant's requests are refused, the others' are not.
        assert post("bare", "k")[0] == 503
        assert post("alpha", "k")[0] == 201

    # A tenant whose tables are there but whose last migration is not recorded.
    with schema_context("beta"), connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM django_migrations WHERE app = 'django_idempotency'"
            " AND name = '0012_mysql_text_charset' RETURNING id"
        )
        assert cursor.fetchall()
    try:
        done = manage("check", "--database", "default")
        assert done.returncode == 1, done.stdout
        (line,) = [line for line in done.stderr.splitlines() if "E052" in line]
        assert "'beta'" in line
        assert "alpha" not in line
    finally:
        with schema_context("beta"), connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_migrations (app, name, applied) VALUES"
                " ('django_idempotency', '0012_mysql_text_charset', now())"
            )


def test_check_database_reports_sealed_outcomes_in_each_tenants_schema(database):
    """E026 reads the records of every tenant's schema (the public one has none): an
    outcome sealed with a key no longer configured is reported with its tenant named."""
    fernet = pytest.importorskip("cryptography.fernet")
    from django_idempotency import crypto

    old, new = (fernet.Fernet.generate_key().decode() for _ in range(2))
    keys = {**getattr(settings, "IDEMPOTENCY", {}), "ENCRYPTION_KEYS": [old]}
    with override_settings(IDEMPOTENCY=keys):
        assert post("alpha", "sealed")[0] == 201
    keys["ENCRYPTION_KEYS"] = [new]
    with override_settings(IDEMPOTENCY=keys):
        done = manage("check", "--database", "default")
    assert done.returncode == 1, done.stdout
    (line,) = [line for line in done.stderr.splitlines() if "E026" in line]
    assert "1 stored outcome is" in line
    assert crypto.key_id(old) in line
    assert "'alpha'" in line
    assert "beta" not in line
    with override_settings(IDEMPOTENCY={**keys, "ENCRYPTION_KEYS": [new, old]}):
        done = manage("check", "--database", "default")
    assert done.returncode == 0, done.stderr


def test_check_database_reads_a_tenant_whose_schema_name_holds_a_percent_sign(database):
    """django-tenants accepts ``%`` in a schema name (only quotes, backslashes, ``;`` and
    line ends are refused). E052 reads each migrated schema's ``django_migrations`` in one
    statement with parameters: such a name must not turn that statement into a refused one,
    which would leave every other tenant's missing tables unreported."""
    from django_idempotency._database_checks import missing_tables

    tenant = Client.objects.create(schema_name="acme%eu", name="acme%eu")
    try:
        with tenant_without_tables("bare"):
            (error,) = missing_tables("default", ["default"])
            assert error.id == "django_idempotency.E052"
            assert "'bare'" in error.msg
            assert "acme" not in error.msg  # migrated: not named
    finally:
        connection.set_schema_to_public()
        tenant.delete(force_drop=True)
