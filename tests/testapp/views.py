"""Views that the tests drive. ``X-Test-*`` headers (outside the fingerprint) steer them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

from django.core.signals import request_finished
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency.decorators import idempotent
from tests.testapp import provider
from tests.testapp.models import Charge


def steer(request: HttpRequest, stage: str) -> None:
    """Test hooks at named stages: sleep, crash the process, or wait for a file to appear."""
    for directive in request.headers.get("X-Test", "").split(","):
        name, _, arg = directive.strip().partition(":")
        if name == f"sleep-{stage}":
            time.sleep(float(arg))
        elif name == f"kill-{stage}":
            os.kill(os.getpid(), signal.SIGKILL)
        elif name == f"raise-{stage}":
            raise RuntimeError(f"test asked to fail at {stage}")
        elif name == f"touch-{stage}":
            Path(arg).touch()
        elif name == f"wait-{stage}":
            deadline = time.monotonic() + 30
            while not Path(arg).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        elif name == f"pid-{stage}":
            # The database backend serving this request, for pg_terminate_backend.
            _write_backend_pid(arg)
        elif name == f"statement-timeout-{stage}":
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL statement_timeout = {int(arg)}")
        elif name == f"pg-sleep-{stage}":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_sleep(%s)", [float(arg)])


def _write_backend_pid(path: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    Path(path + ".tmp").write_text(str(pid))
    Path(path + ".tmp").rename(path)  # the test never reads a half-written file


def record_charge(request: HttpRequest, amount: int, currency: str) -> Charge:
    """The side effects of a charge: the provider call, then the local write."""
    account = request.idempotency.account if request.idempotency else "anonymous"  # type: ignore[attr-defined]
    provider_key = (
        request.idempotency.downstream_key("provider")  # type: ignore[attr-defined]
        if getattr(request, "idempotency", None)
        else f"no-key-{time.time_ns()}"
    )
    provider_id = provider.charge(provider_key, amount, currency)
    steer(request, "after-provider")
    charge = Charge.objects.create(
        account=account, amount=amount, currency=currency, provider_charge=str(provider_id)
    )
    steer(request, "after-write")
    return charge


def make_charge(request: HttpRequest) -> HttpResponse:
    """The shared body of the charge views: provider call, then the local write."""
    steer(request, "start")
    try:
        payload = json.loads(request.body or b"{}")
        amount = int(payload["amount"])
        currency = str(payload["currency"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "amount and currency required"}, status=400)
    if amount <= 0:
        return JsonResponse({"error": "amount must be positive"}, status=422)
    charge = record_charge(request, amount, currency)
    response = JsonResponse(
        {
            "id": charge.pk,
            "amount": amount,
            "currency": currency,
            "provider": int(charge.provider_charge),
        },
        status=201,
    )
    response["Location"] = f"/charges/{charge.pk}/"
    response["X-Request-Trace"] = str(time.time_ns())  # differs per attempt; not replayed
    return response


@idempotent
def charges(request: HttpRequest, shop: int | None = None) -> HttpResponse:
    if request.method == "GET":
        return JsonResponse({"count": Charge.objects.count()})
    return make_charge(request)


@idempotent(operation="charges.create-short-lease", lease=1, ttl=60)
def charges_short_lease(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(operation="charges.create-fail", lease=1, ttl=60, recovery="fail")
def charges_fail_policy(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


#: The keys a recovery callable was asked about, in order (tests clear it).
RECOVERY_ASKED: list[str] = []


def recover_by_asking_provider(record):  # type: ignore[no-untyped-def]
    """A recovery callable: answers from our own Charge table when it holds the outcome."""
    RECOVERY_ASKED.append(record.key)
    if record.key.startswith("raise-"):
        raise ConnectionError("the provider could not be asked")
    if record.key.startswith("known-"):
        return JsonResponse({"recovered": record.key}, status=200)
    if record.key.startswith("down-"):
        return JsonResponse({"provider": "unreachable"}, status=503)
    if record.key.startswith("huge-"):  # larger than the tests' MariaDB takes (16 MiB)
        return HttpResponse(b"x" * (17 * 1024 * 1024), content_type="text/plain")
    return None


@idempotent(
    operation="charges.create-callable", lease=1, ttl=60, recovery=recover_by_asking_provider
)
def charges_callable_policy(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(required=False)
def charges_optional(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(account=lambda request: request.headers.get("X-Tenant"))
def tenant_charges(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent
def outcome(request: HttpRequest) -> HttpResponse:
    """Writes a Charge, then answers with the status, body and headers the payload asks for."""
    payload = json.loads(request.body or b"{}")
    Charge.objects.create(account="outcome", amount=1, currency="EUR")
    if payload.get("raise"):
        raise RuntimeError("view failed")
    if payload.get("stream"):
        return StreamingHttpResponse(iter([b"a", b"b"]), status=200)
    if payload.get("rollback"):
        transaction.set_rollback(True)
    body = payload.get("body", "x" * int(payload.get("size", 0)))
    response = HttpResponse(body, status=int(payload.get("status", 200)), content_type="text/plain")
    for name, value in payload.get("headers", {}).items():
        response[name] = value
    if payload.get("cookie"):
        response.set_cookie("session-ish", "secret")
    return response


@method_decorator(idempotent(operation="cbv.charges"), name="dispatch")
class ChargeView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return JsonResponse({"count": Charge.objects.count()})

    def post(self, request: HttpRequest) -> HttpResponse:
        return make_charge(request)


@idempotent(operation="peek")
def peek(request: HttpRequest) -> HttpResponse:
    """Reports what another connection sees of this request's record while the view runs."""
    from django.db import connection

    from django_idempotency.models import IdempotencyRecord

    if request.method == "GET":
        return JsonResponse({"atomic": connection.in_atomic_block})
    ctx = request.idempotency  # type: ignore[attr-defined]
    seen = (
        IdempotencyRecord.objects.using("provider")
        .filter(account=ctx.account, operation=ctx.operation, key=ctx.key)
        .values_list("status", flat=True)
        .first()
    )
    Charge.objects.create(account=ctx.account, amount=1, currency="EUR")
    return JsonResponse({"seen": seen, "atomic": connection.in_atomic_block})


