"""django-ninja support: ``@idempotent`` beneath ``@api.post(...)`` or ``@router.post(...)``.

This is the only module that imports ninja.

The decorator gives the ninja operation a subclass of its own class (through the callbacks
ninja offers third-party code when it builds an operation; the class survives ninja's cloning
of operations when a router is mounted). A protected request then runs:

1. ninja's authentication and throttles, as ninja would: a refused caller gets ninja's own
   answer and no record is written;
2. the claim of ``(account, operation, key)``, by :func:`django_idempotency._http.protected`;
3. inside the engine's transaction, the rest of ninja's own ``run``: parameter validation,
   the operation function, the rendering of its result and ninja's exception handlers, so
   what is stored and replayed is the rendered response, byte for byte.

The operation's OpenAPI description gets the key header, the problem answers and the
``Idempotent-Replayed`` header, computed when the schema is generated (so the ``IDEMPOTENCY``
setting in force then is the one documented).
"""

from __future__ import annotations

import http.client
import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from asgiref.sync import async_to_sync
from django import db
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from ninja.operation import AsyncOperation, Operation
from ninja.utils import contribute_operation_callback

from django_idempotency import _apidocs, _http, _options, _validation, conf
from django_idempotency.accounts import principal_account
from django_idempotency.conf import app_settings

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["auth_account", "idempotent"]

OperationFunc = TypeVar("OperationFunc", bound=Callable[..., Any])

# Set on a request once ninja's checks passed, so that ninja's own run, called by the engine
# after the claim, does not authenticate and throttle it a second time.
_CHECKED = "_idempotency_checks_passed"


def auth_account(request: HttpRequest) -> str | None:
    """The account of a ninja request when the operation names none.

    With the default ``ACCOUNT_RESOLVER``: the account of what ninja's authentication
    returned (``request.auth``, e.g. with ``django_auth`` or a bearer class that answers a
    user: ``user:<pk>``; an instance of another model, ``<app_label>.<model_name>:<pk>``,
    see ``accounts.principal_account``), else of ``request.user``. A project's own
    ``ACCOUNT_RESOLVER`` decides by itself (it can read ``request.auth``). An authentication
    result that is not a user (a token object, a string) identifies no account: give
    ``account=``.
    """
    resolver = app_settings.ACCOUNT_RESOLVER
    auth = getattr(request, "auth", None)
    if (
        resolver is conf.resolve_callable(conf.DEFAULTS["ACCOUNT_RESOLVER"])
        and getattr(auth, "is_authenticated", False) is True
        and getattr(auth, "pk", None) is not None
    ):
        return principal_account(auth)
    account: str | None = resolver(request)
    return account


@overload
def idempotent(func: OperationFunc, /) -> OperationFunc: ...


@overload
def idempotent(
    func: None = None, /, **options: Unpack[_options.ViewOptions]
) -> Callable[[OperationFunc], OperationFunc]: ...


def idempotent(
    func: OperationFunc | None = None, /, **options: Unpack[_options.ViewOptions]
) -> OperationFunc | Callable[[OperationFunc], OperationFunc]:
    """Make a ninja operation's protected methods (``POST`` and ``PATCH`` by default)
    idempotent.

    Put it beneath ``@api.post(...)`` / ``@router.post(...)`` (or any ninja operation
    decorator), on a ``def`` or an ``async def`` function; use it bare or with the options
    of ``django_idempotency.decorators.idempotent``, every one left out falling back to
    the ``IDEMPOTENCY`` setting. ``key`` is a callable ``request -> str | None`` (or its
    dotted path) that gives the key instead of the header. The default operation name is the
    route's ``operation_id`` when it sets one, else the method and the URL route
    (``POST api/charges``), as for Django views; the default account is
    ``auth_account``.
    """
    where = (
        f"ninja @idempotent on {_validation.name_of(func)}"
        if func is not None
        else f"ninja @idempotent(...) at {_validation.caller()}"
    )
    # Validated now, when the operation is decorated: a wrong value never reaches a request.
    given: dict[str, Any] = dict(options)
    if given.get("account") is None:
        given["account"] = auth_account
    chosen = _options.Options.of(where, given)

    def decorate(func: OperationFunc) -> OperationFunc:
        if _applied_by_ninja():
            raise ImproperlyConfigured(
                f"ninja @idempotent on {_validation.name_of(func)} was applied by ninja "
                "itself (a router's or the API's add_decorator, or decorate_view): ninja "
                "applies those to the copy of the operation it serves, after the operation "
                "was built, where @idempotent cannot protect it. Put @idempotent beneath "
                "each operation's route decorator instead."
            )
        built = getattr(func, "_ninja_operation", None)
        if isinstance(built, Operation):
            # Above the route decorator: ninja has built the operation already. (Only the
            # last one it built: the operation of a route decorator further down is out of
            # reach, and check E062 names it; see intended().)
            _protect(built, chosen)
        # Every operation ninja builds from the function from now on, route decorators above
        # this one included.
        contribute_operation_callback(func, partial(_protect, options=chosen))
        return func

    if func is not None:
        return decorate(func)
    return decorate


