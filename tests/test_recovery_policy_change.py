"""A recovery policy changed between a crashed attempt and its retry.

The attempt that crashed was claimed under one policy (stored on its record); the retry
comes after a deploy that gave the operation another. The crashed attempt's promise holds:
a claim made under ``"fail"`` is never run again, the steps recorded under ``"resume"`` are
never run again by a body that no longer resumes, a callable claimed under is asked before
a body runs again. Where the new policy is stricter (a claim under ``"retry"``, now
``"fail"``), the new one decides. Effects counted: the body's runs, the provider's calls,
the charges written, the record's state.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from django_idempotency import run_once, step
from django_idempotency.exceptions import (
    IdempotencyError,
    InProgress,
    OutcomeUnknown,
    SimulatedCrash,
)
from django_idempotency.maintenance import recover_stale_leases
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import crash, crash_after, crash_before, expire_lease
from tests.helpers import in_thread, logged_in, new_key, postgres_only
from tests.testapp.models import Charge, ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

IDENTITY = {"account": "consumer", "operation": "orders.ship"}
CHARGE = {"amount": 250, "currency": "EUR"}
ASKED: list[int] = []


def ask_the_provider(record: IdempotencyRecord) -> Any:
    """A recovery callable: the provider says the order shipped."""
    ASKED.append(record.pk)
    return {"shipped": "per the provider"}


def _noted(effects: list[str], what: str, result: Any) -> Any:
    effects.append(what)
    return result


def _crashed(policy: str, key: str, effects: list[str], with_step: bool = False) -> None:
    def body() -> str:
        if with_step:
            step("ship", lambda: _noted(effects, "shipped", "parcel-1"))
        else:
            effects.append("shipped")
        crash()
        return "unreachable"

    with pytest.raises(SimulatedCrash):
        run_once(body, **IDENTITY, key=key, recovery=policy)
    expire_lease(key)


def test_a_claim_made_under_fail_is_not_run_again_under_retry():
    effects: list[str] = []
    key = new_key()
    _crashed("fail", key, effects)
    for _ in range(2):
        with pytest.raises(OutcomeUnknown):
            run_once(lambda: effects.append("shipped"), **IDENTITY, key=key, recovery="retry")
    assert effects == ["shipped"]
    record = IdempotencyRecord.objects.get()
    assert (record.status, record.lease_token) == (RecordStatus.FAILED, None)


def test_steps_recorded_under_resume_are_not_run_again_by_a_body_under_retry():
    effects: list[str] = []
    key = new_key()
    _crashed("resume", key, effects, with_step=True)
    with pytest.raises(OutcomeUnknown):
        run_once(lambda: effects.append("shipped"), **IDENTITY, key=key, recovery="retry")
    assert effects == ["shipped"]
    assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED


def test_a_callable_claimed_under_is_asked_before_a_body_under_retry_runs():
    effects: list[str] = []
    key = new_key()
    ASKED.clear()
    _crashed(f"{__name__}.ask_the_provider", key, effects)
    answer = run_once(lambda: effects.append("shipped"), **IDENTITY, key=key, recovery="retry")
    assert answer == {"shipped": "per the provider"}
    assert (effects, len(ASKED)) == (["shipped"], 1)
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_a_callable_that_can_no_longer_be_imported_closes_the_record_as_fail():
    effects: list[str] = []
    key = new_key()
    _crashed(f"{__name__}.ask_the_provider", key, effects)
    IdempotencyRecord.objects.update(recovery_policy=f"{__name__}.removed_in_this_release")
    with pytest.raises(OutcomeUnknown):
        run_once(lambda: effects.append("shipped"), **IDENTITY, key=key, recovery="retry")
    assert effects == ["shipped"]


def test_a_stricter_policy_decides_a_claim_made_under_retry():
    effects: list[str] = []
    key = new_key()
    _crashed("retry", key, effects)
    with pytest.raises(OutcomeUnknown):
        run_once(lambda: effects.append("shipped"), **IDENTITY, key=key, recovery="fail")
    assert effects == ["shipped"]


def test_a_body_run_again_is_recorded_under_the_policy_it_runs_under():
    """A claim made under ``"retry"`` taken over under ``"resume"``: the attempt that runs
    now is under ``"resume"``, and if it crashes too the recovery job (which reads the stored
    policy) leaves it to be resumed, and its recorded step is not run again."""
    effects: list[str] = []
    key = new_key()
    _crashed("retry", key, effects)
    _crashed("resume", key, effects, with_step=True)
    record = IdempotencyRecord.objects.get()
    assert record.recovery_policy == "resume"
    assert recover_stale_leases().resumable == 1
    assert effects == ["shipped", "shipped"]  # the second attempt ran under "resume"
    run_once(lambda: "done", **IDENTITY, key=key, recovery="resume")
    assert effects == ["shipped", "shipped"]  # the recorded step was not run again


def test_the_same_policy_is_untouched():
    effects: list[str] = []
    key = new_key()
    _crashed("retry", key, effects)
    assert run_once(lambda: _noted(effects, "again", "ok"), **IDENTITY, key=key) == "ok"
    assert effects == ["shipped", "again"]


def _crash_a_charge(client: Any, headers: dict[str, str], path: str = "/charges/") -> str:
    with crash_after("tests.testapp.provider.charge"):
        client.post(path, CHARGE, content_type="application/json", headers=headers)
    return expire_lease(headers["Idempotency-Key"]).recovery_policy


def test_a_view_claimed_under_fail_is_not_run_again_after_the_setting_changed(user):
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}
    with override_settings(IDEMPOTENCY={"RECOVERY": "fail"}):
        assert _crash_a_charge(client, headers) == "fail"
    with override_settings(IDEMPOTENCY={"RECOVERY": "retry"}):
        answers = [
            client.post("/charges/", CHARGE, content_type="application/json", headers=headers)
            for _ in range(2)
        ]
    assert [a.status_code for a in answers] == [500, 500]
    assert {a.json()["code"] for a in answers} == {"idempotency_outcome_unknown"}
    assert (ProviderCall.objects.using("provider").count(), Charge.objects.count()) == (1, 0)


@postgres_only
def test_racing_retries_after_the_change_run_nothing(user):
    """Eight retries at once, on connections of their own, meet the stale claim made under
    ``"fail"``: one closes it, none runs the view."""
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}
    with override_settings(IDEMPOTENCY={"RECOVERY": "fail"}):
        _crash_a_charge(client, headers)
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8, timeout=30)

    def retry() -> None:
        start.wait()
        answer = logged_in(user).post(
            "/charges/", CHARGE, content_type="application/json", headers=headers
        )
        with lock:
            statuses.append(answer.status_code)

    with override_settings(IDEMPOTENCY={"RECOVERY": "retry"}):
        threads = [threading.Thread(target=in_thread(retry)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert len(statuses) == 8
    assert set(statuses) <= {409, 500}, statuses
    assert (ProviderCall.objects.using("provider").count(), Charge.objects.count()) == (1, 0)
    assert IdempotencyRecord.objects.get().status == RecordStatus.FAILED


def test_in_progress_is_still_in_progress():
    """A live claim under another policy is a duplicate in flight, as before."""
    key = new_key()
    entered, leave = threading.Event(), threading.Event()

    def held() -> str:
        entered.set()
        leave.wait(30)
        return "ok"

    if IdempotencyRecord.objects.db != "default":  # pragma: no cover
        pytest.skip("one database")
    thread = threading.Thread(
        target=in_thread(lambda: run_once(held, **IDENTITY, key=key, recovery="fail"))
    )
    thread.start()
    try:
        assert entered.wait(30)
        with pytest.raises(InProgress):
            run_once(lambda: "again", **IDENTITY, key=key, recovery="retry")
    finally:
        leave.set()
        thread.join(30)


def test_an_expired_record_starts_afresh_under_the_new_policy():
    """Past its TTL a record is absent: its replacement is claimed under today's policy,
    counts no recovery attempt, and runs (MySQL reads a column assigned earlier in the same
    ``SET`` as its new value: the takeover's ``CASE`` reads the old row everywhere)."""
    effects: list[str] = []
    key = new_key()
    run_once(lambda: _noted(effects, "first", 1), **IDENTITY, key=key, recovery="fail")
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run_once(lambda: _noted(effects, "again", 2), **IDENTITY, key=key) == 2
    record = IdempotencyRecord.objects.get()
    assert (record.recovery_policy, record.recovery_attempts) == ("retry", 0)
    assert effects == ["first", "again"]


@pytest.mark.parametrize("policy", ["fail", f"{__name__}.ask_the_provider", "resume"])
def test_an_expired_record_runs_again_as_a_new_request_whatever_its_policy(policy):
    """A retry after the TTL is a new request: never taken for a stale lease, whose recovery
    policy would close it ("fail": outcome unknown, without running) or answer for it."""
    effects: list[str] = []
    key = new_key()
    ASKED.clear()
    run_once(lambda: _noted(effects, "first", 1), **IDENTITY, key=key, recovery=policy)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run_once(lambda: _noted(effects, "again", 2), **IDENTITY, key=key, recovery=policy) == 2
    assert (effects, ASKED) == (["first", "again"], [])
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_a_view_retried_after_the_ttl_runs_again_under_fail(user):
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}

    def post() -> Any:
        return client.post(
            "/charges/fail-policy/", CHARGE, content_type="application/json", headers=headers
        )

    assert post().status_code == 201
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    again = post()
    assert again.status_code == 201, again.content
    assert Charge.objects.count() == 2


