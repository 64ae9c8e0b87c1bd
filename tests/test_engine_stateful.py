"""Property-based, stateful tests of the engine's state machine.

Random interleavings of full requests (through the decorator and the engine), claims left
in flight, completions of those claims (fenced, in the same transaction as their effect),
crashes and clock moves, checked against a model of the invariants in DESIGN.md:
at most one committed effect per key and generation, replays equal to the first outcome,
mismatches refused, live leases respected.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client, RequestFactory
from django.urls import resolve
from django.utils import timezone
from freezegun import freeze_time
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from django_idempotency import _store
from django_idempotency._context import IdempotencyContext, Operation
from django_idempotency.fingerprint import default_fingerprint
from django_idempotency.models import IdempotencyRecord
from tests.helpers import examples
from tests.testapp.models import Charge

# Imported before the clock is frozen: psycopg's C module checks datetime's layout.
with contextlib.suppress(ImportError):
    import django.db.backends.postgresql.psycopg_any  # noqa: F401

PATH = "/charges/tenant/"
OPERATION = "POST charges/tenant/"
LEASE = timedelta(seconds=60)
TTL = timedelta(hours=24)
ACCOUNTS = ("t1", "t2")
KEYS = ("k1", "k2")
PAYLOADS = ({"amount": 1, "currency": "EUR"}, {"amount": 2, "currency": "EUR"})


def fingerprint(account: str, key: str, payload: dict) -> str:
    request = RequestFactory().post(PATH, json.dumps(payload), content_type="application/json")
    request.resolver_match = resolve(PATH)
    request.idempotency = IdempotencyContext(key=key, operation=OPERATION, account=account)
    return default_fingerprint(request)


@dataclass
class Slot:
    """The model's view of one (account, key)."""

    status: str | None = None
    owner: object = None
    payload: int | None = None
    lease_expires: object = None
    expires: object = None
    body: bytes | None = None
    effects: int = 0  # committed in the current generation