def intended(view_func: Callable[..., Any]) -> _options.Options | None:
    """The options of the ``@idempotent`` applied to ``view_func``, or ``None``.

    Every operation ninja builds from the function once the decorator is applied is
    protected; one of the function's operations without protection was built before it:
    the route decorator beneath another one, with ``@idempotent`` above both. That route
    runs unprotected (check E062)."""
    for callback in getattr(view_func, "_ninja_contribute_to_operation", ()):
        if isinstance(callback, partial) and callback.func is _protect:
            options: _options.Options = callback.keywords["options"]
            return options
    return None


def _applied_by_ninja() -> bool:
    """Whether the decorator is being applied by ninja's own code (the first frame outside
    this module is one of ninja's): a router's ``add_decorator`` hands it the function of an
    operation ninja has copied already, or (``mode="view"``) the copy's ``run``."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back  # type: ignore[assignment]
    module = str(frame.f_globals.get("__name__", "")) if frame is not None else ""
    return module == "ninja" or module.startswith("ninja.")


def _protect(operation: Operation, options: _options.Options) -> None:
    if isinstance(operation, _Protected):
        raise ImproperlyConfigured(
            f"{_name(operation)} is decorated with @idempotent twice; keep one."
        )
    if getattr(operation, "stream_format", None) is not None:
        raise ImproperlyConfigured(
            f"{_name(operation)} streams its response, which cannot be stored for replay: "
            "a streamed operation cannot be idempotent."
        )
    if "run" in operation.__dict__:
        # A decorate_view() beneath @idempotent wrapped ninja's run already: that wrapper
        # would call ninja's own run, not the protected one.
        raise ImproperlyConfigured(
            f"{_name(operation)} has a view decorator beneath @idempotent; put @idempotent "
            "right beneath the route decorator, above @decorate_view(...)."
        )
    base = type(operation)
    protected = _AsyncProtected if isinstance(operation, AsyncOperation) else _SyncProtected
    # One class per operation: its options travel with it through ninja's clone().
    operation.__class__ = type(
        f"Idempotent{base.__name__}",
        (protected, base),
        {"idempotency_options": options, "__module__": __name__},
    )
    # The class's openapi_extra property shadows the value ninja stored on the instance.
    operation._own_openapi_extra = operation.__dict__.pop("openapi_extra", None)  # type: ignore[attr-defined]


def _name(operation: Operation) -> str:
    view = operation.view_func
    return f"The ninja operation {view.__module__}.{view.__qualname__}"


class _Protected(Operation):
    """What protected operations add to ninja's ``Operation``; mixed in front of its class."""

    idempotency_options: ClassVar[_options.Options]
    _own_openapi_extra: dict[str, Any] | None

    @property
    def openapi_extra(self) -> dict[str, Any] | None:
        """The operation's own ``openapi_extra``, with the idempotency parts merged in."""
        own = self._own_openapi_extra
        if self.__dict__.get("_cloning") or not any(
            self.idempotency_options.protects(m) for m in self.methods
        ):
            return own
        return _merged(_documentation(self), own or {})

    @openapi_extra.setter
    def openapi_extra(self, value: dict[str, Any] | None) -> None:
        self._own_openapi_extra = value

    def clone(self) -> Operation:
        """ninja's clone (it keeps the class), with the operation's own ``openapi_extra``."""
        # ninja's clone reads openapi_extra while the URLs are built (manage.py check builds
        # them): only the operation's own is copied, so the settings are not read there.
        self.__dict__["_cloning"] = True
        try:
            cloned = super().clone()
        finally:
            del self.__dict__["_cloning"]
        own = self._own_openapi_extra
        cloned._own_openapi_extra = dict(own) if own else None  # type: ignore[attr-defined]
        return cloned

    def _default_operation(self, request: HttpRequest) -> str:
        return self.operation_id or _http.route_operation(request, self.view_func)

    def _protecting(self, request: HttpRequest) -> _options.Terms | None:
        """The operation's terms when the request's method is protected, else ``None``:
        decided once per request, and the engine is handed the answer."""
        terms = self.idempotency_options.terms()
        return terms if terms.protects(request.method) else None

    def _handle(
        self,
        request: HttpRequest,
        terms: _options.Terms,
        call: Callable[[], HttpResponseBase],
    ) -> HttpResponseBase:
        # Under ATOMIC_REQUESTS Django has wrapped ninja's view in the request's transaction
        # (ninja's views cannot be taken out of it): the claim then commits on a connection
        # of its own (see django_idempotency._autonomous), and the completion with the request.
        return _http.protected(
            request,
            call,
            self.idempotency_options,
            terms,
            partial(self._default_operation, request),
        )


