"""``run_once``: the engine's guarantee for any code path, without an HTTP request.

Queue consumers, management commands, scheduled jobs and agent tool calls claim
``(account, operation, key)`` with the same statements as a request; the callable and the
completion of the record share one transaction, and a duplicate gets the stored result.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast

from django import db
from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency import _autonomous, _options, _recovery, _validation
from django_idempotency._claims import Claim, LeaseLost, claim, fetch, retry_after, wait_for
from django_idempotency._context import IdempotencyContext, Operation, running
from django_idempotency._execution import run_owned
from django_idempotency._outcomes import Outcome, refuse_unreadable
from django_idempotency._recovery import recovery_name, resolve_recovery
from django_idempotency._storable import remembered_names
from django_idempotency._store import RecordState
from django_idempotency.conf import app_settings
from django_idempotency.crypto import Unreadable
from django_idempotency.exceptions import (
    InProgress,
    KeyReused,
    OutcomeUnknown,
    StoreUnavailable,
)
from django_idempotency.keys import validate_key
from django_idempotency.states import COMPLETED, FAILED, IN_PROGRESS

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


def stored_result(result: Any) -> Outcome:
    """The record's outcome for a return value; ``TypeError`` when it is not JSON."""
    try:
        body = json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # nested past the stack's depth
        raise TypeError(
            f"run_once stores the callable's result as JSON, and {type(result).__name__} "
            f"is not JSON ({exc}); nothing was committed"
        ) from exc
    return Outcome(200, [["Content-Type", "application/json"]], body)


def outcome_of(result: Any) -> Outcome | None:
    """What is stored for a result, or ``None`` when it is not JSON (the recovery job's
    test of a recovery callable's answer)."""
    return _encoded(stored_result, result)


def loaded_result(body: bytes) -> Any:
    """A stored result as ``json.loads`` gives it back (an empty body: ``None``)."""
    return json.loads(body) if body else None


@dataclass(frozen=True)
class OnceResult(Generic[T]):
    """What ``run_once_result`` gives back: the callable's result, and whether it was
    replayed (stored by an earlier call with the key) rather than produced by this call."""

    value: T
    replayed: bool


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
    ).value


