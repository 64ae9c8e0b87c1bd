"""``run_once``: the engine's guarantee for any code path, without an HTTP request.

Queue consumers, management commands, scheduled jobs and agent tool calls claim
``(account, operation, key)`` with the same statements as a request; the callable and the
completion of the record share one transaction, and a duplicate gets the stored result.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

from django import db
from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency import _autonomous, _core, _validation
from django_idempotency.conf import app_settings
from django_idempotency.crypto import Unreadable
from django_idempotency.exceptions import (
    InProgress,
    KeyReused,
    OutcomeUnknown,
    StoreUnavailable,
    seconds_left,
)
from django_idempotency.keys import validate_key
from django_idempotency.states import COMPLETED, FAILED

logger = logging.getLogger("django_idempotency")

T = TypeVar("T")

#: The fingerprint version of records made by ``run_once``.
FINGERPRINT_VERSION = "call-v1"
# Without a fingerprint every call with the same key is the same request.
_NO_FINGERPRINT = hashlib.sha256(b"").hexdigest()


class LeaseTakenOver(InProgress):
    """This attempt outlived its lease and another attempt took the record over: its work
    was rolled back. A kind of :class:`InProgress`: the other attempt is running."""


def fingerprint_of(value: Any) -> str:
    """The hash stored for a ``fingerprint=``: a string as it is, any other JSON-able value
    in canonical form (sorted keys, no insignificant whitespace)."""
    if value is None:
        return _NO_FINGERPRINT
    text = (
        value
        if isinstance(value, str)
        else json.dumps(
            value, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder, allow_nan=False
        )
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def stored_result(result: Any) -> _core.Outcome:
    """The record's outcome for a return value; ``TypeError`` when it is not JSON."""
    try:
        body = json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"run_once stores the callable's result as JSON, and {type(result).__name__} "
            f"is not JSON ({exc}); nothing was committed"
        ) from exc
    return _core.Outcome(200, [["Content-Type", "application/json"]], body)


def outcome_of(result: Any) -> _core.Outcome | None:
    """What is stored for a result, or ``None`` when it is not JSON (the recovery job's
    test of a recovery callable's answer)."""
    try:
        return stored_result(result)
    except TypeError:
        return None


def run_once(
    func: Callable[..., T],
    /,
    *args: Any,
    account: str,
    operation: str,
    key: str,
    ttl: timedelta | int | None = None,
    lease: timedelta | int | None = None,
    recovery: str | Callable[[Any], Any] | None = None,
    fingerprint: Any = None,
    **kwargs: Any,
) -> T:
    """Run ``func(*args, **kwargs)`` at most once per ``(account, operation, key)``.

    - First call: ``func`` runs inside one ``transaction.atomic()`` together with the
      completion of the record, and its result is returned (and stored as JSON).
    - A completed duplicate returns the stored result (what ``json.loads`` gives back)
      without calling ``func``. A result that cannot be stored as JSON raises ``TypeError``:
      nothing commits and the claim is released.
    - Another live attempt holds the lease: ``django_idempotency.InProgress``, with
      ``retry_after`` the whole seconds left of that lease. An attempt whose lease was taken
      over while it ran has its work rolled back and raises it too.
    - ``fingerprint`` (a string, or a JSON-able value hashed canonically): a used key with
      another fingerprint raises ``django_idempotency.KeyReused``. A record closed by
      the ``"fail"`` recovery policy raises ``django_idempotency.OutcomeUnknown``.
    - ``func`` raises: its database work rolls back, the claim is released, the exception
      propagates.

    ``ttl``, ``lease`` and ``recovery`` default to the ``TTL``, ``LEASE`` and ``RECOVERY``
    settings, and follow the decorator's rules: a zero, negative or boolean duration, an
    unknown policy (``"Fail"``), a ``ttl`` given with a ``lease`` not longer than it, a
    fingerprint that is not JSON, an empty ``account`` or ``operation`` raise
    ``ImproperlyConfigured`` before anything runs or is stored. A recovery callable gets the
    record and returns a result to store, or ``None`` to run ``func`` again.

    Inside a transaction of the caller's (``transaction.atomic()``, a protected view), the
    claim still commits on its own at once, and the callable's work and the completion
    commit with the caller's transaction.
    """
    return call_once(
        func,
        args,
        kwargs,
        account=account,
        operation=operation,
        key=key,
        ttl=ttl,
        lease=lease,
        recovery=recovery,
        fingerprint=fingerprint,
    )


