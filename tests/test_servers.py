"""Many servers, one database: nothing but PostgreSQL coordinates them.

Four gunicorn servers (two workers each, so eight processes with their own connections) get
the same key at the same instant, round after round: each round has exactly one effect,
counted in the database. (Two Celery workers sharing duplicated deliveries: tests/test_tasks.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from tests.helpers import FAULTS_CHARGE as CHARGE
from tests.helpers import RETRY_PATH, Caller, caller_effects, postgres_only
from tests.live import Answer, gunicorn, request

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

SERVERS = 4
WORKERS = 2
ROUNDS = 50


@pytest.fixture(scope="module")
def servers(django_db_setup, django_db_blocker) -> Iterator[list[str]]:
    with django_db_blocker.unblock(), ExitStack() as stack:
        yield [stack.enter_context(gunicorn(workers=WORKERS)) for _ in range(SERVERS)]


def test_the_same_key_on_four_servers_at_once_has_one_effect_per_round(servers):
    # One request per worker of every server, all released together.
    targets = [url for url in servers for _ in range(WORKERS)]
    barrier = threading.Barrier(len(targets), timeout=20)
    callers = [Caller.new() for _ in range(ROUNDS)]

    def send(url: str, caller: Caller) -> Answer:
        barrier.wait()
        return request(url, "POST", RETRY_PATH, CHARGE, caller.headers(), timeout=30)

    fresh_per_round = []
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        for caller in callers:
            answers = list(pool.map(send, targets, [caller] * len(targets)))
            assert {a.status for a in answers} <= {201, 409}, [a.status for a in answers]
            fresh_per_round.append(sum(a.status == 201 and not a.replayed for a in answers))
    assert fresh_per_round == [1] * ROUNDS
    # Counted in the database, per round: one local charge, one provider charge, one call.
    assert [caller_effects(caller, "faults.charge") for caller in callers] == [(1, 1, 1)] * ROUNDS
