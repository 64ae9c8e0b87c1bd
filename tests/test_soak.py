"""Soak: mixed traffic from many threads against gunicorn, with purge and recovery running.

New keys, replays, concurrent duplicates, payload mismatches, workers killed at every stage
(under the ``"retry"`` and the ``"fail"`` policy) and short-TTL keys that expire and are
purged during the run. At the end every key's side-effect count is exactly what it should
be, no record is left in progress, and only unexpired records remain.

Runs only with ``RUN_SOAK=1`` (CI: ``make soak``, which is ``RUN_SOAK=1 SOAK_SECONDS=120
pytest -m soak -s``); lasts ``SOAK_SECONDS`` (default 20) plus the time to settle.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connections
from django.db.models import Count
from django.utils import timezone

from django_idempotency import maintenance, states
from django_idempotency.models import IdempotencyRecord
from tests.helpers import FAIL_PATH, LEASE_SECONDS, RETRY_PATH, Caller, postgres_only, settle
from tests.live import DISCONNECTED, Answer, gunicorn, request
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

SECONDS = float(os.environ.get("SOAK_SECONDS", "20"))
CLIENTS = 8
SHORT_TTL_PATH = "/faults/charges/short-ttl/"  # lease 1 s, TTL 3 s
SHORT_TTL_SECONDS = 3
OPERATIONS = {
    RETRY_PATH: "faults.charge",
    FAIL_PATH: "faults.charge-fail",
    SHORT_TTL_PATH: "faults.charge-short-ttl",
}
# Stages at which a worker is killed, per path, and whether the provider was called by then.
CRASHES = {
    RETRY_PATH: ["kill-start", "kill-after-provider", "kill-before-commit", "kill-after-commit"],
    FAIL_PATH: ["kill-start", "kill-after-provider", "kill-before-commit"],
}
PROVIDER_CALLED = {
    "kill-start": False,
    "kill-after-provider": True,
    "kill-before-commit": True,
    "kill-after-commit": True,
}
# A killed worker takes about a second of CPU to respawn: at most one kill per interval.
CRASH_INTERVAL = 1.5

pytestmark = [
    pytest.mark.soak,
    pytest.mark.skipif(os.environ.get("RUN_SOAK") != "1", reason="set RUN_SOAK=1 to soak"),
    pytest.mark.timeout(SECONDS + 240),
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
]


@dataclass
class Key:
    """What the clients did with one key, and so what must be true of it in the end."""

    caller: Caller
    path: str
    amount: int
    fresh: int = 0  # answers that ran the view (not replayed)
    lost: int = 0  # attempts that outlived their lease: rolled back, answered 409
    body: bytes | None = None  # the answer every replay must repeat
    status: int | None = None
    crashed_at: str | None = None
    crash_time: float = 0.0
    touched: float = field(default_factory=time.monotonic)

    def payload(self, amount: int | None = None) -> dict[str, Any]:
        return {"amount": amount or self.amount, "currency": "EUR"}

    def send(self, url: str, directives: str = "", amount: int | None = None) -> Answer:
        self.touched = time.monotonic()
        headers = self.caller.headers(directives)
        return request(url, "POST", self.path, self.payload(amount), headers, timeout=30)

    def send_until_answered(self, url: str) -> Answer:
        """Like a good client: back off on 409 and send again.

        On a loaded machine an attempt can outlive its (short) lease; the recovery job then
        releases its claim, and the attempt is rolled back and answered 409 lease lost.
        """
        deadline = time.monotonic() + 60
        while True:
            answer = self.send(url)
            if answer.status != 409 or time.monotonic() > deadline:
                return answer
            if answer.json().get("code") == "idempotency_lease_lost":
                self.lost += 1
            time.sleep(0.2)


class Soak:
    """The shared state of the client threads: keys by kind, violations, counters."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.settled: list[Key] = []  # outcome known: replays and mismatches go here
        self.crashed: list[Key] = []  # waiting for their lease, then a settling retry
        self.all: list[Key] = []
        self.violations: list[str] = []
        self.actions: Counter[str] = Counter()
        self.last_crash = 0.0

    def fail(self, key: Key, what: str, answer: Answer) -> None:
        with self.lock:
            self.violations.append(
                f"{what}: {key.path} {key.caller.key} -> {answer.status} {answer.body[:160]!r}"
            )

    def new_key(self, path: str) -> Key:
        key = Key(Caller.new(), path, amount=random.choice([100, 200, 300]))
        with self.lock:
            self.all.append(key)
        return key

    def first_answer(self, key: Key, answer: Answer) -> None:
        """The one answer that ran the view: remembered for the replays."""
        if answer.status != 201 or answer.replayed:
            self.fail(key, "first request did not run", answer)
            return
        key.fresh += 1
        key.body, key.status = answer.body, answer.status
        with self.lock:
            self.settled.append(key)

    # -- actions ---------------------------------------------------------------------------

    def new(self) -> None:
        key = self.new_key(RETRY_PATH)
        self.first_answer(key, key.send_until_answered(self.url))

    def replay(self) -> None:
        with self.lock:
            if not self.settled:
                return
            key = random.choice(self.settled)
        answer = key.send(self.url)
        if not answer.replayed or answer.status != key.status or answer.body != key.body:
            self.fail(key, "replay differs", answer)

    def mismatch(self) -> None:
        with self.lock:
            candidates = [k for k in self.settled if k.path == RETRY_PATH]
            if not candidates:
                return
            key = random.choice(candidates)
        answer = key.send(self.url, amount=key.amount + 1)
        if answer.status != 422 or answer.json().get("code") != "idempotency_key_reused":
            self.fail(key, "mismatch not refused", answer)

    def duplicates(self) -> None:
        key = self.new_key(RETRY_PATH)
        with ThreadPoolExecutor(max_workers=3) as pool:
            answers = list(pool.map(lambda _: key.send(self.url), range(3)))
        answers.append(settle(self.url, key.path, key.caller.headers(), key.payload()))
        fresh = [a for a in answers if a.status == 201 and not a.replayed]
        if len(fresh) != 1 or any(a.status not in (201, 409) for a in answers):
            self.fail(key, f"duplicates: {[(a.status, a.replayed) for a in answers]}", answers[0])
            return
        self.first_answer(key, fresh[0])

    def crash(self) -> None:
        with self.lock:
            if time.monotonic() - self.last_crash < CRASH_INTERVAL:
                return
            self.last_crash = time.monotonic()
        path = random.choice([RETRY_PATH, FAIL_PATH])
        key = self.new_key(path)
        key.crashed_at = random.choice(CRASHES[path])
        answer = key.send(self.url, key.crashed_at)
        if answer is not DISCONNECTED:
            self.fail(key, "the worker did not die", answer)
            return
        key.crash_time = time.monotonic()
        with self.lock:
            self.crashed.append(key)

    def recover(self, force: bool = False) -> None:
        """A crashed key whose lease has run out gets the retry of a patient client."""
        with self.lock:
            ready = [
                k
                for k in self.crashed
                if force or time.monotonic() - k.crash_time > LEASE_SECONDS + 0.2
            ]
            if not ready:
                return
            key = ready[0]
            self.crashed.remove(key)
        answer = settle(self.url, key.path, key.caller.headers(), key.payload(), seconds=60)
        if key.path == FAIL_PATH:
            if answer.status != 500 or answer.json().get("code") != "idempotency_outcome_unknown":
                self.fail(key, "fail policy did not report an unknown outcome", answer)
                return
        elif answer.status != 201:
            self.fail(key, "retry after a crash did not charge", answer)
            return
        elif not answer.replayed:
            key.fresh += 1
        key.body, key.status = answer.body, answer.status
        with self.lock:
            self.settled.append(key)

    def short_lived(self) -> None:
        key = self.new_key(SHORT_TTL_PATH)
        for _ in range(random.randint(1, 3)):
            answer = key.send_until_answered(self.url)
            if answer.status != 201:
                self.fail(key, "short-TTL key not answered", answer)
                return
            if not answer.replayed:
                key.fresh += 1  # the first request, or one after the TTL ran out
            time.sleep(random.uniform(0, 2))

    ACTIONS = (
        ("new", 30),
        ("replay", 25),
        ("mismatch", 8),
        ("duplicates", 10),
        ("crash", 6),
        ("recover", 10),
        ("short_lived", 11),
    )

    def client(self, deadline: float) -> None:
        names = [name for name, _ in self.ACTIONS]
        weights = [weight for _, weight in self.ACTIONS]
        while time.monotonic() < deadline and len(self.violations) < 50:
            name = random.choices(names, weights)[0]
            self.actions[name] += 1
            getattr(self, name)()


