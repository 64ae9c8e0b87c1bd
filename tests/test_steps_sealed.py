"""Step results sealed at rest: with ``ENCRYPTION_KEYS`` set, ``step()`` records its result
sealed with the first key (in the one statement that records it), a later attempt opens it
with any configured key, a result recorded in the clear still reads, one that no key opens
is refused without the step running again, the rotation reseals them, and ``check``, the
stats and the admin see them. Every test counts the steps' calls."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from io import StringIO
from typing import Any, cast

import pytest
from django.core import checks
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from django_idempotency import RecordUnreadable, crypto, run_once, step
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from tests.factories import RecordFactory, UserFactory
from tests.helpers import LOST, NEW, OLD, in_thread, keys, postgres_only

fernet = pytest.importorskip("cryptography.fernet")

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

SECRET = "Ada Lovelace, card ending 4242"
IDENTITY = {"account": "worker", "operation": "book"}
WAIT = 30


class Body:
    """A resumable body of two steps whose first attempt dies after the first step; the
    calls of each step are counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.die = True

    def charge(self) -> dict[str, str]:
        self.calls.append("charge")
        return {"charge": "ch_1", "card": SECRET}

    def receipt(self, charge: dict[str, str]) -> str:
        self.calls.append("receipt")
        return f"receipt for {charge['charge']}"

    def __call__(self) -> dict[str, Any]:
        charge = step("charge", self.charge)
        if self.die:
            raise RuntimeError("dies after its first step")
        return {"charge": charge, "receipt": step("receipt", self.receipt, charge)}

    def first_attempt(self, key: str) -> None:
        with pytest.raises(RuntimeError):
            run_once(self, **IDENTITY, key=key, recovery="resume")
        self.die = False

    def resume(self, key: str) -> dict[str, Any]:
        return dict(run_once(self, **IDENTITY, key=key, recovery="resume"))


def stored(name: str = "charge") -> str:
    return str(IdempotencyStep.objects.get(name=name).result)


def test_a_step_result_is_recorded_sealed_with_the_first_key_and_read_with_any():
    body = Body()
    with keys(NEW, OLD):
        body.first_attempt("s-1")
    result = stored()
    assert SECRET not in result
    assert "ch_1" not in result
    assert result.startswith(f"fernet:{crypto.key_id(NEW)}:")
    with keys(OLD, NEW):  # the sealing key is no longer the first: it still opens
        answer = body.resume("s-1")
    assert answer["charge"] == {"charge": "ch_1", "card": SECRET}
    assert answer["receipt"] == "receipt for ch_1"
    assert body.calls == ["charge", "receipt"]
    assert stored("receipt").startswith(f"fernet:{crypto.key_id(OLD)}:")


def test_a_result_recorded_in_the_clear_before_keys_were_set_still_reads():
    body = Body()
    body.first_attempt("s-2")
    assert json.loads(stored()) == {"charge": "ch_1", "card": SECRET}
    with keys(NEW):
        assert body.resume("s-2")["charge"]["card"] == SECRET
    assert body.calls == ["charge", "receipt"]


def test_sealing_adds_no_statement_to_a_step():
    runs = iter(range(10))

    def statements(*configured: str) -> list[str]:
        body = Body()
        body.die = False
        with keys(*configured), CaptureQueriesContext(connection) as queries:
            body.resume(f"q-{next(runs)}")
        assert body.calls == ["charge", "receipt"]
        return [q["sql"].split()[0] for q in queries.captured_queries]

    statements()  # the process's first operation reads what it caches
    assert statements(NEW) == statements()


@pytest.mark.parametrize("how", ["key-removed", "keys-emptied", "damaged-token", "damaged-label"])
def test_a_result_no_key_opens_is_refused_and_the_step_never_runs_again(how):
    body = Body()
    with keys(OLD):
        body.first_attempt("s-3")
    sealed = stored()
    if how == "damaged-token":
        position = len(sealed) - 10
        broken = sealed[:position] + ("A" if sealed[position] != "A" else "B")
        IdempotencyStep.objects.update(result=broken + sealed[position + 1 :])
    if how == "damaged-label":
        IdempotencyStep.objects.update(result="fernet:" + sealed[len("fernet:") + 12 :])
    reading = {"key-removed": (NEW,), "keys-emptied": ()}.get(how, (OLD,))
    for _ in range(2):  # the record is left for the next attempt, refused the same way
        with keys(*reading), pytest.raises(RecordUnreadable) as raised:
            body.resume("s-3")
        if how in ("key-removed", "keys-emptied"):
            assert raised.value.key_id == crypto.key_id(OLD)
        assert body.calls == ["charge"]
    if how in ("key-removed", "keys-emptied"):
        with keys(NEW, OLD):  # the key configured again: the operation resumes
            assert body.resume("s-3")["charge"]["card"] == SECRET
        assert body.calls == ["charge", "receipt"]


# -- the rotation ---------------------------------------------------------------------------


def steps_under(key: str | None, key_prefix: str, n: int) -> None:
    for i in range(n):
        body = Body()
        if key is None:
            body.first_attempt(f"{key_prefix}-{i}")
        else:
            with keys(key):
                body.first_attempt(f"{key_prefix}-{i}")


def sealed_under(key: str, text: str) -> str:
    """A result as a server holding only ``key`` records it."""
    sealing = crypto.keys_of((key,))
    return f"fernet:{sealing.first}:{sealing.fernet.encrypt(text.encode()).decode()}"


