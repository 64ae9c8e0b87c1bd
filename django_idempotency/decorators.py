"""``@idempotent`` for Django function views (sync and ``async def``), DRF ``@api_view`` views
and, through ``method_decorator``, class-based views."""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.views import View

from django_idempotency import _atomic_requests, _http, _options, _protection, _validation
from django_idempotency._options import ViewOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ViewOptions", "idempotent"]

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])


@functools.cache
def _has_spectacular() -> bool:
    return importlib.util.find_spec("drf_spectacular") is not None


def _is_drf_request(request: Any) -> bool:
    return hasattr(request, "_request") and hasattr(request, "parser_context")


def _refuse_unprotectable(view: Any) -> None:
    """Refuse what ``@idempotent`` could wrap but not protect as the docs say."""
    name = _validation.name_of(view)
    if isinstance(view, type):
        raise ImproperlyConfigured(
            f"@idempotent on the class {name}: decorate its method, "
            'method_decorator(idempotent, name="dispatch") for a Django view, or put '
            "IdempotencyMixin first in a DRF view's bases."
        )
    if _a_method(view):
        raise ImproperlyConfigured(_on_a_method(view))
    if _dispatch_of_a_drf_view(view):
        owner = _validation.name_of(type(view.func.__self__))
        raise ImproperlyConfigured(
            f"@idempotent on the dispatch of the DRF view {owner}: the claim would come "
            "before DRF's authentication, permission and throttle "
            "checks (a caller DRF authenticates by a header would be refused on every "
            "request). Put IdempotencyMixin first in the view's bases instead, or "
            "method_decorator(idempotent) on its handler."
        )
    if getattr(view, "_ninja_operation", None) is not None:
        # Above ninja's route decorator: ninja serves the operation it built from the
        # function beneath, which this wrapper never reaches.
        raise ImproperlyConfigured(_UNDER_NINJA.format(name=name))
    drf_view = getattr(view, "cls", None)
    if _protection.is_drf_view(drf_view):
        # DRF's as_view(): the claim would come before DRF's authentication, permissions
        # and throttles, and a refused caller's answer would be stored.
        where = (
            "put @idempotent beneath @api_view"
            if drf_view.__qualname__.endswith("WrappedAPIView")
            else "put IdempotencyMixin first in the view's bases instead"
        )
        raise ImproperlyConfigured(
            f"@idempotent on the DRF view {name}: {where}, so that the claim follows DRF's "
            "authentication, permission and throttle checks."
        )


_UNDER_NINJA = (
    "@idempotent of django_idempotency.decorators on the ninja operation {name}: it cannot "
    "protect a ninja operation (ninja serves the function it registered, and renders its "
    "answer after it). Use django_idempotency.ninja.idempotent, beneath the route "
    "decorator (@api.post(...) or @router.post(...))."
)


class _RefusedByNinja:
    """Put on the function Django's decorator returns among ninja's operation callbacks
    (``_ninja_contribute_to_operation``, which ninja calls as it builds an operation from a
    function): beneath a route decorator, the decorator is refused where the route is
    written, before any request runs the operation unprotected. Inert anywhere else."""

    __slots__ = ("view",)

    def __init__(self, view: Any) -> None:
        self.view = view  # named only when refused: method_decorator decorates per request

    def __call__(self, operation: Any) -> None:
        raise ImproperlyConfigured(_UNDER_NINJA.format(name=_validation.name_of(self.view)))


def _dispatch_of_a_drf_view(func: Any) -> bool:
    """Whether ``func`` is ``method_decorator(idempotent, name="dispatch")``'s bound
    ``dispatch`` of a DRF view (a ``functools.partial`` of it): called with Django's request,
    before DRF authenticates the caller."""
    bound = getattr(func, "func", None)
    view = getattr(bound, "__self__", None)
    return getattr(bound, "__name__", None) == "dispatch" and _protection.is_drf_view(type(view))