class Background(threading.Thread):
    """Runs a maintenance job every half second until stopped, as beat would."""

    def __init__(self, job: Any) -> None:
        super().__init__(daemon=True)
        self.job = job
        self.stopped = threading.Event()
        self.results: list[Any] = []
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.5):
                try:
                    self.results.append(self.job())
                except Exception as exc:  # reported by the test
                    self.errors.append(exc)
        finally:
            connections.close_all()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)
        assert not self.is_alive()


@pytest.fixture
def server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), gunicorn(workers=3) as url:
        yield url


def test_soak(server):
    soak = Soak(server)
    purger = Background(lambda: maintenance.purge_expired(batch_size=20))
    recoverer = Background(maintenance.recover_stale_leases)
    purger.start()
    recoverer.start()
    try:
        deadline = time.monotonic() + SECONDS
        with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
            for done in [pool.submit(soak.client, deadline) for _ in range(CLIENTS)]:
                done.result(timeout=SECONDS + 120)
        while soak.crashed:
            time.sleep(0.2)
            soak.recover(force=time.monotonic() > deadline + 30)
        # Let every short-TTL record expire, so the purge has the last word.
        last_short = max((k.touched for k in soak.all if k.path == SHORT_TTL_PATH), default=0)
        time.sleep(max(0.0, last_short + SHORT_TTL_SECONDS + 2 - time.monotonic()))
    finally:
        purger.stop()
        recoverer.stop()
    assert not purger.errors
    assert not recoverer.errors
    maintenance.recover_stale_leases()
    maintenance.purge_expired()

    assert not soak.violations, "\n".join(soak.violations[:20])
    kinds = Counter(k.path for k in soak.all)
    crashes = Counter(k.crashed_at for k in soak.all if k.crashed_at)
    print(  # the CI log shows what the soak did
        f"soak {SECONDS:.0f}s: actions {dict(soak.actions)}, keys {dict(kinds)}, "
        f"crashes {dict(crashes)}, lease losses {sum(k.lost for k in soak.all)}, "
        f"purged {sum(r.deleted for r in purger.results)}, "
        f"recovered {Counter(o for r in recoverer.results for o in _outcomes(r))}"
    )
    assert crashes
    assert kinds[SHORT_TTL_PATH]
    assert kinds[FAIL_PATH]
    now = timezone.now()
    # No record left in progress, only unexpired records, and the purge ran beside traffic.
    assert not IdempotencyRecord.objects.filter(status=states.IN_PROGRESS).exists()
    assert not IdempotencyRecord.objects.filter(expires_at__lte=now).exists()
    assert sum(r.deleted for r in purger.results) > 0
    assert_effects(soak.all)
    assert_replays(server, [k for k in soak.all if k.path != SHORT_TTL_PATH])