@dataclass
class Attempt:
    account: str
    key: str
    payload: int
    record_id: int
    token: object
    owner: object = field(default_factory=object)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        IdempotencyRecord.objects.all().delete()
        Charge.objects.all().delete()
        self.freezer = freeze_time(timezone.now(), tick=False)
        self.clock = self.freezer.start()
        self.slots = {(a, k): Slot() for a in ACCOUNTS for k in KEYS}
        self.attempts: list[Attempt] = []
        self.total_effects = 0
        self.client = Client()

    def teardown(self) -> None:
        self.freezer.stop()

    def now(self):
        return timezone.now()

    def _live(self, slot: Slot) -> bool:
        return slot.status == "in_progress" and slot.lease_expires > self.now()

    def _absent(self, slot: Slot) -> bool:
        return slot.status is None or (slot.expires <= self.now() and not self._live(slot))

    def _fresh_generation(self, slot: Slot) -> None:
        slot.effects = 0
        slot.body = None

    def _claim_outcome(self, slot: Slot, payload: int) -> str:
        """What a claim must do now: 'new', 'takeover', 'replay', 'mismatch' or 'conflict'."""
        if self._absent(slot):
            return "new"
        if slot.payload != payload:
            return "mismatch"
        if slot.status == "completed":
            return "replay"
        return "conflict" if self._live(slot) else "takeover"

    def _take(self, slot: Slot, outcome: str, payload: int, owner: object) -> None:
        if outcome == "new":
            self._fresh_generation(slot)
        slot.status, slot.owner, slot.payload = "in_progress", owner, payload
        slot.lease_expires = self.now() + LEASE
        slot.expires = self.now() + TTL  # a takeover is a new claim: the TTL starts again

    @rule(account=st.sampled_from(ACCOUNTS), key=st.sampled_from(KEYS), payload=st.integers(0, 1))
    def full_request(self, account, key, payload):
        slot = self.slots[(account, key)]
        expected = self._claim_outcome(slot, payload)
        response = self.client.post(
            PATH,
            json.dumps(PAYLOADS[payload]),
            content_type="application/json",
            headers={"X-Tenant": account, "Idempotency-Key": key},
        )
        if expected in ("new", "takeover"):
            assert response.status_code == 201, (expected, response.content)
            assert "Idempotent-Replayed" not in response
            self._take(slot, expected, payload, "request")
            slot.status, slot.owner, slot.body = "completed", None, response.content
            slot.effects += 1
            self.total_effects += 1
        elif expected == "replay":
            assert response.status_code in (201, 200), response.content
            assert response["Idempotent-Replayed"] == "true"
            assert slot.body is None or response.content == slot.body
            slot.body = response.content
        elif expected == "mismatch":
            assert response.status_code == 422
            assert json.loads(response.content)["code"] == "idempotency_key_reused"
        else:
            assert response.status_code == 409
            assert json.loads(response.content)["code"] == "idempotency_key_in_use"

    @rule(account=st.sampled_from(ACCOUNTS), key=st.sampled_from(KEYS), payload=st.integers(0, 1))
    def begin(self, account, key, payload):
        """A claim whose view is still running (or whose process is about to die)."""
        slot = self.slots[(account, key)]
        expected = self._claim_outcome(slot, payload)
        result = _store.claim(
            Operation(
                alias=connection.alias,
                account=account,
                operation=OPERATION,
                key=key,
                request_hash=fingerprint(account, key, PAYLOADS[payload]),
                fingerprint_version="v1",
                recovery_policy="retry",
                lease=LEASE,
                ttl=TTL,
            ),
            self.now(),
        )
        assert result.claimed == (expected in ("new", "takeover")), expected
        if result.claimed:
            attempt = Attempt(account, key, payload, result.state.id, result.state.lease_token)
            self._take(slot, expected, payload, attempt.owner)
            self.attempts.append(attempt)
        else:
            status = {"replay": "completed", "conflict": "in_progress"}.get(expected)
            if status:
                assert result.state.status == status

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def complete(self, data):
        """The view finishes: its effect and the fenced completion share one transaction."""
        attempt = self.attempts.pop(data.draw(st.integers(0, len(self.attempts) - 1)))
        slot = self.slots[(attempt.account, attempt.key)]
        body = json.dumps({"attempt": id(attempt.owner)}).encode()
        committed = True
        try:
            with transaction.atomic():
                Charge.objects.create(account=attempt.account, amount=1, currency="EUR")
                if not _store.complete(
                    connection.alias,
                    attempt.record_id,
                    attempt.token,
                    status="completed",
                    response_status=201,
                    response_headers=[["Content-Type", "application/json"]],
                    response_body=body,
                    now=self.now(),
                ):
                    raise LookupError
        except LookupError:
            committed = False
        owns = slot.owner is attempt.owner and slot.status == "in_progress"
        assert committed == owns
        if committed:
            slot.status, slot.owner, slot.body = "completed", None, body
            slot.effects += 1
            self.total_effects += 1

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def view_fails(self, data):
        """A 5xx or an exception: rolled back and released, if the attempt still owns it."""
        attempt = self.attempts.pop(data.draw(st.integers(0, len(self.attempts) - 1)))
        slot = self.slots[(attempt.account, attempt.key)]
        released = _store.release(connection.alias, attempt.record_id, attempt.token)
        owns = slot.owner is attempt.owner and slot.status == "in_progress"
        assert released == owns
        if released:
            slot.status, slot.owner = None, None

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def crash(self, data):
        """The process dies: nothing more happens; the lease will run out."""
        self.attempts.pop(data.draw(st.integers(0, len(self.attempts) - 1)))

    @rule(seconds=st.sampled_from([1, 30, 59, 61, 3600, 86399, 86401]))
    def advance(self, seconds):
        self.clock.tick(timedelta(seconds=seconds))

    @invariant()
    def at_most_one_effect_per_generation(self):
        for slot in self.slots.values():
            assert slot.effects <= 1

    @invariant()
    def effects_in_the_database_match(self):
        assert Charge.objects.count() == self.total_effects

    @invariant()
    def records_match_the_model(self):
        for (account, key), slot in self.slots.items():
            record = IdempotencyRecord.objects.filter(
                account=account, operation=OPERATION, key=key
            ).first()
            if slot.status is None:
                assert record is None
            else:
                assert record is not None
                assert record.status == slot.status


EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STATEFUL_EXAMPLES", examples(40))),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# Longer than the suite's 120 s: 40 examples of 30 steps took 17.6 s alone on PostgreSQL,
# and over 120 s in CI beside seven other processes on two cores.
@pytest.mark.timeout(600)
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_engine_state_machine():
    EngineMachine.TestCase().runTest()