class _SyncProtected(_Protected):
    def run(self, request: HttpRequest, **kw: Any) -> HttpResponseBase:
        """ninja's checks, then the claim, then the rest of ninja's run inside the engine."""
        run = super().run
        terms = self._protecting(request)
        if terms is None:
            _http.unprotected(request)  # request.idempotency is None, as under @idempotent
            return run(request, **kw)
        try:
            error = super()._run_checks(request)
        except db.Error as failed:  # the authentication read the database, which failed
            return _http.failed_before_the_claim(request, self.idempotency_options, failed)
        if error is not None:
            return error
        setattr(request, _CHECKED, True)
        return self._handle(request, terms, lambda: run(request, **kw))

    def _run_checks(self, request: HttpRequest) -> Any:
        if getattr(request, _CHECKED, False):
            return None
        return super()._run_checks(request)


class _AsyncProtected(_Protected, AsyncOperation):
    async def run(self, request: HttpRequest, **kw: Any) -> HttpResponseBase:  # type: ignore[override]
        """The same, for an ``async def`` operation.

        The engine is synchronous: the claim, the operation's transaction and the completion
        share one connection. It runs in the request's thread-sensitive thread and the
        operation back on the event loop from there, its async ORM calls coming back to that
        same thread, inside the transaction.
        """
        run = super().run
        terms = self._protecting(request)
        if terms is None:
            _http.unprotected(request)  # request.idempotency is None, as under @idempotent
            response: HttpResponseBase = await run(request, **kw)
            return response
        try:
            error = await super()._run_checks(request)
        except db.Error as failed:  # the authentication read the database, which failed
            return _http.failed_before_the_claim(request, self.idempotency_options, failed)
        if error is not None:
            return error
        setattr(request, _CHECKED, True)
        sync_run = async_to_sync(run)
        return await _http.run_to_the_end(
            lambda: self._handle(request, terms, lambda: sync_run(request, **kw))
        )

    async def _run_checks(self, request: HttpRequest) -> Any:  # type: ignore[override]
        if getattr(request, _CHECKED, False):
            return None
        return await super()._run_checks(request)


def _documentation(operation: _Protected) -> dict[str, Any]:
    # The idempotency parts, as an openapi_extra that ninja merges into the operation: the
    # statuses ninja documents are keyed as ninja keys them (integers), with ninja's own
    # descriptions, so that the merge adds headers and content beside them.
    statuses = [s for s in operation.response_models if isinstance(s, int)]
    own_parameters = list((operation._own_openapi_extra or {}).get("parameters", []))
    described: dict[str, Any] = {
        "parameters": list(own_parameters),
        "responses": {
            str(s): {"description": http.client.responses.get(s, "Unknown Status Code")}
            for s in statuses
        },
    }
    _apidocs.document_operation(
        described,
        operation.idempotency_options,
        # Written inline (ninja offers an operation no way to add a component), under the
        # component's name for a reader and a code generator.
        {**_apidocs.problem_schema(_apidocs.code_schema()), "title": _apidocs.PROBLEM_COMPONENT},
    )
    return {
        "parameters": described["parameters"][len(own_parameters) :],
        "responses": {int(code): answer for code, answer in described["responses"].items()},
    }


def _merged(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    # As ninja merges openapi_extra: dictionaries recursively, lists joined, theirs winning.
    result = dict(ours)
    for name, value in theirs.items():
        mine = result.get(name)
        if isinstance(mine, dict) and isinstance(value, dict):
            result[name] = _merged(mine, value)
        elif isinstance(mine, list) and isinstance(value, list):
            result[name] = mine + value
        else:
            result[name] = value
    return result
