"""Protected views leave ``ATOMIC_REQUESTS``: one connection per protected request.

Django wraps a view in the request's transaction (``ATOMIC_REQUESTS``) unless the view
function carries ``_non_atomic_requests`` with the database's alias. Inside that
transaction a claim could not commit on its own before the view runs, so the claim would
need a second connection: two per request, a pool sized to the server's threads starved
in a burst. So protected requests are left out of it, and the engine runs the view, its
rendering and the completion in a transaction of its own: the cost is the view's own.

- ``@idempotent`` marks the function it returns, the mixin's ``as_view()`` each view
  function it returns: those are marked when they are made.
- DRF's ``@api_view`` builds its view function after ``@idempotent`` ran beneath it, a
  class-based view with ``method_decorator(idempotent)`` on one method gets no mark on its
  view function, and django-ninja builds one view function per path: none of these can be
  reached when the decorator runs. They are found when the first request arrives, in the
  URL resolver (as ``idempotency_audit`` finds them), and marked then, before Django wraps
  that request.

A mark covers the methods the view protects only: its other methods keep the request's
transaction. The method of each request is noted when it starts (:func:`request_started`),
only where ``ATOMIC_REQUESTS`` is on for the idempotency database. Under ASGI a receiver of
``request_started`` cannot pass it on (Django calls receivers in tasks of their own), so a
view whose unprotected methods do not all reach the engine (a class-based view with one
decorated method, a ninja path beside a plain operation) is left in the request's
transaction there, and its protected requests claim on a second connection, as do views
reached through a per-request URLconf (``request.urlconf``), which are not found this way:
``CLAIM_DATABASE`` says where that connection goes.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Container, Iterable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.http.response import HttpResponseBase
from django.urls import get_resolver, get_urlconf

from django_idempotency import _options, _protection
from django_idempotency.conf import app_settings

logger = logging.getLogger("django_idempotency")

__all__ = [
    "IdempotencyDatabase",
    "atomic_requests",
    "mark_protected_views",
    "marks_of",
    "request_finished",
    "request_method",
    "request_started",
    "with_atomic_requests",
]

_lock = threading.Lock()
_marked: weakref.WeakSet[Any] = weakref.WeakSet()


def request_started(
    sender: Any = None,
    environ: dict[str, Any] | None = None,
    scope: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    """``request_started`` receiver: where ``ATOMIC_REQUESTS`` is on for the idempotency
    database, note the request's method and mark the protected views (once per URLconf)."""
    try:
        alias = app_settings.DATABASE
    except ImproperlyConfigured:
        return  # a protected request refuses to run; the others are none of ours
    if not atomic_requests(alias):
        return
    # Under ASGI this runs in a task of its own (Signal.asend): the value does not reach the
    # request, which finds None there, as it should.
    method = (environ or {}).get("REQUEST_METHOD") or (scope or {}).get("method")
    request_method.set(method.upper() if isinstance(method, str) else None)
    resolver = get_resolver(get_urlconf())
    if resolver not in _marked:
        mark_protected_views(resolver)


def request_finished(sender: Any = None, **kwargs: Any) -> None:
    """``request_finished`` receiver: forget the method, so that no later request of the
    thread (or of a context copied from it) reads it."""
    if request_method.get() is not None:
        request_method.set(None)


def mark_protected_views(resolver: Any) -> int:
    """Mark the view functions of ``resolver``'s patterns that protect some of their
    methods; how many were marked. Once per resolver object (a changed ``ROOT_URLCONF`` is
    a new one)."""
    with _lock:
        if resolver in _marked:
            return 0
        marked = 0
        try:
            for callback in _protection.callbacks(resolver.urlconf_name):
                marked += _mark(callback)
        except Exception:
            # The URLconf does not import, or a view cannot be inspected: Django reports
            # the first when it resolves; the views left unmarked claim on a second
            # connection, as inside any caller's transaction.
            logger.warning(
                "could not look for protected views in the URLconf; those not marked "
                "will claim on a second connection under ATOMIC_REQUESTS",
                exc_info=True,
            )
            return marked
        _marked.add(resolver)
        return marked


def _mark(callback: Callable[..., Any]) -> int:
    existing: set[str] = getattr(callback, "_non_atomic_requests", set())
    if isinstance(existing, IdempotencyDatabase):
        return 0  # marked when it was made
    table = _protection.protected_methods(callback)
    if not table:
        return 0
    unknown = inspect.iscoroutinefunction(callback) or _every_method_reaches_the_engine(
        callback, table
    )
    try:
        callback._non_atomic_requests = IdempotencyDatabase(  # type: ignore[attr-defined]
            existing, _protects(table), unknown
        )
    except AttributeError:  # a bound method (older django-ninja): left as it is
        return 0
    return 1