RACE = threading.Lock()


def not_shipped_after_a_while(record: IdempotencyRecord) -> Any:
    """A recovery callable: the provider, slow to answer, says nothing shipped."""
    with RACE:
        ASKED.append(record.pk)
    time.sleep(0.05)
    return None


def shipped_after_a_while(record: IdempotencyRecord) -> Any:
    with RACE:
        ASKED.append(record.pk)
    time.sleep(0.05)
    return {"shipped": "per the provider"}


@postgres_only
@pytest.mark.parametrize(
    ("claimed_under", "runs"),
    [
        ("fail", 0),
        (f"{__name__}.shipped_after_a_while", 0),
        (f"{__name__}.not_shipped_after_a_while", 1),
    ],
)
def test_retries_under_another_policy_and_two_recovery_jobs_race_on_one_stale_record(
    claimed_under, runs
):
    """Six retries under ``"retry"`` and two recovery jobs (which read the stored policy)
    start at once on one stale record: the body runs only where the stored policy allows
    it, and at most once."""
    effects: list[str] = []
    key = new_key()
    ASKED.clear()
    _crashed(claimed_under, key, effects)
    start = threading.Barrier(8, timeout=30)

    def body() -> str:
        with RACE:
            effects.append("again")
        time.sleep(0.05)
        return "ok"

    def retry() -> None:
        start.wait()
        with contextlib.suppress(IdempotencyError):
            run_once(body, **IDENTITY, key=key, recovery="retry")

    def job() -> None:
        start.wait()
        recover_stale_leases()

    threads = [threading.Thread(target=in_thread(retry)) for _ in range(6)]
    threads += [threading.Thread(target=in_thread(job)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert effects == ["shipped"] + ["again"] * runs
    record = IdempotencyRecord.objects.get()
    assert record.status == (
        RecordStatus.FAILED if claimed_under == "fail" else RecordStatus.COMPLETED
    )
    if claimed_under == "fail":
        assert ASKED == []


@pytest.mark.parametrize("point", [crash_before, crash_after])
def test_a_crash_beside_recording_the_new_policy_runs_nothing_twice(point):
    """The takeover under ``"retry"`` of a record claimed under a callable, which answers
    "run again": a crash before the new policy is recorded leaves the callable's record
    (the recovery job asks it again), one after it leaves a record under ``"retry"`` (the
    job releases it). The body never ran in that attempt, and runs once after."""
    effects: list[str] = []
    key = new_key()
    ASKED.clear()
    _crashed(f"{__name__}.not_shipped_after_a_while", key, effects)
    with point("django_idempotency._claims.Claim.record_policy"):
        run_once(lambda: effects.append("lost"), **IDENTITY, key=key, recovery="retry")
    record = expire_lease(key)
    expected = "retry" if point is crash_after else f"{__name__}.not_shipped_after_a_while"
    assert (record.recovery_policy, record.recovery_attempts) == (expected, 1)
    assert recover_stale_leases().released == 1
    assert run_once(lambda: _noted(effects, "again", "ok"), **IDENTITY, key=key) == "ok"
    assert effects == ["shipped", "again"]
    assert len(ASKED) == (1 if point is crash_after else 2)
