"""Workers killed with SIGKILL at every step of a request, through gunicorn with several workers.

``tests/test_crash.py`` covers kills at the start of the view, after the provider call and
after the local write, each followed by a retry. This module adds the kills around the
completion commit (after the fenced UPDATE but before the COMMIT; after the COMMIT but
before the answer), the recovery job acting before any retry, several crashes of one
operation in a row, and duplicates racing a dying original. Every test counts the local
charges, the provider's ledger and the calls that reached the provider.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from django_idempotency import maintenance, states
from django_idempotency.models import IdempotencyRecord
from tests.helpers import (
    FAIL_PATH,
    RETRY_PATH,
    Caller,
    assert_problem,
    caller_effects,
    postgres_only,
    settle,
    sleep_past_lease,
)
from tests.helpers import FAULTS_CHARGE as CHARGE
from tests.live import DISCONNECTED, Answer, gunicorn, request
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]


# -- this module's fixtures and helpers ----------------------------------------------------


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), gunicorn(workers=3) as url:
        yield url


def record_of(caller: Caller) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(account=caller.tenant, key=caller.key)


def crash(server: str, path: str, caller: Caller, directives: str) -> None:
    answer = request(server, "POST", path, CHARGE, caller.headers(directives))
    assert answer is DISCONNECTED, (answer.status, answer.body[:300])


def duplicates_of_a_dying_original(
    server: str, n: int
) -> tuple[Caller, list[tuple[Answer, float]], float]:
    """An original that charges and is killed 1.5 s later, and ``n - 1`` duplicates sent as
    soon as its claim is seen: each duplicate's answer with the wall-clock time it came, and
    the time the original's lease ran out."""
    caller = Caller.new()

    def duplicate(_: int) -> tuple[Answer, float]:
        answer = request(server, "POST", RETRY_PATH, CHARGE, caller.headers())
        return answer, time.time()

    with ThreadPoolExecutor(max_workers=n) as pool:
        original = pool.submit(
            request,
            server,
            "POST",
            RETRY_PATH,
            CHARGE,
            caller.headers("sleep-after-provider:1.5,kill-after-provider"),
        )
        deadline = time.monotonic() + 10
        while not IdempotencyRecord.objects.filter(account=caller.tenant).exists():
            assert time.monotonic() < deadline, "the original never claimed"
            time.sleep(0.02)
        lease_end = record_of(caller).lease_expires_at
        assert lease_end is not None
        duplicates = list(pool.map(duplicate, range(n - 1)))
        assert original.result(timeout=30) is DISCONNECTED
    return caller, duplicates, lease_end.timestamp()


# -- (c) the completion commit -------------------------------------------------------------


def test_kill_between_the_fenced_update_and_the_commit_retry_policy(server):
    """The UPDATE to ``completed`` ran but never committed: the record is still claimed, the
    charge is rolled back with it, and the retry after the lease charges once overall.
    (A retry within the lease gets 409: tests/test_crash.py shows it.)"""
    caller = Caller.new()
    crash(server, RETRY_PATH, caller, "kill-before-commit")
    record = record_of(caller)
    assert record.status == states.IN_PROGRESS
    assert caller_effects(caller, "faults.charge") == (0, 1, 1)
    sleep_past_lease()
    answer = settle(server, RETRY_PATH, caller.headers())
    assert answer.status == 201
    assert not answer.replayed
    assert caller_effects(caller, "faults.charge") == (1, 1, 2)  # called twice, charged once
    assert record_of(caller).recovery_attempts == 1
    replay = request(server, "POST", RETRY_PATH, CHARGE, caller.headers())
    assert replay.replayed
    assert replay.body == answer.body


def test_kill_between_the_fenced_update_and_the_commit_fail_policy(server):
    caller = Caller.new()
    crash(server, FAIL_PATH, caller, "kill-before-commit")
    assert record_of(caller).status == states.IN_PROGRESS
    sleep_past_lease()
    answer = settle(server, FAIL_PATH, caller.headers())
    assert_problem(answer, 500, "idempotency_outcome_unknown")
    again = request(server, "POST", FAIL_PATH, CHARGE, caller.headers())
    assert again.replayed
    assert again.body == answer.body
    assert record_of(caller).status == states.FAILED
    # The provider was charged by the dead attempt and never called again.
    assert caller_effects(caller, "faults.charge-fail") == (0, 1, 1)


