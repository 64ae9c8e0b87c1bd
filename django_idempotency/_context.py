"""The operation: what one claim is for (:class:`Operation`), and the running operation
(:class:`IdempotencyContext`, and :func:`current` to find it).

``(account, operation, key)`` names a record; the request's fingerprint (``request_hash``,
made by ``fingerprint_version``), the recovery policy's name, the lease and the TTL are its
terms. Every entry point (a request, ``run_once``, a task, a tool call) builds one
:class:`Operation`, hands it to the same claim (:mod:`django_idempotency._claims`), and makes
the context of the operation it runs :func:`current` while the operation's code runs.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.utils.crypto import salted_hmac

from django_idempotency.fingerprint import django_request

__all__ = ["IdempotencyContext", "Operation", "context_of", "current", "running"]


@dataclass
class IdempotencyContext:
    """The running operation: who and what its key belongs to, and whether it was replayed.

    ``request.idempotency`` in a protected view (typed: ``context_of(request)``), and
    ``django_idempotency.current()`` inside any protected operation: a view, a
    ``run_once`` callable, a task, a tool.
    """

    key: str
    operation: str
    account: str
    replayed: bool = False
    record_id: int | None = field(default=None, repr=False)

    def downstream_key(self, name: str) -> str:
        """A key for a provider call, the same on every retry, takeover and recovery run.

        A keyed hash (HMAC-SHA256 with ``SECRET_KEY``) of ``(account, operation, key, name)``:
        the client's raw key never reaches the provider, and two accounts never share one.
        """
        parts = (self.account, self.operation, self.key, name)
        if any(_SEPARATOR in part for part in parts):
            # The joined form would be ambiguous: the parts as a JSON list (its control
            # characters escaped, so it holds no separator, which every joined form does).
            message = json.dumps(parts)
        else:
            message = _SEPARATOR.join(parts)  # the form every earlier release hashed
        return salted_hmac("django_idempotency.downstream", message, algorithm="sha256").hexdigest()


#: What joins the names a downstream key is made of.
_SEPARATOR = "\x1f"


_current: contextvars.ContextVar[IdempotencyContext | None] = contextvars.ContextVar(
    "django_idempotency_current", default=None
)


def current() -> IdempotencyContext | None:
    """The running protected operation's context, else ``None``."""
    return _current.get()


@contextmanager
def running(context: IdempotencyContext) -> Iterator[None]:
    """Make ``context`` the :func:`current` one while the body runs."""
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)


def context_of(request: Any) -> IdempotencyContext | None:
    """``request.idempotency``, typed: the context of a protected request, else ``None``.

    Works with a Django ``HttpRequest`` and a DRF ``Request`` alike::

        context = context_of(request)
        assert context is not None  # the view is protected
        provider.charge(key=context.downstream_key("charge"))
    """
    context = getattr(django_request(request), "idempotency", None)
    return context if isinstance(context, IdempotencyContext) else None


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation's record: where it lives, whose and which it is, and its terms."""

    alias: str
    account: str
    operation: str
    key: str
    request_hash: str
    fingerprint_version: str
    recovery_policy: str
    lease: timedelta
    ttl: timedelta
    #: ``(account, operation)`` as an earlier release stored them, where that differs (see
    #: :func:`._storable.legacy_names`): the claim adopts a record written so. ``None`` for
    #: nearly all. A third item, where the operation's spelling changed and the fingerprint
    #: reads it: the request's hash as the earlier release made it, which the adopted record
    #: takes today's.
    legacy: tuple[str, ...] | None = None
