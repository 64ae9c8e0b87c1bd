"""The per-view options, declared once.

:class:`ViewOptions` is what ``@idempotent`` (Django and DRF views) and ninja's
``@idempotent`` take, and what the DRF mixin's ``idempotency_*`` attributes spell with a
prefix; :class:`TaskOptions` is the task decorator's share of them. :data:`RULES` says what
each option admits, and :func:`validated` applies the rules when a view is decorated (or a
mixin view first called): a wrong or unknown option raises ``ImproperlyConfigured`` naming
the view and the option, before any request. :class:`Options` holds one view's validated
options and, per loading of the settings, its :class:`Terms`: the options with the
``IDEMPOTENCY`` setting filled in, read on every request.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypedDict

from django.core.exceptions import ImproperlyConfigured
from django.http.response import HttpResponseBase

from django_idempotency import _validation, conf
from django_idempotency._recovery import recovery_name
from django_idempotency._validation import Invalid
from django_idempotency.conf import app_settings
from django_idempotency.fingerprint import fingerprint_version
from django_idempotency.models import IdempotencyRecord

__all__ = [
    "RULES",
    "VIEW_RULES",
    "Fingerprint",
    "KeySource",
    "Options",
    "Recovery",
    "Resolver",
    "TaskOptions",
    "Terms",
    "ToolOptions",
    "ViewOptions",
    "validated",
]

#: ``"retry"``, ``"fail"``, ``"resume"``, or ``recover(record)`` answering a response (or
#: ``None``: run again).
Recovery = str | Callable[[IdempotencyRecord], HttpResponseBase | None]
#: ``request -> str | None``: the caller's account.
Resolver = Callable[[Any], str | None]
#: ``request -> str``: the hash a retry is compared by.
Fingerprint = Callable[[Any], str]
#: ``request -> str | None``: the key, where it is not the ``HEADER`` setting's header.
KeySource = Callable[[Any], str | None]


class ViewOptions(TypedDict, total=False):
    """The options of a protected view; each one left out (or ``None``) is the setting's."""

    #: The operation's name; default: the route (``POST charges/``) or the viewset action.
    operation: str | None
    #: Whether a protected method without a key is refused (``REQUIRED``).
    required: bool | None
    #: How long a record deduplicates retries (``TTL``), a ``timedelta`` or seconds.
    ttl: timedelta | int | None
    #: How long a claim is owned before a retry may take it over (``LEASE``).
    lease: timedelta | int | None
    #: ``"retry"``, ``"fail"``, ``"resume"``, a callable or its dotted path (``RECOVERY``).
    recovery: Recovery | None
    #: ``request -> str | None`` or its dotted path (``ACCOUNT_RESOLVER``).
    account: Resolver | str | None
    #: ``request -> str`` or its dotted path (``FINGERPRINT``).
    fingerprint: Fingerprint | str | None
    #: The methods that need a key (``METHODS``): a list, tuple or set of names.
    methods: Collection[str] | None
    #: ``request -> str | None`` or its dotted path: where the key comes from (``HEADER``).
    key: KeySource | str | None


class TaskOptions(TypedDict, total=False):
    """The options of a task under ``@idempotent_task()``."""

    #: ``(*args, **kwargs) -> str | None``: the delivery's identity; default: the message's.
    key: Callable[..., str | None] | str | None
    ttl: timedelta | int | None
    lease: timedelta | int | None
    recovery: Recovery | None


class ToolOptions(TypedDict, total=False):
    """The options of an MCP tool under ``@idempotent_tool()``."""

    #: The caller's account: a string, or ``Context -> str | None``; default: the MCP
    #: principal of the access token.
    account: str | Callable[[Any], str | None] | None
    #: The operation's name; default ``tool:<name>``.
    operation: str | None
    ttl: timedelta | int | None
    lease: timedelta | int | None
    recovery: Recovery | None
    #: How long a duplicate in flight waits for the original's outcome (default: not at all).
    wait: timedelta | int | None
    #: Whether a call without a key is refused (default ``True``).
    required: bool | None


#: What each option admits. ``None`` is always "the setting decides".
RULES: dict[str, Callable[[Any], Any]] = {
    "operation": _validation.operation,
    "required": _validation.flag,
    "ttl": _validation.duration,
    "lease": _validation.duration,
    "recovery": _validation.recovery,
    "account": _validation.callable_ref,
    "fingerprint": _validation.fingerprint,
    "methods": lambda value: tuple(sorted(_validation.methods(value))),
    "key": _validation.callable_ref,
    "wait": _validation.duration_or_zero,
}


def _key_source(value: Any) -> KeySource | str:
    # Kept as it is, a dotted path imported on the first request: it may name a function of
    # the very module being decorated, which is not fully imported yet.
    if callable(value) or (isinstance(value, str) and "." in value.strip(".")):
        return value  # type: ignore[no-any-return]
    raise Invalid(
        "a callable request -> str | None, a dotted path to one or a "
        "django_idempotency.sources helper",
        value,
    )


