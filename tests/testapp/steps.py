"""A resumable operation in the rocket-rides manner, killed at any boundary on request.

``book(kill)`` creates a ride (a local write: a ``Charge`` row of account ``ride``), charges it
through the fake provider with ``downstream_key("charge")`` (the provider deduplicates by
key; every call is a ``ProviderCall``), then sends a receipt (an external call without
idempotency: a ``ProviderCall`` keyed ``receipt:<ride id>``). Each is a ``step()``.

``kill`` names the boundary where the process SIGKILLs itself (see :data:`STAGES`):
before the first step, inside each step after its effect, between the steps, after the last,
after the completion ``UPDATE`` before its ``COMMIT``, and after the ``COMMIT`` before the
answer. The view ``/steps/book/`` takes it from ``X-Test: kill:<stage>``;
``python -m tests.steps_worker`` from its arguments.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from django_idempotency import current, step
from django_idempotency.decorators import idempotent
from tests.testapp import provider
from tests.testapp.models import Charge, ProviderCall

STAGES = (
    "before-first",
    "inside-ride",
    "between-ride-charge",
    "inside-charge",
    "between-charge-receipt",
    "inside-receipt",
    "after-last",
    "before-commit",
    "after-commit",
)
#: Where a kill happened inside a step: that step's external call was made, its local
#: writes rolled back, and the next attempt runs it again.
INSIDE = {"inside-ride": "ride", "inside-charge": "charge", "inside-receipt": "receipt"}


def _die(kill: str, stage: str) -> None:
    if kill == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def create_ride(kill: str) -> dict[str, Any]:
    ride = Charge.objects.create(account="ride", amount=1200, currency="EUR")
    _die(kill, "inside-ride")
    return {"id": ride.pk}


def charge(kill: str, key: str) -> int:
    charged = provider.charge(key, 1200, "EUR")
    _die(kill, "inside-charge")
    return charged


def send_receipt(kill: str, ride: int) -> bool:
    ProviderCall.objects.using("provider").create(key=f"receipt:{ride}")
    _die(kill, "inside-receipt")
    return True


def book(kill: str = "") -> dict[str, Any]:
    """The operation: three steps, and the kill points around them."""
    context = current()
    assert context is not None
    _die(kill, "before-first")
    ride = step("ride", create_ride, kill)
    _die(kill, "between-ride-charge")
    charged = step("charge", charge, kill, key=context.downstream_key("charge"))
    _die(kill, "between-charge-receipt")
    step("receipt", send_receipt, kill, ride["id"])
    _die(kill, "after-last")
    return {"ride": ride["id"], "charge": charged}


@contextmanager
def dying_at_completion(kill: str) -> Iterator[None]:
    """SIGKILL right after the completion ``UPDATE`` (``before-commit``) or right after the
    completion's ``COMMIT`` (``after-commit``)."""
    if kill not in ("before-commit", "after-commit"):
        yield
        return

    def wrapper(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        result = execute(sql, params, many, context)
        plain = sql.replace('"', "").replace("`", "")
        if plain.startswith("UPDATE django_idempotency_record") and "completed_at" in plain:
            if kill == "before-commit":
                os.kill(os.getpid(), signal.SIGKILL)
            commit = connection.commit

            def commit_then_die() -> None:
                commit()
                os.kill(os.getpid(), signal.SIGKILL)

            connection.commit = commit_then_die  # type: ignore[method-assign]
        return result

    with connection.execute_wrapper(wrapper):
        yield


def _kill_of(request: HttpRequest) -> str:
    directive = request.headers.get("X-Test", "")
    return directive.removeprefix("kill:") if directive.startswith("kill:") else ""


@idempotent(recovery="resume", operation="rides.book")
def book_view(request: HttpRequest) -> HttpResponse:
    """``POST /steps/book/``: the operation behind a view."""
    return JsonResponse(book(_kill_of(request)), status=201)


def book_and_die(request: HttpRequest) -> HttpResponse:
    """``POST /steps/book-dying/``: the view, killed at the completion when asked."""
    with dying_at_completion(_kill_of(request)):
        response: HttpResponse = book_view(request)
    return response


#: ``/steps/slow/``: the first attempt's step waits inside, after its write, until released.
ENTERED = threading.Event()
RELEASE = threading.Event()
_slow_runs: list[int] = []


def write_slowly() -> int:
    ride = Charge.objects.create(account="slow", amount=1, currency="EUR")
    _slow_runs.append(ride.pk)
    if len(_slow_runs) == 1:
        ENTERED.set()
        RELEASE.wait(20)
    return ride.pk


@idempotent(recovery="resume", operation="rides.slow")
def slow_view(request: HttpRequest) -> HttpResponse:
    """``POST /steps/slow/``: one step that the first attempt holds open."""
    return JsonResponse({"ride": step("ride", write_slowly)}, status=201)


def reset_slow() -> None:
    ENTERED.clear()
    RELEASE.clear()
    _slow_runs.clear()


@idempotent(recovery="resume", operation="rides.atomic")
@transaction.atomic
def atomic_view(request: HttpRequest) -> HttpResponse:
    """``POST /steps/atomic/``: a step inside a transaction of a decorator beneath
    ``@idempotent``, which would commit only with it (refused)."""
    return JsonResponse({"ride": step("ride", create_ride, "")["id"]}, status=201)


@idempotent(recovery="resume", operation="rides.async")
async def async_view(request: HttpRequest) -> HttpResponse:
    """``POST /steps/async/``: an ``async def`` view's steps, through ``sync_to_async``."""
    ride = await sync_to_async(step)("ride", create_ride, "")
    receipt = await sync_to_async(step)("receipt", send_receipt, "", ride["id"])
    return JsonResponse({"ride": ride["id"], "receipt": receipt}, status=201)


@idempotent(recovery="resume", operation="rides.async-direct")
async def async_direct_view(request: HttpRequest) -> HttpResponse:
    """``POST /steps/async-direct/``: ``step()`` called on the event loop (refused)."""
    return JsonResponse({"ride": step("ride", create_ride, "")["id"]}, status=201)


urlpatterns = [
    path("book/", book_and_die),
    path("slow/", slow_view),
    path("atomic/", atomic_view),
    path("async/", async_view),
    path("async-direct/", async_direct_view),
]
