"""``@idempotent`` for Django function views, DRF ``@api_view`` views and, through
``method_decorator``, class-based views."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, overload

from django.http.response import HttpResponseBase

from django_idempotency import engine

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., HttpResponseBase])


def _is_drf_request(request: Any) -> bool:
    return hasattr(request, "_request") and hasattr(request, "parser_context")


@overload
def idempotent(view: ViewFunc) -> ViewFunc: ...


@overload
def idempotent(
    view: None = None,
    *,
    operation: str | None = None,
    required: bool | None = None,
    ttl: timedelta | int | None = None,
    lease: timedelta | int | None = None,
    recovery: engine.Recovery | None = None,
    account: engine.Resolver | str | None = None,
    fingerprint: engine.Fingerprint | str | None = None,
    methods: tuple[str, ...] | list[str] | None = None,
) -> Callable[[ViewFunc], ViewFunc]: ...


def idempotent(
    view: ViewFunc | None = None,
    *,
    operation: str | None = None,
    required: bool | None = None,
    ttl: timedelta | int | None = None,
    lease: timedelta | int | None = None,
    recovery: engine.Recovery | None = None,
    account: engine.Resolver | str | None = None,
    fingerprint: engine.Fingerprint | str | None = None,
    methods: tuple[str, ...] | list[str] | None = None,
) -> ViewFunc | Callable[[ViewFunc], ViewFunc]:
    """Make a view's protected methods (``POST`` and ``PATCH`` by default) idempotent.

    Use it bare (``@idempotent``) or with arguments; every argument left out falls back to
    the ``IDEMPOTENCY`` setting. With DRF, put ``@api_view([...])`` above it, so the claim
    follows DRF's authentication, permission and throttle checks.
    """
    options = engine.Options(
        operation=operation,
        required=required,
        ttl=ttl,
        lease=lease,
        recovery=recovery,
        account=account,
        fingerprint=fingerprint,
        methods=tuple(methods) if methods else None,
    )

    def decorate(func: ViewFunc) -> ViewFunc:
        @functools.wraps(func)
        def wrapper(request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if _is_drf_request(request):
                from django_idempotency.drf import drf_call

                call = drf_call(request, func, args, kwargs)
            else:

                def call() -> HttpResponseBase:
                    return func(request, *args, **kwargs)

            return engine.handle(
                request, call, options, lambda: engine.route_operation(request, func)
            )

        # The claim must commit before the view runs, so the view may not be wrapped in
        # ATOMIC_REQUESTS' transaction; the engine opens its own.
        existing: set[str] = getattr(func, "_non_atomic_requests", set())
        wrapper._non_atomic_requests = engine.IdempotencyDatabase(existing)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    if view is not None:
        return decorate(view)
    return decorate