def _a_method(func: Any) -> bool:
    """Whether ``func`` is a function written in a class's body whose first parameter is
    ``self`` or ``cls``: a handler of a class-based view (or a viewset's action), or a
    classmethod, whose first argument would be the view or its class, not a request.
    (``method_decorator`` hands the decorator the method bound to its view, a
    ``functools.partial``, and a function of its own to copy names from, written in a
    function's body: neither is one.)

    The function as written is the end of its ``__wrapped__`` chain of functions: a
    decorator beneath ``@idempotent`` in ``method_decorator``'s list wraps the bound
    partial, and ``functools.wraps`` gives its function the method's name and, through the
    partial, the method's signature; that chain ends at the partial, and is no method."""
    if not inspect.isfunction(func):
        return False
    written = inspect.unwrap(func, stop=lambda f: not inspect.isfunction(f))
    if not inspect.isfunction(written):
        return False
    where = written.__qualname__.split(".")
    if len(where) < 2 or where[-2] == "<locals>":
        return False
    first = next(iter(inspect.signature(written, follow_wrapped=False).parameters), None)
    return first in ("self", "cls")


def _on_a_method(func: Any) -> str:
    return (
        f"@idempotent on the method {_validation.name_of(func)} of a class-based view: use "
        'method_decorator(idempotent, name="dispatch") (or on the handler) for a Django '
        "view, or IdempotencyMixin first in a DRF view's bases. (A function view in a "
        "class's body: a @staticmethod taking the request first.)"
    )


def _dispatch_of_an_async_view(func: Any) -> bool:
    """Whether ``func`` is a plain method of a class-based view whose handlers are ``async
    def``: ``method_decorator(idempotent, name="dispatch")`` hands the decorator Django's
    ``View.dispatch``, bound to the view (in a ``functools.partial``), which returns the
    handler's coroutine. It is protected as an ``async def`` view is.

    So is the plain function of a decorator beneath ``@idempotent`` in ``method_decorator``'s
    list (``[idempotent, csrf_exempt]``): it wraps that partial (``functools.wraps`` leaves
    the chain of functions in ``__wrapped__``, ending at the partial) and hands back what
    ``dispatch`` returns."""
    written = inspect.unwrap(func, stop=lambda f: not inspect.isfunction(f))
    bound = getattr(written, "func", written)
    view = getattr(bound, "__self__", None)
    return isinstance(view, View) and bool(type(view).view_is_async)