async def steer_async(request: HttpRequest, stage: str) -> None:
    """:func:`steer`'s sleep, touch and wait at a stage of an ``async def`` view, without
    blocking the event loop."""
    for directive in request.headers.get("X-Test", "").split(","):
        name, _, arg = directive.strip().partition(":")
        if name == f"sleep-{stage}":
            await asyncio.sleep(float(arg))
        elif name == f"touch-{stage}":
            Path(arg).touch()
        elif name == f"wait-{stage}":
            deadline = time.monotonic() + 30
            while not Path(arg).exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)


async def make_async_charge(request: HttpRequest) -> HttpResponse:
    """An ``async def`` view body: the provider call and the local write through the async ORM."""
    from asgiref.sync import sync_to_async

    ctx = request.idempotency  # type: ignore[attr-defined]
    payload = json.loads(request.body or b"{}")
    provider_id = await sync_to_async(provider.charge)(
        ctx.downstream_key("provider"), int(payload["amount"]), str(payload["currency"])
    )
    await steer_async(request, "after-provider")
    charge = await Charge.objects.acreate(
        account=ctx.account,
        amount=int(payload["amount"]),
        currency=str(payload["currency"]),
        provider_charge=str(provider_id),
    )
    if payload.get("fail"):
        return JsonResponse({"error": "asked to fail"}, status=500)
    response = JsonResponse({"id": charge.pk}, status=201)
    response["Location"] = f"/async/charges/{charge.pk}/"
    return response


@idempotent(operation="async.charges")
async def async_charges(request: HttpRequest) -> HttpResponse:
    return await make_async_charge(request)


@idempotent(operation="async.charges-short-lease", lease=1, ttl=60)
async def async_charges_short_lease(request: HttpRequest) -> HttpResponse:
    return await make_async_charge(request)


#: The task each request of :func:`async_where` (and :class:`AsyncWhereView`) ran in
#: (tests/test_async.py).
ASYNC_TASKS: list[asyncio.Task[object] | None] = []


async def where_it_runs(request: HttpRequest) -> HttpResponse:
    """Where an ``async def`` view runs: its task, whether in a transaction, and what it
    finds in ``request.idempotency`` (``"absent"`` when nothing set it)."""
    from asgiref.sync import sync_to_async

    ASYNC_TASKS.append(asyncio.current_task())
    atomic = await sync_to_async(lambda: connection.in_atomic_block)()
    context = getattr(request, "idempotency", "absent")
    return JsonResponse(
        {"atomic": atomic, "context": context if context in (None, "absent") else "set"},
        status=201 if request.method == "POST" else 200,
    )


@idempotent(operation="async.where")
async def async_where(request: HttpRequest) -> HttpResponse:
    return await where_it_runs(request)


@method_decorator(idempotent(operation="async.where-class"), name="dispatch")
class AsyncWhereView(View):
    """:func:`async_where` as a class-based view, the decorator on ``dispatch``."""

    async def get(self, request: HttpRequest) -> HttpResponse:
        return await where_it_runs(request)

    async def post(self, request: HttpRequest) -> HttpResponse:
        return await where_it_runs(request)


