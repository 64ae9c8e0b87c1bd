"""``rotate_idempotency_encryption``: every stored response sealed with the first key, in
bounded batches, beside live claims and completions."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.utils import timezone

from django_idempotency import crypto, maintenance
from django_idempotency.models import IdempotencyAuditRecord, IdempotencyRecord
from tests.factories import RecordFactory
from tests.helpers import (
    LOST,
    NEW,
    OLD,
    PAYLOAD,
    ApiClient,
    answered,
    fingerprint_of,
    in_thread,
    keys,
    postgres_only,
)
from tests.testapp.models import Charge

fernet = pytest.importorskip("cryptography.fernet")

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")
WAIT = 30


def sealed(key: str, headers: list[list[str]], body: bytes) -> tuple[str, bytes]:
    """A response as a server holding only ``key`` stores it."""
    return crypto._seal(crypto.keys_of((key,)), headers, body)


def record_under(key: str | None, n: int, **fields: Any) -> IdempotencyRecord:
    headers: Any = [["Content-Type", "application/json"]]
    body = json.dumps({"n": n}).encode()
    if key is not None:
        headers, body = sealed(key, headers, body)
    return RecordFactory(
        key=f"r-{n}",
        response_headers=headers,
        response_body=body,
        completed_at=timezone.now(),
        **fields,
    )


def key_ids(model: type[Any] = IdempotencyRecord) -> dict[str | None, int]:
    counted: dict[str | None, int] = {}
    for headers in model.objects.exclude(status="in_progress").values_list(
        "response_headers", flat=True
    ):
        kid = crypto.sealed_with(headers)
        counted[kid] = counted.get(kid, 0) + 1
    return counted


def opened(record: IdempotencyRecord) -> tuple[Any, Any]:
    return crypto.open_response(record.response_headers, record.response_body)


def rotate(*args: str) -> str:
    out = StringIO()
    call_command("rotate_idempotency_encryption", *args, stdout=out)
    return out.getvalue()


def test_the_command_seals_clear_and_old_responses_in_batches_and_leaves_the_rest():
    for n in range(3):
        record_under(None, n)
    for n in range(3, 7):
        record_under(OLD, n)
    record_under(NEW, 7)
    record_under(LOST, 8)
    held = RecordFactory(
        key="held",
        status="in_progress",
        lease_token=uuid.UUID("6c3f4d1e-2b8a-4c9d-9e0f-1a2b3c4d5e6f"),
        lease_expires_at=timezone.now() + timedelta(seconds=30),
        response_status=None,
        response_headers=[],
        response_body=None,
    )
    IdempotencyAuditRecord.objects.create(
        record_id=99, account="a", operation="o", key="k", request_hash="0" * 64,
        fingerprint_version="v1", status="completed", recovery_policy="retry",
        recovery_attempts=0, response_status=200, response_headers=[["Content-Type", "x/y"]],
        response_body=b"audited", created_at=timezone.now(), expires_at=timezone.now(),
        reason="purged",
    )  # fmt: skip
    readable = IdempotencyRecord.objects.exclude(key__in=["held", "r-8"])
    with keys(NEW, OLD):
        before = {r.key: opened(r) for r in readable}
        dry = rotate("--dry-run", "--batch-size", "2")
        assert key_ids() == {None: 3, crypto.key_id(OLD): 4, crypto.key_id(NEW): 1,
                             crypto.key_id(LOST): 1}  # fmt: skip
        line = rotate("--batch-size", "2", "-v", "2")
        after = {r.key: opened(r) for r in readable.all()}
        again = rotate()
    assert "Would seal 7 idempotency records and 1 audit records" in dry
    assert f"Sealed 7 idempotency records and 1 audit records with key {crypto.key_id(NEW)}" in line
    assert "1 were sealed with it already" in line
    assert "1 are sealed with a key ENCRYPTION_KEYS no longer holds" in line
    assert "batch 1: " in line
    assert "Sealed 0 idempotency records and 0 audit records" in again
    assert "9 were sealed with it already" in again  # 8 records and the audit record
    assert after == before
    assert key_ids() == {crypto.key_id(NEW): 8, crypto.key_id(LOST): 1}
    assert key_ids(IdempotencyAuditRecord) == {crypto.key_id(NEW): 1}
    with keys(NEW):
        (audit,) = IdempotencyAuditRecord.objects.all()
        assert opened(audit) == ([["Content-Type", "x/y"]], b"audited")
    # The claim in progress was not touched: no response to seal, its lease as it was.
    held_now = IdempotencyRecord.objects.get(key="held")
    assert (held_now.lease_token, held_now.lease_expires_at, held_now.response_headers) == (
        held.lease_token,
        held.lease_expires_at,
        [],
    )


def test_batches_follow_the_batch_size_and_the_rows_of_each_table():
    for n in range(5):
        record_under(OLD, n)
    with keys(NEW, OLD):
        result = maintenance.rotate_encryption(batch_size=2)
    # 5 records in batches of 2 (2, 2, 1); the audit table is empty.
    assert (result.records, result.batches) == (5, 3)


def test_the_command_refuses_without_keys_and_with_an_unknown_database():
    record_under(None, 1)
    with pytest.raises(CommandError, match="ENCRYPTION_KEYS'] is empty"):
        rotate()
    with keys(NEW), pytest.raises(CommandError, match="Unknown database 'nope'"):
        rotate("--database", "nope")
    with pytest.raises(CommandError):
        rotate("--batch-size", "0")
    assert key_ids() == {None: 1}


def test_a_completion_between_the_batch_read_and_its_write_is_never_overwritten(monkeypatch):
    """The record is replaced and completed anew after the batch read it: the fenced update
    matches nothing and the new response stays (on every database, locks or none)."""
    record = record_under(OLD, 1)
    gone = record_under(OLD, 2)
    real_reseal = crypto._Walk._reseal
    new_headers, new_body = sealed(NEW, [["Content-Type", "application/json"]], b'{"n": "new"}')

    def changed_meanwhile(walk: Any, todo: Any) -> None:
        now = timezone.now()
        IdempotencyRecord.objects.filter(pk=record.pk).update(
            created_at=now, completed_at=now, response_headers=new_headers, response_body=new_body
        )
        IdempotencyRecord.objects.filter(pk=gone.pk).delete()  # purged meanwhile
        real_reseal(walk, todo)

    monkeypatch.setattr(crypto._Walk, "_reseal", changed_meanwhile)
    with keys(NEW, OLD):
        result = maintenance.rotate_encryption()
        record.refresh_from_db()
        assert opened(record) == ([["Content-Type", "application/json"]], b'{"n": "new"}')
    assert (result.records, result.changed) == (0, 2)
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["r-1"]


@postgres_only
def test_rotation_in_batches_beside_live_claims_and_completions(user, tmp_path):
    """Real threads, each on its own connection: new requests (claims and completions), slow
    requests holding their claims while batches pass them, replays of the records being
    rotated, and takeovers of expired ones, while the rotation walks the table in batches
    of 10."""
    api = ApiClient(user)
    request_hash = fingerprint_of(api, PAYLOAD)
    rows = 400
    for n in range(rows):
        record_under(
            OLD, n, account=f"user:{user.pk}", operation="POST outcome/", request_hash=request_hash
        )
    expired = [f"r-{n}" for n in range(0, rows, 40)]
    IdempotencyRecord.objects.filter(key__in=expired).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    started = threading.Event()
    claimed = tmp_path / "claimed"
    first_answers: dict[str, Any] = {}
    lock = threading.Lock()

    def traffic(name: str) -> list[str]:
        assert started.wait(WAIT)
        sent = []
        for n in range(8):
            key = f"{name}-{n}"
            charge = {"amount": n + 1, "currency": "EUR"}
            # Some requests hold their claim (in progress) for a while after it is made.
            steer = {"headers": {"X-Test": f"touch-start:{claimed},sleep-start:0.2"}}
            response = api.post("/charges/", charge, key=key, **(steer if n % 4 == 0 else {}))
            assert response.status_code == 201, response.content
            with lock:
                first_answers[key] = ("/charges/", charge, answered(response))
            sent.append(key)
            replayed = api.post("/outcome/", PAYLOAD, key=f"r-{n * 37 + 1}")  # being rotated
            assert replayed["Idempotent-Replayed"] == "true"
            assert json.loads(replayed.content) == {"n": n * 37 + 1}
        for key in expired[int(name[-1]) :: 3]:  # take over expired records of the table
            response = api.post("/outcome/", PAYLOAD, key=key)
            assert "Idempotent-Replayed" not in response
            with lock:
                first_answers[key] = ("/outcome/", PAYLOAD, answered(response))
        return sent

    def rotation() -> crypto.RotationResult:
        def progress(batches: int, sealed: int) -> None:
            started.set()
            if batches == 2:  # go on once a claim was held and a new key completed
                done = IdempotencyRecord.objects.filter(
                    key__startswith="client", status="completed"
                )
                for _ in range(WAIT * 100):
                    if claimed.exists() and done.exists():
                        break
                    threading.Event().wait(0.01)
                assert claimed.exists(), "no claim was held beside the rotation"
                assert done.exists(), "no new key completed beside the rotation"

        return maintenance.rotate_encryption(batch_size=10, progress=progress)

    with keys(NEW, OLD), ThreadPoolExecutor(4) as pool:
        rotated = pool.submit(in_thread(rotation))
        clients = [pool.submit(in_thread(traffic), f"client{i}") for i in range(3)]
        sent = [key for client in clients for key in client.result(timeout=WAIT * 4)]
        result = rotated.result(timeout=WAIT * 4)
        assert result.batches >= rows // 10
        # The walk met records completed beside it, sealed with the first key already.
        assert result.current >= 1
        # Every answer is replayed byte for byte, the rotated ones and the new ones alike.
        for key, (path, payload, first) in first_answers.items():
            again = api.post(path, payload, key=key)
            assert answered(again) == first, key
            assert again["Idempotent-Replayed"] == "true"
        leftover = maintenance.rotate_encryption(dry_run=True)
    # Each new key and each taken-over expired key ran exactly once.
    assert Charge.objects.exclude(account="outcome").count() == len(sent)
    assert Charge.objects.filter(account="outcome").count() == len(expired)
    assert leftover.records == 0
    assert key_ids() == {crypto.key_id(NEW): rows + len(sent)}
    assert not IdempotencyRecord.objects.filter(status="in_progress").exists()


@postgres_only
def test_a_record_another_transaction_holds_is_counted_as_left_for_the_next_run():
    """A batch skips the rows another transaction locks (a claim's ON CONFLICT on a retry,
    an admin's save): such a record keeps its old key, and the run must say so, not report
    a walk that sealed everything it did not skip."""
    for n in range(5):
        record_under(OLD, n)
    held = IdempotencyRecord.objects.get(key="r-2")
    locked, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic():
            IdempotencyRecord.objects.select_for_update().filter(pk=held.pk).get()
            locked.set()
            leave.wait(WAIT)

    holder = threading.Thread(target=in_thread(hold))
    holder.start()
    try:
        assert locked.wait(WAIT)
        with keys(NEW, OLD):
            out = StringIO()
            call_command("rotate_idempotency_encryption", stdout=out)
    finally:
        leave.set()
        holder.join(WAIT)
    with keys(NEW, OLD):
        left = maintenance.rotate_encryption(dry_run=True)
    assert left.records == 1  # r-2 is still sealed with the old key
    assert "Sealed 4 idempotency records" in out.getvalue()
    assert "1 were in use by another transaction and left as they are" in out.getvalue()


@postgres_only
def test_a_rotation_killed_inside_a_batch_leaves_every_record_readable_and_nothing_locked():
    """SIGKILL after a batch wrote its updates, before it committed: the batches before it
    stay sealed with the new key, that batch's rows keep the old one (its transaction rolled
    back with the process), no row stays locked, and the next run seals the rest."""
    import subprocess
    import sys

    from django.db import connection

    from tests.live import ROOT, server_env

    rows = 45
    with keys(OLD):
        for n in range(rows):
            record_under(OLD, n)
        before = {r.key: opened(r) for r in IdempotencyRecord.objects.all()}
    process = subprocess.run(
        [sys.executable, "-m", "tests.rotate_proc", "2"],
        cwd=ROOT,
        env=server_env({"IDEMPOTENCY_ENCRYPTION_KEYS": f"{NEW},{OLD}"}),
        timeout=WAIT * 2,
        capture_output=True,
        text=True,
    )
    assert process.returncode == -9, process.stderr
    # Two batches of 10 committed; the third wrote its 10 updates and died uncommitted.
    assert key_ids() == {crypto.key_id(NEW): 20, crypto.key_id(OLD): rows - 20}
    # Nothing is left locked by the dead batch: every row can be locked at once.
    with transaction.atomic():
        table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id FROM {table} FOR UPDATE NOWAIT")
            assert len(cursor.fetchall()) == rows
    with keys(NEW, OLD):
        assert {r.key: opened(r) for r in IdempotencyRecord.objects.all()} == before
        again = maintenance.rotate_encryption(batch_size=10)
        assert (again.records, again.current, again.in_use) == (rows - 20, 20, 0)
        assert maintenance.rotate_encryption(dry_run=True).records == 0
    with keys(NEW):
        assert {r.key: opened(r) for r in IdempotencyRecord.objects.all()} == before


@postgres_only
def test_two_rotations_a_purge_and_live_retries_on_the_same_rows(user):
    """Two rotations at once, a purge deleting the expired rows, retries replaying the rows
    being resealed and taking over the expired ones, all on their own connections: every
    row is sealed once, every retry replays the same bytes, each taken-over key runs once,
    and nothing is left in progress or under the old key."""
    api = ApiClient(user)
    request_hash = fingerprint_of(api, PAYLOAD)
    rows = 300
    with keys(NEW, OLD, AUDIT=True):
        for n in range(rows):
            record_under(
                OLD,
                n,
                account=f"user:{user.pk}",
                operation="POST outcome/",
                request_hash=request_hash,
            )
        expired = {f"r-{n}" for n in range(0, rows, 7)}
        IdempotencyRecord.objects.filter(key__in=expired).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        go = threading.Barrier(5, timeout=WAIT)

        def rotation() -> crypto.RotationResult:
            go.wait()
            return maintenance.rotate_encryption(batch_size=10)

        def purge() -> int:
            go.wait()
            return maintenance.purge_expired(batch_size=5).deleted

        def retries(offset: int) -> list[tuple[str, int, bytes, str]]:
            go.wait()
            seen = []
            for n in range(offset, rows, 5):
                response = api.post("/outcome/", PAYLOAD, key=f"r-{n}")
                replayed = response.get("Idempotent-Replayed", "")
                seen.append((f"r-{n}", response.status_code, response.content, replayed))
            return seen

        with ThreadPoolExecutor(5) as pool:
            rotations = [pool.submit(in_thread(rotation)) for _ in range(2)]
            purged = pool.submit(in_thread(purge))
            answers = [pool.submit(in_thread(retries), i) for i in range(2)]
            results = [f.result(timeout=WAIT * 4) for f in rotations]
            deleted = purged.result(timeout=WAIT * 4)
            seen = [a for f in answers for a in f.result(timeout=WAIT * 4)]
        # A short batch ends a purge: an expired row that a rotation's batch held as the
        # purge passed it is left to the next run, which deletes (and copies) it once.
        again = maintenance.purge_expired().deleted
        leftover = maintenance.rotate_encryption()
        for key, status, content, replayed in seen:
            if key in expired:
                continue
            assert (status, replayed) == (201, "true"), key
            assert json.loads(content) == {"n": int(key[2:])}
        ran = Charge.objects.filter(account="outcome").count()
        retried_expired = {key for key, *_ in seen if key in expired}
        assert ran == len(retried_expired)
        sealed = sum(r.records for r in results) + leftover.records
        survivors = IdempotencyRecord.objects.exclude(key__in=expired).count()
        assert survivors == rows - len(expired)
        # Each surviving old row was sealed by one rotation or the run after them (an expired
        # one perhaps before the purge or a takeover replaced it), none twice.
        assert survivors <= sealed <= rows, (results, leftover)
        # Each expired row left one audit copy (purged or replaced), sealed with the new key.
        copies = Counter(IdempotencyAuditRecord.objects.values_list("key", flat=True))
        assert copies == dict.fromkeys(expired, 1)
        assert key_ids(IdempotencyAuditRecord) == {crypto.key_id(NEW): len(expired)}
        assert not IdempotencyRecord.objects.filter(expires_at__lte=timezone.now()).exists()
        assert key_ids() == {crypto.key_id(NEW): IdempotencyRecord.objects.count()}
        assert not IdempotencyRecord.objects.filter(status="in_progress").exists()
        # The purges deleted the expired rows no retry took over first.
        assert deleted >= 1
        purged_copies = IdempotencyAuditRecord.objects.filter(reason="purged").count()
        assert deleted + again == purged_copies
        assert len(expired) - purged_copies <= len(retried_expired)
        assert maintenance.rotate_encryption(dry_run=True).records == 0