def _awaiting(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as a coroutine function, for ``async_to_sync``: an ``async def`` view as it
    is, the ``dispatch`` of an async class-based view awaiting what it returns (a plain
    decorator's function around it may answer without calling it: a response, not
    awaited)."""
    if inspect.iscoroutinefunction(func):
        return func

    async def awaited(*args: Any, **kwargs: Any) -> Any:
        answer = func(*args, **kwargs)
        return await answer if inspect.isawaitable(answer) else answer

    return awaited


@overload
def idempotent(view: ViewFunc, /) -> ViewFunc: ...


@overload
def idempotent(
    view: None = None, /, **options: Unpack[ViewOptions]
) -> Callable[[ViewFunc], ViewFunc]: ...


def idempotent(
    view: ViewFunc | None = None, /, **options: Unpack[ViewOptions]
) -> ViewFunc | Callable[[ViewFunc], ViewFunc]:
    """Make a view's protected methods (``POST`` and ``PATCH`` by default) idempotent.

    Use it bare (``@idempotent``) or with the options of ``ViewOptions`` (``operation``,
    ``required``, ``ttl``, ``lease``, ``recovery``, ``account``, ``fingerprint``,
    ``methods``, ``key``); every option left out falls back to the ``IDEMPOTENCY`` setting.
    A wrong or unknown option (``methods="POST"``, ``ttl=0``, a dotted path that does not
    import, ``lease_seconds=5``) raises ``ImproperlyConfigured`` here, naming the view and
    the option. With DRF, put ``@api_view([...])`` above it, so the claim follows DRF's
    authentication, permission and throttle checks.

    ``key`` says where the key comes from when it is not the ``HEADER`` setting's header: a
    callable ``request -> str | None``, its dotted path, or a helper of
    ``django_idempotency.sources`` (``sources.json("id")``).
    """
    if isinstance(view, classmethod):
        # Above @classmethod: a class's method, whose first argument would not be a request.
        raise ImproperlyConfigured(_on_a_method(view.__func__))
    if view is not None and not callable(view):
        raise ImproperlyConfigured(
            f"@idempotent at {_validation.caller()}: its arguments are keyword arguments "
            f"(e.g. methods=[...]); got the positional {_validation.describe(view)}."
        )
    if view is not None:
        _refuse_unprotectable(view)
    where = (
        f"@idempotent on {_validation.name_of(view)}"
        if view is not None
        else f"@idempotent(...) at {_validation.caller()}"
    )
    # Validated now, when the view is decorated: a wrong value never reaches a request.
    chosen = _options.Options.of(where, options)

    def decorate(func: ViewFunc) -> ViewFunc:
        _refuse_unprotectable(func)
        # The view's _non_atomic_requests (set on the wrapper below): the aliases the view is
        # out of ATOMIC_REQUESTS for, its own (@transaction.non_atomic_requests beneath) and,
        # for the requests it protects, the idempotency database's. Read from the wrapper
        # when a request comes: one above replaces them there (IdempotencyDatabase.add).
        marks = _atomic_requests.IdempotencyDatabase(getattr(func, "_non_atomic_requests", ()))

        def handle(request: Any, args: Any, kwargs: Any, view: Any) -> HttpResponseBase:
            if isinstance(request, View):
                # A method of a class-based view, decorated as it stands, that _a_method did
                # not know for one (its first parameter is not called self): its first
                # argument is the view, and no request reaches the claim.
                raise ImproperlyConfigured(_on_a_method(func))
            if _is_drf_request(request):
                from django_idempotency.drf import drf_call

                call = drf_call(request, view, args, kwargs)
            else:

                def call() -> HttpResponseBase:
                    response: HttpResponseBase = view(request, *args, **kwargs)
                    return response

            return _http.handle(
                request,
                call,
                chosen,
                functools.partial(_http.route_operation, request, func),
                wrapper.__dict__.get("_non_atomic_requests"),
            )

        wrapper: Callable[..., Any]
        if inspect.iscoroutinefunction(func) or _dispatch_of_an_async_view(func):
            # The engine is synchronous: the claim, the view's transaction and the completion
            # must share one connection. It runs in the request's thread-sensitive thread, and
            # the async view runs back on the event loop from there; its async ORM calls then
            # come back to that same thread, inside the transaction. A client that goes away
            # does not cut it short (_http.run_to_the_end).
            coroutine_view = _awaiting(func)
            sync_view = async_to_sync(coroutine_view)

            @functools.wraps(func)
            async def async_wrapper(request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
                if (
                    isinstance(request, HttpRequest)
                    and not _is_drf_request(request)
                    and _http.passes_by(
                        request, chosen, wrapper.__dict__.get("_non_atomic_requests")
                    )
                ):
                    response: HttpResponseBase = await coroutine_view(request, *args, **kwargs)
                    return response
                return await _http.run_to_the_end(lambda: handle(request, args, kwargs, sync_view))

            wrapper = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
                return handle(request, args, kwargs, func)

            wrapper = sync_wrapper

        # The claim must commit before the view runs, so the view may not be wrapped in
        # ATOMIC_REQUESTS' transaction; the engine opens its own.
        wrapper.__dict__["_non_atomic_requests"] = marks
        # How manage.py idempotency_audit knows the view is protected, and with what options.
        wrapper.__dict__["idempotency_options"] = chosen
        # Beneath a ninja route decorator, refused when ninja builds the operation.
        wrapper.__dict__["_ninja_contribute_to_operation"] = [
            *wrapper.__dict__.get("_ninja_contribute_to_operation", ()),
            _RefusedByNinja(func),
        ]
        if _has_spectacular() and "schema" not in wrapper.__dict__:
            # DRF's @api_view copies the function's `schema` onto the view class it makes:
            # drf-spectacular then documents the key header and the problem answers. (A
            # schema the view already has, e.g. DRF's @schema(None), is left as it is.)
            from django_idempotency.openapi import IdempotentViewSchema

            wrapper.__dict__["schema"] = IdempotentViewSchema(chosen)
        return wrapper  # type: ignore[return-value]

    if view is not None:
        return decorate(view)
    return decorate