def _every_method_reaches_the_engine(
    callback: Callable[..., Any], table: dict[str, _options.Options]
) -> bool:
    """Whether every method the view serves (``OPTIONS`` aside) goes through an adapter of
    this package, which runs the unprotected ones in the request's transaction itself."""
    if _protection.EVERY_METHOD in table:
        return True
    served = _protection.served_methods(callback)
    return served is not None and served - {"OPTIONS"} <= set(table)


def _protects(table: dict[str, _options.Options]) -> Callable[[str], bool]:
    def protects(method: str) -> bool:
        options = table.get(method) or table.get(_protection.EVERY_METHOD)
        return options is not None and options.protects(method)

    return protects


def with_atomic_requests(
    alias: str, call: Callable[[], HttpResponseBase], marks: Container[str] | None = None
) -> HttpResponseBase:
    """Run an unprotected request in the transaction ``ATOMIC_REQUESTS`` asked for.

    Protected views are exempted from ``ATOMIC_REQUESTS`` so that the claim commits on its
    own; requests that turn out not to be protected get the project's transaction back,
    unless the view itself is out of it (``marks``, see :func:`atomic_requests`).
    """
    if atomic_requests(alias, marks):
        with transaction.atomic(using=alias):
            return call()
    return call()


def marks_of(request: Any, default: Container[str] | None = None) -> Container[str] | None:
    """The ``_non_atomic_requests`` of the view function Django resolved ``request`` to, the
    marks Django itself read (an opt-out around the view in the URLconf included); else
    ``default`` (a view called without Django's resolver)."""
    view = getattr(getattr(request, "resolver_match", None), "func", None)
    marks: Container[str] | None = getattr(view, "_non_atomic_requests", default)
    return marks


def atomic_requests(alias: str, marks: Container[str] | None = None) -> bool:
    """Whether a request gets a transaction on the database ``alias``: ``ATOMIC_REQUESTS``
    on for it, and the view not out of it by its own ``@transaction.non_atomic_requests``.

    ``marks``: the view's ``_non_atomic_requests``. Of an :class:`IdempotencyDatabase`, only
    the aliases the view itself names count (it holds the idempotency database's alias for
    the requests it protects as well, which is not the view's own choice)."""
    if not connections.settings[alias].get("ATOMIC_REQUESTS"):
        return False
    if marks is None:
        return True
    return not (set.__contains__(marks, alias) if isinstance(marks, set) else alias in marks)


#: The method of the request being handled, set when it starts (where ``ATOMIC_REQUESTS`` is
#: on for the idempotency database): what :class:`IdempotencyDatabase` asks of a view that
#: protects some of its methods only.
request_method: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "django_idempotency_request_method", default=None
)


class IdempotencyDatabase(set[str]):
    """A view's ``_non_atomic_requests``: holds the idempotency database alias for the
    requests the view protects, so that Django leaves them out of ``ATOMIC_REQUESTS`` (the
    claim must commit before the view runs, and the engine runs the view in a transaction
    of its own); other requests keep the request's transaction as Django gives it.

    ``protects``: whether the view protects a method (``None``: every method reaches the
    engine, which runs the unprotected ones in the transaction ``ATOMIC_REQUESTS`` asked
    for). ``unknown``: the answer when the request's method is not known (under ASGI,
    where a receiver of ``request_started`` cannot pass it on): leave the view out when
    every method reaches the engine or the view is ``async def`` (Django runs no async view
    in that transaction). Read at request time rather than at import, so
    ``override_settings`` of ``DATABASE`` works.
    """

    def __init__(
        self,
        existing: Iterable[str] = (),
        protects: Callable[[str], bool] | None = None,
        unknown: bool = True,
    ) -> None:
        super().__init__(existing)
        self.protects = protects
        self.unknown = unknown

    def add(self, alias: str) -> None:
        """Refused, with the ``AttributeError`` on which Django's
        ``@transaction.non_atomic_requests`` gives the one function it decorates a set of its
        own (``{alias}``). Added here, the alias would reach every function that shares
        these marks: each wrapper of the view (``functools.wraps`` copies them), each view
        function ``as_view()`` makes of a class whose ``dispatch`` is decorated. The
        request-time marking (:func:`_mark`) takes the idempotency database's requests back
        out of ``ATOMIC_REQUESTS`` where that set replaced these."""
        raise AttributeError(
            f"the marks of a protected view are shared by its wrappers; {alias!r} is not "
            "added to them (Django's non_atomic_requests sets the view's own instead)"
        )

    def __contains__(self, alias: object) -> bool:
        if super().__contains__(alias):
            return True
        if alias != app_settings.DATABASE:
            return False
        if self.protects is None:
            return True
        method = request_method.get()
        return self.unknown if method is None else self.protects(method)