def test_kill_after_the_commit_replays_without_running_again(server):
    """The process died after COMMIT, before answering: the outcome is stored, so the retry
    replays it at once (no lease to wait for) and the view never runs again."""
    caller = Caller.new()
    crash(server, RETRY_PATH, caller, "kill-after-commit")
    record = record_of(caller)
    assert record.status == states.COMPLETED
    answer = request(server, "POST", RETRY_PATH, CHARGE, caller.headers())
    assert answer.status == 201
    assert answer.replayed
    assert answer.body == bytes(record.response_body)
    assert answer.json()["id"] == Charge.objects.get(account=caller.tenant).pk
    assert caller_effects(caller, "faults.charge") == (1, 1, 1)


# -- (a) after the claim, before the view's work ------------------------------------------


def test_kill_after_the_claim_under_the_fail_policy_reports_an_unknown_outcome(server):
    """Documented: the ``"fail"`` policy cannot tell "died before any effect" from "died
    after the provider call", so even an attempt that did nothing is closed as unknown."""
    caller = Caller.new()
    crash(server, FAIL_PATH, caller, "kill-start")
    sleep_past_lease()
    assert_problem(settle(server, FAIL_PATH, caller.headers()), 500, "idempotency_outcome_unknown")
    assert caller_effects(caller, "faults.charge-fail") == (0, 0, 0)


# -- (b) after the provider call: the recovery job before any retry ------------------------


def test_recovery_job_releases_a_dead_claim_and_the_retry_charges_once(server):
    caller = Caller.new()
    crash(server, RETRY_PATH, caller, "kill-after-provider")
    sleep_past_lease()
    result = maintenance.recover_stale_leases()
    assert result.released >= 1
    assert not IdempotencyRecord.objects.filter(account=caller.tenant).exists()
    answer = settle(server, RETRY_PATH, caller.headers())
    assert answer.status == 201
    assert not answer.replayed
    # A fresh claim (the job released the old one), the same downstream key: one charge.
    assert record_of(caller).recovery_attempts == 0
    assert caller_effects(caller, "faults.charge") == (1, 1, 2)


def test_recovery_job_closes_a_dead_claim_under_the_fail_policy(server):
    caller = Caller.new()
    crash(server, FAIL_PATH, caller, "kill-after-provider")
    sleep_past_lease()
    assert maintenance.recover_stale_leases().failed >= 1
    answer = request(server, "POST", FAIL_PATH, CHARGE, caller.headers())
    assert_problem(answer, 500, "idempotency_outcome_unknown")
    assert answer.replayed
    assert caller_effects(caller, "faults.charge-fail") == (0, 1, 1)


# -- several crashes, several workers ------------------------------------------------------


def test_an_operation_that_crashes_twice_still_charges_once(server):
    caller = Caller.new()
    crash(server, RETRY_PATH, caller, "kill-after-provider")
    sleep_past_lease()
    crash(server, RETRY_PATH, caller, "kill-before-commit")
    assert record_of(caller).recovery_attempts == 1
    sleep_past_lease()
    answer = settle(server, RETRY_PATH, caller.headers())
    assert answer.status == 201
    assert not answer.replayed
    assert record_of(caller).recovery_attempts == 2
    assert caller_effects(caller, "faults.charge") == (1, 1, 3)


def test_duplicates_racing_a_dying_original_and_then_its_takeover(server):
    """While the original holds its lease, every duplicate on every worker gets 409; once
    it is dead and its lease is out, of a storm of retries exactly one takes the lease
    over and runs, and the provider still charges once."""
    n = 6
    # A duplicate answered after the lease ran out (a loaded machine can take 2 s to send
    # five requests) may rightly take the claim over: such a round proves nothing about the
    # lease, so it is sent again with a new caller, a bounded number of times.
    for _ in range(3):
        caller, duplicates, late = duplicates_of_a_dying_original(server, n)
        in_lease = [a.status for a, answered_at in duplicates if answered_at < late]
        assert in_lease == [409] * len(in_lease)
        statuses = [(a.status, a.replayed) for a, _ in duplicates]
        assert {status for status, _ in statuses} <= {201, 409}, statuses
        assert statuses.count((201, False)) <= 1, statuses
        if len(in_lease) == n - 1:
            break
    else:
        pytest.fail("in three rounds, the duplicates were never all answered within the 2 s lease")
    sleep_past_lease()
    barrier = threading.Barrier(n, timeout=10)

    def retry(_: int) -> Answer:
        barrier.wait()
        return request(server, "POST", RETRY_PATH, CHARGE, caller.headers())

    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(retry, range(n)))
    fresh = [a for a in answers if a.status == 201 and not a.replayed]
    assert len(fresh) == 1, [(a.status, a.replayed) for a in answers]
    assert {a.status for a in answers} <= {201, 409}
    final = settle(server, RETRY_PATH, caller.headers())
    assert final.replayed
    assert final.body == fresh[0].body
    assert caller_effects(caller, "faults.charge") == (1, 1, 2)