#: The rules of a view's options: a key source is imported when it is first used.
VIEW_RULES: dict[str, Callable[[Any], Any]] = {**RULES, "key": _key_source}


def validated(
    where: str,
    given: Mapping[str, Any],
    accepted: Collection[str] = ViewOptions.__optional_keys__,
    prefix: str = "",
    rules: Mapping[str, Callable[[Any], Any]] = RULES,
) -> dict[str, Any]:
    """``given``, validated: every name of ``accepted``, ``None`` where it was left out.

    ``where`` names the view for the message (``"@idempotent on app.views.create"``) and
    ``prefix`` is how the adapter spells the options (``"idempotency_"`` for the mixin's
    attributes). Raises ``ImproperlyConfigured`` naming the view, the option and what it
    expected; an option ``accepted`` does not name is refused the same way (with the
    nearest name). A ``ttl`` given with a ``lease`` must be longer than it.
    """
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(accepted), n=1)
        hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
        raise ImproperlyConfigured(
            f"{where}: unknown option {prefix}{unknown[0]}{hint}; the options are "
            f"{', '.join(prefix + name for name in sorted(accepted))}."
        )
    cleaned: dict[str, Any] = {}
    for name in accepted:
        value = given.get(name)
        if value is None:
            cleaned[name] = None
            continue
        try:
            cleaned[name] = rules[name](value)
        except Invalid as exc:
            raise ImproperlyConfigured(f"{where}: {prefix}{name} {exc}.") from None
    ttl, lease = cleaned.get("ttl"), cleaned.get("lease")
    if ttl is not None and lease is not None and ttl <= lease:
        raise ImproperlyConfigured(
            f"{where}: {prefix}ttl ({ttl}) must be longer than {prefix}lease ({lease}), or a "
            "record could expire while its first attempt still runs."
        )
    return cleaned


@dataclass(frozen=True)
class Options:
    """One view's validated options; ``None`` means "use the ``IDEMPOTENCY`` setting"."""

    operation: str | None = None
    required: bool | None = None
    ttl: timedelta | int | None = None
    lease: timedelta | int | None = None
    recovery: Recovery | None = None
    account: Resolver | str | None = None
    fingerprint: Fingerprint | str | None = None
    methods: tuple[str, ...] | None = None
    #: Where the key comes from: a callable ``request -> str | None`` (or its dotted path);
    #: ``None``: the ``HEADER`` setting's header.
    key: KeySource | str | None = None
    #: The terms worked out under one loading of the settings: ``(settings, terms)``. An
    #: adapter on the request path may read them here, checking the settings are still
    #: ``app_settings.loaded()``, rather than call :meth:`terms`.
    cached_terms: tuple[dict[str, Any], Terms] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def of(cls, where: str, given: Mapping[str, Any], prefix: str = "") -> Options:
        """A view's options, validated (see :func:`validated`)."""
        return cls(**validated(where, given, prefix=prefix, rules=VIEW_RULES))

    def terms(self) -> Terms:
        """These options with the settings filled in, worked out again only when the
        settings change (``setting_changed``); read on every request."""
        settings = app_settings.loaded()
        cached = self.cached_terms
        if cached is not None and cached[0] is settings:
            return cached[1]
        fingerprint = conf.resolve_callable(self.fingerprint or app_settings.FINGERPRINT)
        recovery = self.recovery or app_settings.RECOVERY
        terms = Terms(
            methods=(
                frozenset(m.upper() for m in self.methods) if self.methods else app_settings.METHODS
            ),
            database=app_settings.DATABASE,
            account=conf.resolve_callable(self.account or app_settings.ACCOUNT_RESOLVER),
            fingerprint=fingerprint,
            fingerprint_version=fingerprint_version(fingerprint),
            recovery=recovery,
            recovery_name=recovery if recovery.__class__ is str else recovery_name(recovery),
            lease=conf.as_timedelta(self.lease) if self.lease is not None else app_settings.LEASE,
            ttl=conf.as_timedelta(self.ttl) if self.ttl is not None else app_settings.TTL,
        )
        object.__setattr__(self, "cached_terms", (settings, terms))
        return terms

    def protects(self, method: str | None) -> bool:
        """Whether requests with ``method`` need (or may carry) a key."""
        return self.terms().protects(method)


@dataclass(frozen=True, slots=True)
class Terms:
    """An :class:`Options` with the settings filled in and its callables imported."""

    methods: frozenset[str]
    database: str
    account: Resolver
    fingerprint: Fingerprint
    fingerprint_version: str
    recovery: Recovery
    recovery_name: str
    lease: timedelta
    ttl: timedelta

    def protects(self, method: str | None) -> bool:
        """Whether a request of ``method`` reaches the claim (``_http.handle`` and the DRF
        mixin's ``dispatch`` ask the same inline: a call there is one more hand-off on every
        request's path, docs/architecture.md)."""
        return method in self.methods or (method or "").upper() in self.methods