def opened_with(configured: tuple[str, ...], result: str) -> str:
    """A recorded result as its step returned it (JSON text)."""
    if not result.startswith("fernet:"):
        return result
    return str(crypto.keys_of(configured).fernet.decrypt(result.split(":", 2)[2]).decode())


def step_key_ids() -> dict[str | None, int]:
    counted: dict[str | None, int] = {}
    for result in IdempotencyStep.objects.values_list("result", flat=True):
        kid = result.split(":")[1] if result.startswith("fernet:") else None
        counted[kid] = counted.get(kid, 0) + 1
    return counted


def rotate(*args: str) -> str:
    out = StringIO()
    call_command("rotate_idempotency_encryption", *args, stdout=out)
    return out.getvalue()


def test_the_rotation_reseals_step_results_counts_them_and_leaves_the_unreadable():
    steps_under(None, "clear", 2)
    steps_under(OLD, "old", 3)
    steps_under(NEW, "new", 1)
    steps_under(LOST, "lost", 1)
    IdempotencyStep.objects.create(
        record=IdempotencyRecord.objects.get(key="clear-0"), name="damaged", result="{nope"
    )
    with keys(NEW, OLD):
        before = {
            pk: opened_with((NEW, OLD), result)
            for pk, result in IdempotencyStep.objects.exclude(record__key="lost-0")
            .exclude(name="damaged")
            .values_list("pk", "result")
        }
        dry = rotate("--dry-run", "--batch-size", "2")
        assert step_key_ids() == {
            None: 3,
            crypto.key_id(OLD): 3,
            crypto.key_id(NEW): 1,
            crypto.key_id(LOST): 1,
        }
        line = rotate("--batch-size", "2")
        after = {pk: opened_with((NEW,), stored) for pk, stored in _results(before)}
        again = rotate()
    assert "Would seal 5 step results" in dry
    assert "Sealed 5 step results" in line
    assert "1 were sealed with it already" in line
    assert "2 are sealed with a key ENCRYPTION_KEYS no longer holds" in line
    assert "Sealed 0 step results" in again
    assert after == before
    assert step_key_ids() == {crypto.key_id(NEW): 6, crypto.key_id(LOST): 1, None: 1}
    assert stored("damaged") == "{nope"


def _results(before: dict[int, Any]) -> list[tuple[int, str]]:
    return list(IdempotencyStep.objects.filter(pk__in=before).values_list("pk", "result"))


@postgres_only
def test_two_rotations_at_once_seal_each_step_result_once():
    rows = 60
    record = cast(IdempotencyRecord, RecordFactory(key="k", recovery_policy="resume"))
    IdempotencyStep.objects.bulk_create(
        IdempotencyStep(record=record, name=f"s-{n}", result=sealed_under(OLD, json.dumps(n)))
        for n in range(rows)
    )
    go = threading.Event()

    def rotation() -> int:
        assert go.wait(WAIT)
        line = rotate("--batch-size", "5")
        return int(line.split("Sealed ")[2].split(" step results")[0])

    with keys(NEW, OLD), ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(in_thread(rotation)) for _ in range(2)]
        go.set()
        results = [run.result(timeout=WAIT * 4) for run in runs]
        opened = sorted(
            json.loads(opened_with((NEW,), r))
            for r in IdempotencyStep.objects.values_list("result", flat=True)
        )
    assert sum(results) == rows  # each counted by the run that sealed it
    assert opened == list(range(rows))
    assert step_key_ids() == {crypto.key_id(NEW): rows}


# -- check, the stats, the admin ---------------------------------------------------------


def test_check_and_the_stats_count_step_results_sealed_with_a_missing_key():
    steps_under(OLD, "s", 2)
    # The operation of one completes: its outcome is sealed with the missing key too.
    completing = Body()
    completing.die = False
    with keys(OLD):
        completing.resume("s-1")
    with keys(NEW):
        (error,) = [
            m for m in checks.run_checks(databases=["default"]) if m.id == "django_idempotency.E026"
        ]
        out = StringIO()
        call_command("idempotency_stats", "--json", stdout=out)
    assert crypto.key_id(OLD) in error.msg
    assert "3 step results" in error.msg  # s-0's charge, s-1's charge and receipt
    stats = json.loads(out.getvalue())
    assert stats["unreadable_steps"] == 3
    assert stats["unreadable_steps_by_key"] == {crypto.key_id(OLD): 3}
    with keys(NEW, OLD):
        assert [m for m in checks.run_checks(databases=["default"]) if m.id.endswith("E026")] == []


def admin_page(record: IdempotencyRecord, superuser: bool = True) -> str:
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=superuser))
    response = client.get(f"/admin/django_idempotency/idempotencyrecord/{record.pk}/change/")
    assert response.status_code == 200
    return str(response.content.decode())


def test_the_admin_shows_sealed_results_opened_and_says_when_they_cannot_be_read():
    body = Body()
    with keys(NEW):
        body.first_attempt("a-1")
    record = IdempotencyRecord.objects.get(key="a-1")
    with keys(NEW):
        html = admin_page(record)
    assert SECRET in html
    assert "ch_1" in html
    with keys(OLD):
        html = admin_page(record)
    assert SECRET not in html
    assert "Cannot be read" in html
    assert crypto.key_id(NEW) in html
    assert body.calls == ["charge"]