# -- fault injection and hostile input (tests/test_faults_*.py, test_hostile_input.py, ...) --
#
# The tenant comes from ``X-Tenant`` so that tests against a private database server need
# no users or sessions there. ``X-Test`` directives for the completion (the engine completes
# the record after the view returned, in the view's transaction):
#
# - ``kill-before-commit``: SIGKILL right after the fenced completion UPDATE ran, before the
#   COMMIT; ``kill-after-commit``: SIGKILL right after the COMMIT, before the answer is sent;
# - ``pid-completion:<path>`` then ``wait-completion:<path>``: after the completion UPDATE,
#   write this request's backend pid and wait (bounded) for a file, so that a test can
#   terminate the backend or hold a lock between the UPDATE and the COMMIT;
#   ``touch-completion:<path>`` (any database) only says that the UPDATE ran.


def tenant_account(request: HttpRequest) -> str | None:
    return request.headers.get("X-Tenant")


def _is_completion(sql: str) -> bool:
    # Only store.finish writes completed_at on the record table. (Names are quoted with " on
    # PostgreSQL and SQLite, with ` on MySQL/MariaDB.)
    plain = sql.replace("`", "").replace('"', "")
    return plain.startswith(
        ("UPDATE django_idempotency_record", "WITH done AS (UPDATE django_idempotency_record")
    ) and ("completed_at" in plain)


def _commits(sql: str) -> bool:
    # The completion that carries the transaction's COMMIT in the same round trip (PostgreSQL
    # on Django's defaults): there, "between the UPDATE and the COMMIT" is before it is sent,
    # when the work is as uncommitted as it is after an UPDATE that has not committed.
    return sql.endswith("; COMMIT")


def arm_completion(request: HttpRequest) -> None:
    """Installs the completion directives of ``X-Test`` on this thread's connection."""
    directives = dict(
        d.strip().partition(":")[::2] for d in request.headers.get("X-Test", "").split(",")
    )
    wanted = {
        "kill-before-commit",
        "kill-after-commit",
        "pid-completion",
        "touch-completion",
        "wait-completion",
    }
    wanted &= set(directives)
    if not wanted:
        return
    owner = threading.get_ident()
    db = connections[DEFAULT_DB_ALIAS]  # this thread's connection, not the proxy

    def after_update() -> None:
        if "pid-completion" in directives:
            _write_backend_pid(directives["pid-completion"])
        if "touch-completion" in directives:
            Path(directives["touch-completion"]).touch()
        if "wait-completion" in directives:
            deadline = time.monotonic() + 30
            while not Path(directives["wait-completion"]).exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        if "kill-before-commit" in directives:
            os.kill(os.getpid(), signal.SIGKILL)
        if "kill-after-commit" in directives:
            commit = db.commit

            def commit_then_die() -> None:
                commit()
                os.kill(os.getpid(), signal.SIGKILL)

            db.commit = commit_then_die  # type: ignore[method-assign]

    def wrapper(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if _is_completion(sql) and _commits(sql):
            disarm()
            after_update()
            return execute(sql, params, many, context)
        result = execute(sql, params, many, context)
        if _is_completion(sql):
            disarm()
            after_update()
        return result

    def disarm(**kwargs: object) -> None:
        if threading.get_ident() != owner:
            return
        if wrapper in db.execute_wrappers:
            db.execute_wrappers.remove(wrapper)
        db.__dict__.pop("commit", None)
        request_finished.disconnect(disarm)

    db.execute_wrappers.append(wrapper)
    # A request that never completes (a 5xx, an exception) must not leave the hook behind.
    request_finished.connect(disarm, weak=False)


@idempotent(operation="faults.charge", account=tenant_account, lease=2, ttl=3600)
def fault_charges(request: HttpRequest) -> HttpResponse:
    arm_completion(request)
    return make_charge(request)


@idempotent(
    operation="faults.charge-fail", account=tenant_account, lease=2, ttl=3600, recovery="fail"
)
def fault_charges_fail_policy(request: HttpRequest) -> HttpResponse:
    arm_completion(request)
    return make_charge(request)


@idempotent(operation="faults.charge-short-ttl", account=tenant_account, lease=1, ttl=3)
def fault_charges_short_ttl(request: HttpRequest) -> HttpResponse:
    return make_charge(request)


@idempotent(operation="uploads")
def uploads(request: HttpRequest) -> HttpResponse:
    """A multipart view: answers the SHA-256 of every uploaded file, as the view read it."""
    import hashlib

    Charge.objects.create(account="uploads", amount=1, currency="EUR")
    files = {
        name: [hashlib.sha256(upload.read()).hexdigest() for upload in request.FILES.getlist(name)]
        for name in request.FILES
    }
    return JsonResponse({"form": sorted(request.POST.items()), "files": files}, status=201)
