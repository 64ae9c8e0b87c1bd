"""The demo's crash switch, for ``make demo`` only: never in production.

``example_project/demo_steps.py`` sends ``X-Demo-Crash: after-charge`` with a ride booking
(``POST /api/rides/``), and the booking then ends as a killed process would, inside its
charge step, after the provider charged and the ride was updated, before the step is
recorded: :func:`crash_point` raises ``django_idempotency.exceptions.SimulatedCrash``. The
development server cannot be killed for it (one process serves every request), so the
request ends this way instead: the step's transaction rolls back, the claim stays held
until its lease runs out, exactly as after a SIGKILL.

The middleware that reads the header is installed only when ``DEBUG`` is on (see
``example_project/settings.py``), and refuses to load otherwise: with ``DEBUG`` off no
request can ask for a crash, whatever its headers.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import MiddlewareNotUsed
from django.http import HttpRequest, HttpResponseBase

from django_idempotency.exceptions import SimulatedCrash

HEADER = "X-Demo-Crash"
#: The crash points a request may ask for.
POINTS = ("after-charge",)

_asked: contextvars.ContextVar[str] = contextvars.ContextVar("demo_crash", default="")


class DemoCrashMiddleware:
    """Remember the request's ``X-Demo-Crash`` while it runs. ``DEBUG`` only."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        if not settings.DEBUG:
            raise MiddlewareNotUsed("the demo's crash switch works only with DEBUG on")
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        asked = request.headers.get(HEADER, "")
        token = _asked.set(asked if asked in POINTS else "")
        try:
            return self.get_response(request)
        finally:
            _asked.reset(token)


def crash_point(name: str) -> None:
    """End the request here, as a killed process would, when it asked for ``name``."""
    if _asked.get() == name:
        raise SimulatedCrash(f"the demo's crash at {name}")