def run_once_result(
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
) -> OnceResult[T]:
    """``run_once``, telling whether the result was replayed.

    The same arguments, rules and exceptions; the result comes back as
    ``OnceResult``: ``value`` (what ``run_once`` returns) and ``replayed``
    (``True`` when a call before this one stored it, so ``func`` did not run now)::

        result = run_once_result(charge, order, account=..., operation=..., key=key)
        if not result.replayed:
            notify_customer(result.value)
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
    wait: timedelta | None = None,
    encode: Callable[[Any], Outcome | None] = stored_result,
    decode: Callable[[bytes], Any] = loaded_result,
) -> OnceResult[T]:
    """:func:`run_once_result` with the callable's arguments as a tuple and a dict, so that
    they may use any name (the task adapters pass a task's own arguments through).

    For the entry points: ``wait`` lets a duplicate in flight wait (bounded, holding no lock
    or connection) for the original's outcome rather than raise ``InProgress``; ``encode``
    turns a result into the stored outcome (``TypeError`` when it cannot; ``None`` for a
    result that is no outcome: its work rolls back, the claim is released and the result
    returned, as for a response the HTTP side does not store), ``decode`` a
    stored body back into the result (``ValueError``/``TypeError`` when it cannot: the
    record is unreadable).
    """
    # The decorator's rules, through the same code: a wrong value raises before anything runs.
    checked = _checked(operation, ttl, lease, recovery)
    if not isinstance(account, str) or not account:
        raise ImproperlyConfigured(
            f"{_where(operation)}: account must be a non-empty string naming who the key "
            f"belongs to, such as 'consumer:shipping'; got {_validation.describe(account)}."
        )
    checked_ttl, checked_lease, checked_policy = checked
    policy = checked_policy if checked_policy is not None else app_settings.RECOVERY
    ttl = checked_ttl if checked_ttl is not None else app_settings.TTL
    lease = checked_lease if checked_lease is not None else app_settings.LEASE
    try:
        request_hash = fingerprint_of(fingerprint)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(
            f"{_where(operation)}: fingerprint must be a string or a JSON-able value; "
            f"got {_validation.describe(fingerprint)} ({exc})."
        ) from None
    stored_account, stored_operation, legacy = remembered_names(account, operation)
    op = Operation(
        alias=app_settings.DATABASE,
        account=stored_account,
        operation=stored_operation,
        key=validate_key(key),
        request_hash=request_hash,
        fingerprint_version=FINGERPRINT_VERSION,
        recovery_policy=recovery_name(policy),
        ttl=ttl,
        lease=lease,
        legacy=legacy,
    )
    try:
        result, owned = claim(op)
    except db.Error as exc:  # any error of the database's, InterfaceError included
        raise _unavailable(op, exc) from exc
    state = result.state
    if owned is None:
        if wait and state.status == IN_PROGRESS and state.request_hash == op.request_hash:
            try:
                # Between its reads it holds no connection (a tool's or a task's thread).
                done = wait_for(op, state, wait, release=True)
            except db.Error as exc:
                raise _unavailable(op, exc) from exc
            if done is None:  # released, or its lease ran out: claim once more, and no wait
                return call_once(
                    func, args, kwargs, account=account, operation=operation, key=key,
                    ttl=ttl, lease=lease, recovery=recovery, fingerprint=fingerprint,
                    encode=encode, decode=decode,
                )  # fmt: skip
            state = done
        return OnceResult(_duplicate(op, state, decode), replayed=True)
    context = IdempotencyContext(
        key=op.key, operation=op.operation, account=op.account, record_id=state.id
    )
    if result.took_over_stale_lease:
        recovered = _recover(op, owned, policy, state.recovery_policy, encode)
        if recovered is not None:
            return OnceResult(recovered, replayed=False)
    try:
        with running(context):
            fenced = run_owned(
                policy,
                owned,
                lambda: func(*args, **kwargs),
                encode,
                fresh=not result.took_over_stale_lease,
            )
    except LeaseLost:
        try:
            now_state = fetch(op)
        except db.Error:  # only the Retry-After is at stake
            now_state = None
        raise LeaseTakenOver(
            f"this attempt of {op.operation} lost its lease to another attempt; "
            "its work was rolled back",
            retry_after=retry_after(now_state.lease_expires_at if now_state else None),
        ) from None
    return OnceResult(cast(T, fenced.result), replayed=False)


def _where(operation: object) -> str:
    return f"run_once(operation={operation!r})"


Checked = tuple[timedelta | None, timedelta | None, Any]


def _checked(operation: str, ttl: Any, lease: Any, recovery: Any) -> Checked:
    """``ttl``, ``lease`` and ``recovery`` validated as the decorator's (``None``: the
    setting's), with ``operation``; ``ImproperlyConfigured`` naming the wrong one. The same
    few values come back on every call of an entry point (a task's, a tool's): each
    combination is validated once (:func:`_checked_once`), unless a value cannot be
    remembered (an unhashable recovery callable)."""
    try:
        return _checked_once(operation, ttl, lease, recovery)
    except TypeError:  # unhashable: validated on every call
        return _validate(operation, ttl, lease, recovery)


def _validate(operation: str, ttl: Any, lease: Any, recovery: Any) -> Checked:
    where = _where(operation)
    checked = _options.validated(
        where,
        {"operation": operation, "ttl": ttl, "lease": lease, "recovery": recovery},
        accepted=("operation", "ttl", "lease", "recovery"),
    )
    if operation is None:  # validated() reads None as "the default": there is none here
        raise ImproperlyConfigured(f"{where}: operation must be a non-empty string; got None.")
    return checked["ttl"], checked["lease"], checked["recovery"]


# typed: True and 1 are told apart (a boolean duration is refused, a number of seconds not).
_checked_once = functools.lru_cache(maxsize=1024, typed=True)(_validate)


def _unavailable(op: Operation, exc: Exception) -> StoreUnavailable:
    logger.warning("idempotency store unavailable during the claim of %s", op.operation)
    _autonomous.discard_broken(op.alias)  # the next call connects afresh
    return StoreUnavailable(
        f"{op.operation} was not run: its idempotency key could not be recorded ({exc})"
    )


def _duplicate(op: Operation, state: RecordState, decode: Callable[[bytes], Any]) -> Any:
    """The stored result of a duplicate; the named exception that refuses it otherwise."""
    if (
        state.fingerprint_version == op.fingerprint_version
        and state.request_hash != op.request_hash
    ):
        raise KeyReused(
            f"key {op.key!r} of {op.operation} was first used with another fingerprint; "
            "use a new key for a new operation"
        )
    if state.status == COMPLETED:
        context = IdempotencyContext(op.key, op.operation, op.account, record_id=state.id)
        if state.unreadable is not None:
            raise refuse_unreadable(context, state.unreadable)
        try:
            return decode(state.response_body or b"")
        except (ValueError, TypeError, RecursionError):
            raise refuse_unreadable(
                context, Unreadable(None, "the stored result cannot be decoded")
            ) from None
    if state.status == FAILED:
        raise OutcomeUnknown(
            f"an earlier attempt of {op.operation} with key {op.key!r} stopped midway; "
            "whether it took effect is unknown, and it will not be run again"
        )
    raise InProgress(
        f"another attempt of {op.operation} with key {op.key!r} is running",
        retry_after=retry_after(state.lease_expires_at),
    )


def _recover(
    op: Operation,
    owned: Claim,
    current: Any,
    claimed_under: str | None,
    encode: Callable[[Any], Outcome | None],
) -> Any:
    """The recovery policy's answer to return, or ``None`` to run the callable.
    ``current``: the call's policy; ``claimed_under``: the stored one of the stale record
    (which has its say, :func:`._recovery.deciding`)."""
    runs_under = op.recovery_policy if claimed_under not in (None, op.recovery_policy) else None
    try:
        policy = resolve_recovery(_recovery.deciding(claimed_under, current))
        recovered = _recovery.recover(
            owned,
            policy,
            account=op.account,
            key=op.key,
            operation=op.operation,
            as_outcome=encode,  # raises TypeError for an answer it cannot store
            runs_under=runs_under,
        )
    except Exception:  # StoreUnavailable, or a policy that could not decide
        owned.give_back()
        raise
    name = recovery_name(policy)

    def announce(outcome: str) -> None:
        _recovery.announce(op, owned.record_id, name, outcome)

    match recovered:
        case _recovery.Lost():
            raise LeaseTakenOver(
                f"the recovery of {op.operation} lost its lease to another attempt",
                retry_after=retry_after(None),
            )
        case _recovery.Run():
            announce(recovered.name)
            return None
        case _recovery.Undecided(answer=answer):  # an encoder that answers None
            owned.give_back()
            raise TypeError(
                f"the recovery policy of {op.operation} answered {type(answer).__name__}, "
                "which cannot be stored; the record is left for the next attempt"
            )
        case _recovery.Closed(outcome=outcome, answer=answer):
            announce(recovered.name)
            if outcome.status == FAILED:
                raise OutcomeUnknown(
                    f"an earlier attempt of {op.operation} with key {op.key!r} stopped "
                    "midway; whether it took effect is unknown, and it will not be run again"
                )
            return answer


def _encoded(encode: Callable[[Any], Outcome], answer: Any) -> Outcome | None:
    try:
        return encode(answer)
    except TypeError:
        return None
