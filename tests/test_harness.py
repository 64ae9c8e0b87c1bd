"""The test suite's own machinery: TEST_DATABASE_ONLY and TEST_SHARD (tests/conftest.py),
the database emptied after a transactional test (tests/flush.py), the helpers' assertions,
the progress line of `make test`."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.management.sql import emit_post_migrate_signal
from django.db import connection
from django.test import TransactionTestCase

from django_idempotency.models import IdempotencyStep
from tests import flush
from tests.conftest import shard_of, touches_the_database
from tests.factories import RecordFactory, UserFactory
from tests.testapp.models import ProviderCall


@pytest.fixture
def server_like(django_db_setup: None, django_db_blocker: Any) -> None:
    """What a live server's fixture asks for: the database, unblocked outside a test's own."""


def test_a_test_without_the_database_is_left_to_the_first_runs(request):
    assert not touches_the_database(request.node)


@pytest.mark.django_db
def test_a_test_marked_django_db_touches_it(request):
    assert touches_the_database(request.node)


def test_a_fixture_that_unblocks_the_database_touches_it(request, server_like):
    assert touches_the_database(request.node)


class Item:
    def __init__(self, path: str, name: str = "test") -> None:
        self.nodeid = f"{path}::{name}"


def test_the_parts_split_files_and_cover_the_suite(request):
    items = [request.node, *(Item(f"tests/test_other_{n}.py") for n in range(7))]
    for count in (2, 3):
        parts = [shard_of(f"{k}/{count}", items) for k in range(1, count + 1)]
        for item in items:
            assert sum(part(item) for part in parts) == 1


def test_the_parts_are_balanced_by_the_files_measured_seconds(monkeypatch, tmp_path):
    weights = tmp_path / "weights.json"
    weights.write_text(
        '{"tests/a.py": 300, "tests/b.py": 200, "tests/c.py": 180, "tests/d.py": 90}'
    )
    monkeypatch.setattr("tests.conftest.WEIGHTS", weights)
    # A file without a measure counts DEFAULT_TEST_SECONDS per test: 10 tests here.
    items = [Item(path) for path in ("tests/a.py", "tests/b.py", "tests/c.py", "tests/d.py")]
    items += [Item("tests/new.py", f"test_{n}") for n in range(10)]
    parts = [shard_of(f"{k}/2", items) for k in (1, 2)]
    kept = [{item.nodeid.split("::")[0] for item in items if part(item)} for part in parts]
    # a (300); b (200); c (180) beside b; d (90) beside a; new (3) beside b and c.
    assert kept == [{"tests/a.py", "tests/d.py"}, {"tests/b.py", "tests/c.py", "tests/new.py"}]
    # The items' order changes nothing: every part decides alike.
    assert [shard_of(f"{k}/2", items[::-1])(items[0]) for k in (1, 2)] == [True, False]


@pytest.mark.parametrize("value", ["0/2", "3/2", "half", "1/0"])
def test_a_wrong_shard_is_a_usage_error(value):
    with pytest.raises(pytest.UsageError, match="TEST_SHARD must be k/n"):
        shard_of(value, [])


def test_a_failing_assertion_inside_the_shared_helpers_shows_its_values():
    """tests/helpers.py is rewritten by pytest (tests/conftest.py registers it): a failing
    assertion there shows the values it compared, not a bare AssertionError."""
    from tests.helpers import says_nothing_of_the_server

    with pytest.raises(AssertionError) as failed:
        says_nothing_of_the_server({"detail": "the TTL ran out"})
    assert "assert not ['TTL']" in str(failed.value)


def test_the_progress_line_reads_each_runs_percentage(tmp_path):
    from tests.progress import state

    log = tmp_path / "pytest-sqlite.log"
    assert state(log) == "not started"
    log.write_text("tests/test_a.py ....  [ 12%]\ntests/test_b.py ..")
    assert state(log) == "12%"
    log.write_text("collecting ...")
    assert state(log) == "collecting ..."


# -- the database emptied after a transactional test (tests/flush.py) --------------------------


def rows_by_table() -> dict[str, int]:
    counts = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.django_table_names(
            only_existing=True, include_views=False
        ):
            cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(table)}")
            (counts[table],) = cursor.fetchone()
    return counts


def kept_rows() -> list[list[tuple[Any, ...]]]:
    return [list(model.objects.order_by("pk").values_list()) for model in flush.KEPT]


@pytest.mark.django_db(transaction=True)
def test_the_database_is_left_as_djangos_flush_leaves_it():
    """Every table empty but the content types and permissions, which hold what
    ``post_migrate`` (sent by Django's flush) writes: sent again, it writes nothing."""
    assert TransactionTestCase._fixture_teardown is flush._fixture_teardown  # installed
    flush.empty("default")  # Django's flush, the first time in a run
    written = kept_rows()
    assert all(written)
    user = UserFactory()
    user.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    IdempotencyStep.objects.create(record=RecordFactory.create(), name="charge", result="{}")
    ProviderCall.objects.create(key="charge")
    assert flush.empty("default") == "deleted"
    kept = {model._meta.db_table for model in flush.KEPT}
    assert {table: n for table, n in rows_by_table().items() if n and table not in kept} == {}
    assert kept_rows() == written
    emit_post_migrate_signal(0, False, "default")
    assert kept_rows() == written


@pytest.mark.django_db(transaction=True)
def test_a_changed_permission_is_written_again_by_djangos_flush():
    flush.empty("default")
    Permission.objects.filter(codename="view_idempotencyrecord").delete()
    assert flush.empty("default") == "flushed"
    assert Permission.objects.filter(codename="view_idempotencyrecord").count() == 1
    assert flush.empty("default") == "deleted"


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's dead rows")
@pytest.mark.django_db(transaction=True)
def test_a_table_grown_past_the_bound_is_truncated_by_djangos_flush():
    """Deleted rows stay in a PostgreSQL table until a VACUUM: a table that grew past the
    bound is truncated, so that none grows run after run."""
    flush.empty("default")

    def size() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_table_size('testapp_providercall')")
            (bytes_,) = cursor.fetchone()
        return int(bytes_)

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO testapp_providercall (key)"
            " SELECT 'bulk-' || n FROM generate_series(1, 20000) AS n"
        )
    assert size() > flush.LARGEST_DELETED
    assert flush.empty("default") == "flushed"
    assert (size(), ProviderCall.objects.count()) == (0, 0)
