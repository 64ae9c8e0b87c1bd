"""The test suite's own machinery: TEST_DATABASE_ONLY and TEST_SHARD (tests/conftest.py),
the helpers' assertions, the progress line of `make test`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import shard_of, touches_the_database


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


def test_the_halves_split_files_and_cover_the_suite(request):
    first, second = shard_of("1/2"), shard_of("2/2")
    assert first(request.node) != second(request.node)


def test_the_thirds_place_the_server_suites_apart_and_cover_the_suite(request):
    from tests.conftest import PLACED_IN_THIRDS

    parts = [shard_of(f"{k}/3") for k in (1, 2, 3)]
    assert sum(part(request.node) for part in parts) == 1

    class Item:
        def __init__(self, path: str) -> None:
            self.nodeid = f"{path}::test"

    for path, index in PLACED_IN_THIRDS.items():
        assert [part(Item(path)) for part in parts] == [k == index for k in (1, 2, 3)]


@pytest.mark.parametrize("value", ["0/2", "3/2", "half", "1/0"])
def test_a_wrong_shard_is_a_usage_error(value):
    with pytest.raises(pytest.UsageError, match="TEST_SHARD must be k/n"):
        shard_of(value)


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