def call_once(
    func: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    account: str,
    operation: str,
    key: str,
    ttl: timedelta | int | None = None,
    lease: timedelta | int | None = None,
    recovery: str | Callable[[Any], Any] | None = None,
    fingerprint: Any = None,
) -> T:
    """:func:`run_once` with the callable's arguments as a tuple and a dict, so that they
    may use any name (the Celery adapter passes a task's own arguments through)."""
    # The decorator's rules, through the same code: a wrong value raises before anything runs.
    where = f"run_once(operation={operation!r})"
    checked = _validation.view_arguments(
        where, operation=operation, ttl=ttl, lease=lease, recovery=recovery
    )
    if not isinstance(account, str) or not account:
        raise ImproperlyConfigured(
            f"{where}: account must be a non-empty string naming who the key belongs to, "
            f"such as 'consumer:shipping'; got {_validation.describe(account)}."
        )
    if operation is None:  # view_arguments reads None as "the default": there is none here
        raise ImproperlyConfigured(f"{where}: operation must be a non-empty string; got None.")
    policy = checked["recovery"] if recovery is not None else app_settings.RECOVERY
    ttl = checked["ttl"] if ttl is not None else app_settings.TTL
    lease = checked["lease"] if lease is not None else app_settings.LEASE
    try:
        request_hash = fingerprint_of(fingerprint)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(
            f"{where}: fingerprint must be a string or a JSON-able value; "
            f"got {_validation.describe(fingerprint)} ({exc})."
        ) from None
    op = _core.Operation(
        alias=app_settings.DATABASE,
        account=_core.storable_name(account),
        operation=_core.storable_name(operation),
        key=validate_key(key),
        request_hash=request_hash,
        fingerprint_version=FINGERPRINT_VERSION,
        recovery_policy=_core.recovery_name(policy),
        ttl=ttl,
        lease=lease,
    )
    try:
        result = _core.claim(op)
    except db.Error as exc:  # any error of the database's, InterfaceError included
        logger.warning("idempotency store unavailable during the claim of %s", op.operation)
        _autonomous.discard_broken(op.alias)  # the next call connects afresh
        raise StoreUnavailable(
            f"{op.operation} was not run: its idempotency key could not be recorded ({exc})"
        ) from exc
    state = result.state
    if not result.claimed:
        return cast(T, _duplicate(op, state))
    assert state.lease_token is not None
    token = state.lease_token
    context = _core.IdempotencyContext(
        key=op.key, operation=op.operation, account=op.account, record_id=state.id
    )
    if result.took_over_stale_lease:
        recovered = _recover(op, state.id, token, _core.resolve_recovery(policy))
        if recovered is not None:
            return cast(T, recovered)
    try:
        with _core.running(context):
            fenced = _core.run_owned(
                policy,
                op.alias,
                state.id,
                token,
                lambda: func(*args, **kwargs),
                stored_result,
                fresh=not result.took_over_stale_lease,
            )
    except _core.LeaseLost:
        try:
            now_state = _core.fetch(op)
        except db.Error:  # only the Retry-After is at stake
            now_state = None
        raise LeaseTakenOver(
            f"this attempt of {op.operation} lost its lease to another attempt; "
            "its work was rolled back",
            retry_after=seconds_left(now_state.lease_expires_at if now_state else None),
        ) from None
    return cast(T, fenced.result)


def _duplicate(op: _core.Operation, state: Any) -> Any:
    if (
        state.fingerprint_version == op.fingerprint_version
        and state.request_hash != op.request_hash
    ):
        raise KeyReused(
            f"key {op.key!r} of {op.operation} was first used with another fingerprint; "
            "use a new key for a new operation"
        )
    if state.status == COMPLETED:
        context = _core.IdempotencyContext(op.key, op.operation, op.account, record_id=state.id)
        if state.unreadable is not None:
            raise _core.refuse_unreadable(context, state.unreadable)
        try:
            return json.loads(state.response_body) if state.response_body else None
        except (ValueError, RecursionError):
            raise _core.refuse_unreadable(
                context, Unreadable(None, "the stored result is not JSON")
            ) from None
    if state.status == FAILED:
        raise OutcomeUnknown(
            f"an earlier attempt of {op.operation} with key {op.key!r} stopped midway; "
            "whether it took effect is unknown, and it will not be run again"
        )
    raise InProgress(
        f"another attempt of {op.operation} with key {op.key!r} is running",
        retry_after=seconds_left(state.lease_expires_at),
    )


def _recover(op: _core.Operation, record_id: int, token: Any, policy: Any) -> Any:
    from django_idempotency.models import IdempotencyRecord

    try:
        recovered = _core.recover(
            policy,
            load_record=lambda: (
                IdempotencyRecord.objects.using(op.alias)
                .filter(pk=record_id, lease_token=token)
                .first()
            ),
            fail_outcome=lambda: _core.failure_outcome(op.key, op.operation),
            as_outcome=stored_result,
            close=lambda outcome: _core.close(op.alias, record_id, token, outcome),
        )
    except Exception:  # StoreUnavailable, or a policy that could not decide
        _core.give_back(op.alias, record_id, token)
        raise
    if recovered.lease_lost:
        raise LeaseTakenOver(
            f"the recovery of {op.operation} lost its lease to another attempt",
            retry_after=seconds_left(None),
        )
    name = _core.recovery_name(policy)

    def announce(outcome: str) -> None:
        _core.announce_recovery(op.account, op.operation, op.key, name, outcome, record_id)

    if recovered.run:
        # As the request path says it: the policy ran the callable again, or resumes it.
        announce("resumed" if policy == _core.RESUME else "retried")
        return None
    assert recovered.outcome is not None
    if recovered.outcome.status == FAILED:
        announce("failed")
        raise OutcomeUnknown(
            f"an earlier attempt of {op.operation} with key {op.key!r} stopped midway; "
            "whether it took effect is unknown, and it will not be run again"
        )
    announce("completed")
    return recovered.answer
