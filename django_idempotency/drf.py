"""Django REST framework support: :class:`IdempotencyMixin` and the ``@api_view`` adapter.

This is the only module that imports DRF.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django import db
from django.core.exceptions import ImproperlyConfigured
from django.http.response import HttpResponseBase
from django.views import View
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency import _atomic_requests, _http, _options, _validation, conf, sources
from django_idempotency.conf import app_settings

_MISSING = object()
# Per view class: the raw idempotency_* values last validated, what they validated to, the
# key source, and the whole Options when no hook is overridden. Weak: a class made in a test
# goes with it.
_VALIDATED: weakref.WeakKeyDictionary[type, tuple[tuple[Any, ...], dict[str, Any], Any, Any]] = (
    weakref.WeakKeyDictionary()
)


def _finalized(
    view: APIView, request: Request, call: Callable[[], HttpResponseBase]
) -> HttpResponseBase:
    # The response is rendered inside the engine's transaction, so DRF's exception handling
    # and finalisation must happen there too: a handled exception (400, 404...) is the
    # deterministic outcome that gets stored and replayed.
    try:
        response = call()
    except Exception as exc:
        response = view.handle_exception(exc)
    # finalize_response takes any HttpResponse (it only sets renderer attributes on DRF's).
    return view.finalize_response(request, response, *view.args, **view.kwargs)  # type: ignore[arg-type]


def drf_call(
    request: Request, func: Callable[..., HttpResponseBase], args: Any, kwargs: Any
) -> Callable[[], HttpResponseBase]:
    """How ``@idempotent`` calls a function under ``@api_view``."""
    view = request.parser_context["view"]
    return lambda: _finalized(view, request, lambda: func(request, *args, **kwargs))


def _viewset_operation(view: APIView) -> str | None:
    basename = getattr(view, "basename", None)
    action = getattr(view, "action", None)
    if basename and action:
        return f"{basename}.{action}"
    return None


# The options the mixin spells as ``idempotency_*`` attributes; the account, the fingerprint
# and the key are its get_idempotency_* methods (the key also its idempotency_key).
_MIXIN_OPTIONS = ("operation", "required", "ttl", "lease", "recovery", "methods")


class IdempotencyMixin:
    """Put it first in a DRF view's bases to make its protected methods idempotent.

    The claim happens after DRF's authentication, permission and throttle checks, and the
    handler, DRF's exception handling, the rendering of the response and the completion of
    the record share one transaction. The ``idempotency_*`` attributes are validated on the
    view's first call: a wrong one (``idempotency_methods = "POST"``) raises
    ``ImproperlyConfigured`` naming the view and the attribute, before anything runs.
    """

    #: Methods that need a key; ``None``: the ``METHODS`` setting.
    idempotency_methods: tuple[str, ...] | None = None
    #: Whether a protected method without a key is refused; ``None``: ``REQUIRED``.
    idempotency_required: bool | None = None
    #: How long a record deduplicates retries; ``None``: ``TTL``.
    idempotency_ttl: timedelta | int | None = None
    #: How long a claim is owned before a retry may take it over; ``None``: ``LEASE``.
    idempotency_lease: timedelta | int | None = None
    #: ``"retry"``, ``"fail"`` or a callable ``recover(record)``; ``None``: ``RECOVERY``.
    idempotency_recovery: _options.Recovery | None = None
    #: The operation's name; ``None``: ``<basename>.<action>`` for viewsets, else the route.
    #: On a viewset it names every action alike (check E060 reports two of them): name a
    #: viewset's actions with ``get_idempotency_operation`` instead.
    idempotency_operation: str | None = None
    #: Where the key comes from: a callable called with the request alone (a
    #: :mod:`django_idempotency.sources` helper, or a plain function, which is not bound to
    #: the view) or its dotted path; ``None``: the ``HEADER`` setting's header. (Typed
    #: ``Any``: type checkers read a function stored on a class as a method.)
    idempotency_key: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, when the class is made, a view on which the mixin would never run."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if issubclass(cls, APIView):
            if mro.index(APIView) < mro.index(IdempotencyMixin):
                # APIView's dispatch and initial call no super(): the mixin's never run.
                first = next(k for k in mro[1:] if issubclass(k, APIView))
                raise ImproperlyConfigured(
                    f"{_validation.name_of(cls)}: IdempotencyMixin must come before "
                    f"{_validation.name_of(first)} in the class's bases (class "
                    f"{cls.__name__}(IdempotencyMixin, {first.__name__})). After DRF's "
                    "base its dispatch and initial never run, and the view would run "
                    "unprotected."
                )
        elif issubclass(cls, View):
            raise ImproperlyConfigured(
                f"{_validation.name_of(cls)}: IdempotencyMixin protects DRF views only (it "
                "claims in APIView.initial, after DRF's authentication). On a Django view, "
                'use method_decorator(idempotent, name="dispatch") instead.'
            )

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        """DRF's view function, taken out of ``ATOMIC_REQUESTS`` for the idempotency database
        whatever the view's ``dispatch`` (an override of it carries no mark): the claim must
        commit before the handler runs. The mixin's ``dispatch`` gives the request's
        transaction back to the methods it does not protect."""
        view = super().as_view(*args, **initkwargs)  # type: ignore[misc]
        # Marks of the view function's own: as_view() copied the class's dispatch's onto it
        # (those of a dispatch the view decorated), one object for every view of the class,
        # which @transaction.non_atomic_requests around one view in the URLconf would add
        # to. Only the aliases a dispatch itself names are kept (see atomic_requests).
        existing: set[str] = getattr(view, "_non_atomic_requests", set())
        view._non_atomic_requests = _atomic_requests.IdempotencyDatabase(set(existing))
        return view

    def get_idempotency_account(self, request: Request) -> str | None:
        """The caller's account; by default the ``ACCOUNT_RESOLVER`` setting decides."""
        resolver = conf.resolve_callable(app_settings.ACCOUNT_RESOLVER)
        account: str | None = resolver(request)
        return account

    def get_idempotency_fingerprint(self, request: Request) -> str:
        """The request's fingerprint; by default the ``FINGERPRINT`` setting computes it."""
        fingerprint: str = conf.resolve_callable(app_settings.FINGERPRINT)(request)
        return fingerprint

    def get_idempotency_key(self, request: Request) -> str | None:
        """The request's key, ``None`` when it has none; by default from ``idempotency_key``,
        else from the ``HEADER`` setting's header. Raise
        ``django_idempotency.keys.InvalidKey`` for a key that is not usable."""
        source = self._idempotency_key_source()
        if source is None:
            return sources.header(app_settings.HEADER)(request)
        key: str | None = conf.resolve_callable(source)(request)
        return key

    def _idempotency_key_source(self) -> Callable[[Any], str | None] | str | None:
        return self._validated_key_source(self._raw_idempotency_key())

    def _raw_idempotency_key(self) -> Any:
        # Read past the descriptor protocol (as inspect.getattr_static does, more cheaply):
        # a function stored on the class would otherwise come back as a method of the view
        # and get the view as its first argument.
        found = self.__dict__.get("idempotency_key", _MISSING)
        if found is not _MISSING:
            return found
        for klass in type(self).__mro__:
            if "idempotency_key" in klass.__dict__:
                return klass.__dict__["idempotency_key"]
        return None

    def _validated_key_source(self, source: Any) -> Callable[[Any], str | None] | str | None:
        if isinstance(source, staticmethod):
            source = source.__func__
        elif isinstance(source, classmethod):
            source = self.idempotency_key  # bound to the class, as asked
        checked = _options.validated(
            f"IdempotencyMixin on {_validation.name_of(type(self))}",
            {"key": source},
            accepted=("key",),
            prefix="idempotency_",
            rules=_options.VIEW_RULES,
        )
        found: Callable[[Any], str | None] | str | None = checked["key"]
        return found

    def get_idempotency_operation(self, request: Request) -> str:
        """The operation name used when ``idempotency_operation`` is not set."""
        assert isinstance(self, APIView)
        return _viewset_operation(self) or _http.route_operation(request, type(self))

    def _idempotency_options(self) -> _options.Options:
        # Read twice per request (dispatch, then initial): worked out once per view instance,
        # which DRF makes per request, from what is validated once per class.
        options: _options.Options | None = self.__dict__.get("_idempotency_validated")
        if options is None:
            options = self._validated_options()
            self.__dict__["_idempotency_validated"] = options
        return options

    def _validated_options(self) -> _options.Options:
        cls = type(self)
        # What the attributes hold, read as the view reads them (an instance's own values
        # first: as_view(idempotency_ttl=...)); the recovery from the class, where a
        # function assigned in the class body is the policy itself, not a method.
        raw = (
            self.idempotency_operation,
            self.idempotency_required,
            self.idempotency_ttl,
            self.idempotency_lease,
            cls.idempotency_recovery,
            self.idempotency_methods,
            self._raw_idempotency_key(),
        )
        # Validated on the view's first call (a wrong one raises ImproperlyConfigured before
        # anything runs, as nothing is read at import time), and again whenever one of the
        # values is another object than the one validated.
        cached = _VALIDATED.get(cls)
        if cached is None or not all(map(operator.is_, cached[0], raw)):
            operation, required, ttl, lease, recovery, methods, key = raw
            arguments = _options.validated(
                f"IdempotencyMixin on {_validation.name_of(cls)}",
                {
                    "operation": operation,
                    "required": required,
                    "ttl": ttl,
                    "lease": lease,
                    "recovery": recovery,
                    "methods": methods,
                },
                accepted=_MIXIN_OPTIONS,
                prefix="idempotency_",
            )
            overridden = cls.get_idempotency_key is not IdempotencyMixin.get_idempotency_key
            source = None if overridden else self._validated_key_source(key)
            hooks = (
                cls.get_idempotency_account is not IdempotencyMixin.get_idempotency_account
                or cls.get_idempotency_fingerprint
                is not IdempotencyMixin.get_idempotency_fingerprint
                or overridden
            )
            # Without an overridden hook, nothing depends on the instance: one Options serves.
            whole = None if hooks else _options.Options(**arguments, key=source)
            cached = (raw, arguments, source, whole)
            _VALIDATED[cls] = cached
        _, arguments, source, whole = cached
        if whole is not None:
            return whole
        # An overridden hook is the view's own account, fingerprint or key; otherwise the
        # settings' (so the stored fingerprint version is the settings' one), and the
        # attribute's key source, else the header.
        account = (
            self.get_idempotency_account
            if cls.get_idempotency_account is not IdempotencyMixin.get_idempotency_account
            else None
        )
        fingerprint = (
            self.get_idempotency_fingerprint
            if cls.get_idempotency_fingerprint is not IdempotencyMixin.get_idempotency_fingerprint
            else None
        )
        key = (
            self.get_idempotency_key
            if cls.get_idempotency_key is not IdempotencyMixin.get_idempotency_key
            else source
        )
        return _options.Options(**arguments, key=key, account=account, fingerprint=fingerprint)

    def _idempotency_terms(self) -> _options.Terms:
        # The view's options with the settings filled in: worked out once per view and
        # loading of the settings (Options.terms), read here without a call per request.
        options = self._idempotency_options()
        cached = options.cached_terms
        if cached is not None and cached[0] is app_settings.loaded():
            return cached[1]
        return options.terms()

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> HttpResponseBase:
        # "Is this method protected?" is decided here, once per request: initial() reads the
        # answer (the terms, or None) rather than asking again.
        terms = self._idempotency_terms()
        method = request.method  # Terms.protects, inline: no call on every request's path
        protects = method in terms.methods or (method or "").upper() in terms.methods
        self.__dict__["_idempotency_protects"] = terms if protects else None
        dispatch = super().dispatch  # type: ignore[misc]
        if protects:
            response: HttpResponseBase = dispatch(request, *args, **kwargs)
            return response
        _http.unprotected(request)  # request.idempotency is None, as under @idempotent
        return _atomic_requests.with_atomic_requests(
            terms.database,
            lambda: dispatch(request, *args, **kwargs),
            _atomic_requests.marks_of(request),
        )

    # No _non_atomic_requests on the mixin's dispatch: as_view() gives each view function
    # its own. One here would be copied over a view's opt-out by
    # method_decorator(transaction.non_atomic_requests, name="dispatch"), which copies the
    # decorated method's attributes after its decorators'.

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        terms = self.__dict__.get("_idempotency_protects", _MISSING)
        if terms is _MISSING:  # a dispatch of the view's own that does not call the mixin's
            terms = self._idempotency_terms()
            if not (
                request.method in terms.methods or (request.method or "").upper() in terms.methods
            ):
                super().initial(request, *args, **kwargs)  # type: ignore[misc]
                _http.unprotected(request)
                return
        if terms is None:
            super().initial(request, *args, **kwargs)  # type: ignore[misc]
            return
        name = (request.method or "").lower()
        handler = getattr(self, name, None) if name in self.http_method_names else None  # type: ignore[attr-defined]
        try:
            super().initial(request, *args, **kwargs)  # type: ignore[misc]
        except db.Error as error:
            if handler is None:
                raise
            # Authentication (the session's user), a permission or a throttle read the
            # database, which failed: the store's 503, nothing run.
            refusal = _http.failed_before_the_claim(request, self._idempotency_options(), error)
            setattr(self, name, lambda *args, **kwargs: refusal)
            return
        # Authentication, permissions and throttles have passed: wrap the handler DRF is
        # about to call, so the claim comes right before it.
        if handler is None:
            return
        view = self
        assert isinstance(view, APIView)
        options = self._idempotency_options()
        cls = type(self)
        if options.operation is not None:
            operation: str | Callable[[], str] = options.operation
        elif cls.get_idempotency_operation is not IdempotencyMixin.get_idempotency_operation:
            operation = lambda: self.get_idempotency_operation(request)  # noqa: E731
        else:
            operation = _viewset_operation(view) or (lambda: _http.route_operation(request, cls))

        def protected(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            return _http.protected(
                request,
                lambda: _finalized(view, request, lambda: handler(request, *args, **kwargs)),
                options,
                terms,
                operation,
            )

        setattr(self, name, protected)
