"""One protected operation behind every entry point, for the caller's-transaction tests.

Each entry point runs :func:`work` under the recovery policy its URL names (``retry`` or
``fail``). The body looks from another connection for its own claim, calls the fake provider
(an external effect: ``ProviderCall``, autocommit on the ``provider`` connection, so it
survives any rollback) with its downstream key, writes a local effect (``Charge``, in the
operation's transaction), and, when the request says ``X-Test: crash``, dies there as a
killed process would (``SimulatedCrash``); ``X-Test: kill`` SIGKILLs the process right after
the provider call.

``urlpatterns`` (included under ``txn/``): ``<entry>/<policy>/`` for ``decorator``,
``mixin``, ``api-view``, ``ninja``, ``run-once`` and ``task``; the last two are plain,
unprotected views that call ``run_once`` and an ``@idempotent_task`` task with the request's
key, so they run inside whatever transaction the request is in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from django_idempotency import InProgress, OutcomeUnknown, current, run_once
from django_idempotency.decorators import idempotent
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import IN_PROGRESS
from tests.testapp.models import Charge, ProviderCall

POLICIES = ("retry", "fail")


def seen_elsewhere(key: str) -> bool:
    """Whether another connection (a thread of its own) sees this key's claim in progress.

    Bounded: the look gives up after 5 s (a look that waits on a lock is a failure too).
    """
    seen: list[bool] = []

    def look() -> None:
        try:
            seen.append(IdempotencyRecord.objects.filter(key=key, status=IN_PROGRESS).exists())
        finally:
            connections.close_all()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(timeout=5)
    return bool(seen and seen[0])


#: Called (when set) inside the body, after the claim and before the work: the tests send a
#: duplicate from another thread there, while the first attempt holds its claim.
during: Callable[[], None] | None = None


def work(crash: str) -> dict[str, Any]:
    """The operation: look for the claim elsewhere, call the provider, write, maybe die.

    ``crash``: ``""``, ``"crash"`` (``SimulatedCrash`` after the writes) or ``"kill"``
    (``SIGKILL`` of this process after the provider call).
    """
    context = current()
    assert context is not None
    seen = seen_elsewhere(context.key)
    if during is not None:
        during()
    ProviderCall.objects.using("provider").create(key=context.downstream_key("charge"))
    if crash == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    charge = Charge.objects.create(account=context.account, amount=1, currency="EUR")
    if crash == "crash":
        raise SimulatedCrash
    return {"charge": charge.pk, "seen": seen}


def _crash(request: Any) -> str:
    return request.headers.get("X-Test", "")


def _answer(result: dict[str, Any]) -> JsonResponse:
    return JsonResponse(result, status=201)


def _decorated(policy: str) -> Any:
    @idempotent(recovery=policy, operation=f"txn.decorator.{policy}")
    def view(request: HttpRequest) -> HttpResponse:
        return _answer(work(_crash(request)))

    return view


#: Celery is optional (the tox env ``core`` runs without it): the task entry point then
#: is not there.
HAS_CELERY = importlib.util.find_spec("celery") is not None
TASKS: dict[str, Any] = {}
_NOT_A_DELIVERY: tuple[type[BaseException], ...] = ()

if HAS_CELERY:
    from celery import shared_task

    from django_idempotency.tasks import DeliveryInProgress, idempotent_task

    _NOT_A_DELIVERY = (DeliveryInProgress,)

    @shared_task(name="tests.txn_task_retry")
    @idempotent_task(key=lambda key, crash: key, recovery="retry")
    def task_retry(key: str, crash: str) -> dict[str, Any]:
        """The operation as a deduplicated task (``"retry"``)."""
        return work(crash)

    @shared_task(name="tests.txn_task_fail")
    @idempotent_task(key=lambda key, crash: key, recovery="fail")
    def task_fail(key: str, crash: str) -> dict[str, Any]:
        """The operation as a deduplicated task (``"fail"``)."""
        return work(crash)

    TASKS = {"retry": task_retry, "fail": task_fail}


def _plain_caller(policy: str, call: Any) -> Any:
    """An unprotected view that calls ``call(key, crash)``; exceptions become answers."""

    def view(request: HttpRequest) -> HttpResponse:
        key = request.headers["Idempotency-Key"]
        try:
            result = call(key, _crash(request))
        except InProgress as exc:
            return JsonResponse({"code": "in_progress", "retry_after": exc.retry_after}, status=409)
        except _NOT_A_DELIVERY:
            return JsonResponse({"code": "in_progress"}, status=409)
        except OutcomeUnknown:
            return JsonResponse({"code": "idempotency_outcome_unknown"}, status=500)
        if result is None:  # a task skipped a delivery whose record was closed as failed
            return JsonResponse({"code": "idempotency_outcome_unknown"}, status=500)
        return _answer(result)

    return view


def _run_once_view(policy: str) -> Any:
    def call(key: str, crash: str) -> Any:
        return run_once(
            work, crash, account="consumer:txn", operation="txn.run_once", key=key, recovery=policy
        )

    return _plain_caller(policy, call)


def _local(policy: str) -> Any:
    """A protected view with a local effect only (for ``TestCase``: one connection)."""

    @idempotent(recovery=policy, operation=f"txn.local.{policy}")
    def view(request: HttpRequest) -> HttpResponse:
        charge = Charge.objects.create(account="local", amount=1, currency="EUR")
        return _answer({"charge": charge.pk})

    return view


def _view_run_once(policy: str) -> Any:
    """A protected view whose work is a sub-operation under ``run_once``."""

    @idempotent(recovery=policy, operation=f"txn.view_run_once.{policy}")
    def view(request: HttpRequest) -> HttpResponse:
        key = request.headers["Idempotency-Key"]
        crash = _crash(request)
        result = run_once(
            work, crash, account="consumer:txn", operation="txn.run_once", key=key, recovery=policy
        )
        return _answer(result)

    return view


def _task_view(policy: str) -> Any:
    return _plain_caller(policy, lambda key, crash: TASKS[policy](key, crash))


urlpatterns: list[Any] = []
for _policy in POLICIES:
    urlpatterns += [
        path(f"decorator/{_policy}/", _decorated(_policy)),
        path(f"run-once/{_policy}/", _run_once_view(_policy)),
        path(f"view-run-once/{_policy}/", _view_run_once(_policy)),
        path(f"local/{_policy}/", _local(_policy)),
    ]
    if HAS_CELERY:
        urlpatterns.append(path(f"task/{_policy}/", _task_view(_policy)))

if settings.HAS_DRF:
    from rest_framework.authentication import BasicAuthentication, SessionAuthentication
    from rest_framework.decorators import api_view, authentication_classes
    from rest_framework.permissions import IsAuthenticated
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from django_idempotency.drf import IdempotencyMixin

    # HTTP Basic first: the live-server tests send no CSRF token (sessions want one).
    AUTHENTICATION = [BasicAuthentication, SessionAuthentication]

    def _mixin(policy: str) -> Any:
        class MixinView(IdempotencyMixin, APIView):
            authentication_classes = AUTHENTICATION
            permission_classes = [IsAuthenticated]
            idempotency_recovery = policy
            idempotency_operation = f"txn.mixin.{policy}"

            def post(self, request: Request) -> Response:
                return Response(work(_crash(request)), status=201)

        return MixinView.as_view()

    def _api_view(policy: str) -> Any:
        @api_view(["POST"])
        @authentication_classes(AUTHENTICATION)
        @idempotent(recovery=policy, operation=f"txn.api_view.{policy}")
        def view(request: Request) -> Response:
            return Response(work(_crash(request)), status=201)

        return view

    for _policy in POLICIES:
        urlpatterns += [
            path(f"mixin/{_policy}/", _mixin(_policy)),
            path(f"api-view/{_policy}/", _api_view(_policy)),
        ]

if settings.HAS_NINJA:
    from ninja import NinjaAPI
    from ninja.security import django_auth

    from django_idempotency.ninja import idempotent as ninja_idempotent
    from tests.testapp.ninja_api import BasicAuth

    api = NinjaAPI(urls_namespace="txn")

    def _ninja(policy: str) -> None:
        @api.post(f"/{policy}/", auth=[BasicAuth(), django_auth], response={201: dict[str, Any]})
        @ninja_idempotent(recovery=policy, operation=f"txn.ninja.{policy}")
        def view(request: HttpRequest) -> dict[str, Any]:
            return work(_crash(request))

    for _policy in POLICIES:
        _ninja(_policy)
    urlpatterns.append(path("ninja/", api.urls))


def body(response: Any) -> Any:
    """A response's JSON body."""
    return json.loads(response.content)