def _outcomes(result: maintenance.RecoveryResult) -> list[str]:
    return ["released"] * result.released + ["failed"] * result.failed


def assert_effects(keys: list[Key]) -> None:
    """Each key's local charges, provider charges and provider calls, exactly."""
    charges = dict(
        Charge.objects.values_list("account").annotate(n=Count("id")).values_list("account", "n")
    )
    ledger = set(ProviderCharge.objects.values_list("key", flat=True))
    calls = Counter(ProviderCall.objects.values_list("key", flat=True))
    records = dict(
        IdempotencyRecord.objects.values_list("account", "status").filter(
            account__in=[k.caller.tenant for k in keys]
        )
    )
    wrong = []
    expected: tuple[object, ...]
    actual: tuple[object, ...]
    for key in keys:
        downstream = key.caller.downstream_key(OPERATIONS[key.path])
        provider = downstream in ledger
        local = charges.get(key.caller.tenant, 0)
        if key.path == FAIL_PATH:
            expected = (0, PROVIDER_CALLED[key.crashed_at or ""], states.FAILED)
            actual = (local, provider, records.get(key.caller.tenant))
        elif key.path == SHORT_TTL_PATH:
            # The TTL ran out between some requests: each fresh run charged locally, the
            # provider deduplicated them all (attempts that lost their lease called it
            # too, then rolled back), and the purge removed the record.
            expected = (key.fresh, True, None, key.fresh + key.lost)
            actual = (local, provider, records.get(key.caller.tenant), calls[downstream])
        else:
            expected = (1, True, states.COMPLETED)
            actual = (local, provider, records.get(key.caller.tenant))
        if actual != expected:
            wrong.append(f"{key.path} {key.crashed_at}: {actual} != {expected}")
    assert not wrong, f"{len(wrong)} of {len(keys)} keys:\n" + "\n".join(wrong[:20])
    assert sum(charges.values()) == sum(
        1 if k.path == RETRY_PATH else k.fresh if k.path == SHORT_TTL_PATH else 0 for k in keys
    )


def assert_replays(url: str, keys: list[Key], sample: int = 150) -> None:
    """After the soak, a sample of keys still replays its first answer, byte for byte."""
    for key in random.sample(keys, min(sample, len(keys))):
        answer = key.send(url)
        assert answer.replayed, (key.path, key.crashed_at, answer.status)
        assert (answer.status, answer.body) == (key.status, key.body)
