"""The framework-neutral engine: claim, fenced execution, recovery.

The HTTP adapters (``engine.handle``: the decorator, the DRF mixin, the ninja decorator),
:func:`django_idempotency.run_once` and the Celery task decorator all go through these
functions; the recovery job too. None of them knows about HTTP: an outcome is a status, a
few headers and a body, stored as they are.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from django import db
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from django_idempotency import _autonomous, _problems, _store, conf, signals
from django_idempotency._operation import Operation, storable_name
from django_idempotency.crypto import Unreadable
from django_idempotency.exceptions import RecordUnreadable, SimulatedCrash, StoreUnavailable
from django_idempotency.models import IdempotencyRecord
from django_idempotency.states import COMPLETED, FAILED, IN_PROGRESS

logger = logging.getLogger("django_idempotency")

T = TypeVar("T")

RETRY = "retry"
FAIL = "fail"
RESUME = "resume"


@dataclass
class IdempotencyContext:
    """The running operation: who and what its key belongs to, and whether it was replayed.

    ``request.idempotency`` in a protected view, and ``django_idempotency.current``
    inside a protected view or a ``django_idempotency.run_once`` callable.
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
        message = "\x1f".join((self.account, self.operation, self.key, name))
        return salted_hmac("django_idempotency.downstream", message, algorithm="sha256").hexdigest()


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


def recovery_name(recovery: str | Callable[..., Any]) -> str:
    """How a recovery policy is stored on the record, so the recovery job can apply it."""
    if isinstance(recovery, str):
        return recovery
    return f"{recovery.__module__}.{recovery.__qualname__}"


def resolve_recovery(recovery: str | Callable[..., Any]) -> Any:
    """``"retry"``, ``"fail"``, ``"resume"``, or the callable a dotted path names."""
    if isinstance(recovery, str) and recovery not in (RETRY, FAIL, RESUME):
        return conf.resolve_callable(recovery)
    return recovery


def claim(op: Operation) -> _store.ClaimResult:
    """Claim ``op``'s record (see :func:`._store.claim`), now, committed at once whatever
    transaction the caller is in (see :mod:`._autonomous`)."""
    now = timezone.now()
    if not _autonomous.in_callers_transaction(connections[op.alias]):
        # The usual case: autocommit (or a test case's transaction), where the claim
        # commits at once on the caller's own connection.
        return _store.claim(op, now)
    _autonomous.refuse_unkeepable(op.alias, op.recovery_policy, op.operation)
    if _autonomous.separate(op.alias):
        # The caller's transaction may hold this key's outcome already, not yet committed
        # (an earlier call with the key in the same transaction): its own view of the
        # record answers, where the second connection would see the claim in progress,
        # or wait for the caller's lock on the row to take a stale lease over.
        own = _store.fetch(op)
        if own is not None and own.status != IN_PROGRESS and not own.replaceable_by(op, now):
            return _store.ClaimResult(state=own, claimed=False)
    with _autonomous.claiming(op.alias):
        return _store.claim(op, now)


def fetch(op: Operation) -> _store.RecordState | None:
    """``op``'s record as it is now (committed state, whatever the caller's transaction)."""
    with _autonomous.claiming(op.alias):
        return _store.fetch(op)


@dataclass(frozen=True)
class Outcome:
    """What is stored and answered to every retry: a status, headers and body bytes."""

    response_status: int
    headers: list[list[str]]
    body: bytes
    status: str = COMPLETED


def finish(
    alias: str, record_id: int, token: Any, outcome: Outcome, now: datetime | None = None
) -> bool:
    """Store ``outcome``, fenced by the lease token; ``False`` when the lease was lost.

    On the caller's connection: inside a fenced execution it commits with the work.
    """
    return _store.complete(
        alias,
        record_id,
        token,
        status=outcome.status,
        response_status=outcome.response_status,
        response_headers=outcome.headers,
        response_body=outcome.body,
        now=now or timezone.now(),
    )


def failure_outcome(key: str, operation: str) -> Outcome:
    """What the ``"fail"`` recovery policy stores: the "outcome unknown" problem."""
    detail = (
        f"The request with key {key!r} for {operation} stopped before it finished; whether it "
        "took effect is unknown and needs reconciliation. It will not be run again."
    )
    return Outcome(
        _problems.OUTCOME_UNKNOWN.status,
        [["Content-Type", _problems.PROBLEM_CONTENT_TYPE]],
        _problems.OUTCOME_UNKNOWN.body(detail),
        FAILED,
    )


class LeaseLost(Exception):
    """The fenced completion matched no row: another attempt took the lease over, and this
    attempt's database work was rolled back."""


#: What ends an attempt as a killed process would: a test's ``SimulatedCrash``, and the
#: cancellation of an ``async`` caller (a client that disconnected, a server shutting down).
#: The claim is kept, its lease runs out, and the recovery policy decides.
CRASHES: tuple[type[BaseException], ...] = (SimulatedCrash, asyncio.CancelledError)
# What an owner's execution lets through without releasing the claim: a crash, and a lost
# lease (the record is another attempt's now).
_KEEP_CLAIM: tuple[type[BaseException], ...] = (LeaseLost, *CRASHES)


class _RolledBack(Exception):
    def __init__(self, result: Any, outcome: Outcome | None) -> None:
        self.result = result
        self.outcome = outcome


@dataclass(frozen=True)
class Fenced(Generic[T]):
    """What a fenced execution gave: the body's result, and whether its outcome was stored
    (otherwise its work was rolled back and the claim released)."""

    result: T
    stored: bool


def close(alias: str, record_id: int, token: Any, outcome: Outcome) -> bool:
    """Store a recovery policy's ``outcome`` at once, outside any transaction of the caller's
    (it decides the record for every retry, whatever the caller does next)."""
    with _autonomous.claiming(alias):
        return finish(alias, record_id, token, outcome)


def release_quietly(alias: str, record_id: int, token: Any) -> None:
    """Release a claim; when the database cannot be reached, leave it to its lease.

    Committed at once (the claim was): a retry runs afresh at once. A connection that broke
    (a terminated backend, a restarted server) is replaced and the release tried once more,
    so that an attempt that failed for the connection's sake leaves no claim behind.
    """
    _claim_side(alias, lambda: _store.release(alias, record_id, token), "release a claim")


def _claim_side(alias: str, statement: Callable[[], object], what: str) -> None:
    for attempt in (1, 2):
        try:
            with _autonomous.claiming(alias):
                statement()
            return
        except db.Error:
            if attempt == 1 and _autonomous.discard_broken(alias):
                continue
            # The lease runs out on its own; the recovery policy takes it from there.
            logger.exception("could not %s of idempotency; its lease will expire", what)
            return


def run_fenced(
    alias: str,
    record_id: int,
    token: Any,
    body: Callable[[], T],
    judge: Callable[[T], Outcome | None],
    keep_on_store_failure: bool = False,
) -> Fenced[T]:
    """Run ``body`` and complete the record in one transaction.

    ``judge(result)`` says what to store, or ``None``: then the body's work is rolled back and
    the claim released, so a retry runs afresh. When the body raises, the same happens and
    the exception propagates. When the body marked its own transaction for rollback, its
    outcome (if storable) is stored after the rollback: it is still the deterministic answer
    of this request. Raises :class:`LeaseLost` when another attempt owns the record now.

    When the completion (or its commit) fails after the body ran, the work rolls back and
    ``StoreUnavailable`` is raised; the claim is released, or, with
    ``keep_on_store_failure`` (every policy but ``"retry"``: the body's external calls may
    have happened), its lease is given back, so the policy decides as after a crash.
    """
    # A step() inside belongs to the resumable operation that runs this one, if any: not here.
    outer_steps = _steps.set(None)
    completing = False
    try:
        try:
            with transaction.atomic(using=alias):
                result = body()
                completing = True
                outcome = judge(result)
                if outcome is None or transaction.get_rollback(using=alias):
                    raise _RolledBack(result, outcome)
                _complete(alias, record_id, token, outcome)
        except _RolledBack as rolled_back:
            if rolled_back.outcome is None:
                release_quietly(alias, record_id, token)
                return Fenced(rolled_back.result, stored=False)
            _complete(alias, record_id, token, rolled_back.outcome)
            return Fenced(rolled_back.result, stored=True)
        return Fenced(result, stored=True)
    except _KEEP_CLAIM:
        # A crash (or a cancellation) leaves the claim as a killed process would: held until
        # its lease runs out, then recovered by its policy. Never a silent release.
        raise
    except (db.Error, StoreUnavailable) as exc:
        failed = completing  # the completion or its commit: the store's, not the body's
        if failed and keep_on_store_failure:
            give_back(alias, record_id, token)
        else:
            release_quietly(alias, record_id, token)
        if failed and not isinstance(exc, StoreUnavailable):
            raise _store_failed(exc) from exc
        raise
    except BaseException:
        release_quietly(alias, record_id, token)
        raise
    finally:
        _steps.reset(outer_steps)


def _complete(alias: str, record_id: int, token: Any, outcome: Outcome) -> None:
    """Store ``outcome``, fenced: :class:`LeaseLost` when another attempt owns the record,
    ``StoreUnavailable`` when the statement fails."""
    try:
        stored = finish(alias, record_id, token, outcome)
    except db.Error as exc:
        raise _store_failed(exc) from exc
    if not stored:
        raise LeaseLost


def _store_failed(exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(
        "the outcome could not be recorded: its database work was rolled back and its claim "
        f"released, so a retry runs it afresh ({exc})"
    )


# -- steps: operations that resume after a crash ------------------------------------------


@dataclass
class _Steps:
    """The running attempt of a resumable operation: what it owns and what is recorded."""

    alias: str
    record_id: int
    token: Any
    recorded: dict[str, str]
    used: set[str] = field(default_factory=set)
    running: bool = False


_steps: contextvars.ContextVar[_Steps | None] = contextvars.ContextVar(
    "django_idempotency_steps", default=None
)

_MAX_STEP_NAME = 255


def _storable_step_name(name: Any) -> bool:
    """Whether every supported database stores ``name`` and tells it from every other."""
    if not isinstance(name, str) or not name or len(name) > _MAX_STEP_NAME:
        return False
    if "\x00" in name or name != name.strip():
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _step_json(name: str, result: Any) -> str:
    try:
        return json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"step {name!r} returned {type(result).__name__}, which cannot be recorded as JSON "
            f"({exc}); nothing was recorded and its work was rolled back"
        ) from exc


def step(name: str, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``func(*args, **kwargs)`` once per resumable operation, as its step ``name``.

    Inside an operation under the ``"resume"`` recovery policy: ``func`` runs inside
    ``transaction.atomic()`` on the idempotency database, together with the record of
    ``(name, result)``, fenced by the lease token. A step recorded by an earlier attempt of
    the operation returns its recorded result without calling ``func``. Either way the
    value returned is what ``json.loads`` gives back for the result, so a body behaves the
    same on every attempt.

    Raises ``RuntimeError`` outside such an operation (and for a step inside a step),
    ``ValueError`` for a name used twice in one attempt (names are unique within an
    operation: ``f"ship:{line.id}"``), ``TypeError`` for a result that is not JSON (nothing
    is recorded, the step's work rolls back). When the attempt lost its lease, the step's
    work rolls back and the attempt ends (``409`` for a view, ``InProgress`` for
    ``run_once``).
    """
    steps = _steps.get()
    if steps is None:
        raise RuntimeError(
            'step() runs only inside an operation under the "resume" recovery policy '
            '(@idempotent(recovery="resume"), run_once(..., recovery="resume"), ...)'
        )
    if not _storable_step_name(name):
        raise ValueError(
            f"a step name is a non-empty string of at most {_MAX_STEP_NAME} characters, "
            "without NUL, lone surrogates or whitespace at either end (MariaDB compares "
            f"names without trailing spaces); got {name!r}"
        )
    if steps.running:
        raise RuntimeError(f"step {name!r} was called inside another step: steps do not nest")
    if name in steps.used:
        raise ValueError(
            f"step name {name!r} is used twice in one attempt; names are unique within an "
            'operation (e.g. f"ship:{line.id}")'
        )
    steps.used.add(name)
    recorded = steps.recorded.get(name)
    if recorded is None:
        steps.running = True
        try:
            with transaction.atomic(using=steps.alias):
                recorded = _step_json(name, func(*args, **kwargs))
                try:
                    kept = _store.record_step(
                        steps.alias, steps.record_id, steps.token, name, recorded, timezone.now()
                    )
                except db.Error as exc:
                    raise _store_failed(exc) from exc
                if not kept:
                    raise LeaseLost
        finally:
            steps.running = False
        steps.recorded[name] = recorded
    try:
        return json.loads(recorded)
    except (ValueError, RecursionError):
        context = current() or IdempotencyContext("", "", "", record_id=steps.record_id)
        raise refuse_unreadable(
            context, Unreadable(None, f"the recorded result of step {name!r} is not JSON")
        ) from None


def run_resumable(
    alias: str,
    record_id: int,
    token: Any,
    body: Callable[[], T],
    judge: Callable[[T], Outcome | None],
    fresh: bool = False,
) -> Fenced[T]:
    """Run ``body`` as a resumable operation (``"resume"``): outside one transaction, its
    :func:`step` calls each committing with its recorded result; then store the outcome.

    The steps recorded by earlier attempts are read once, here (when that read fails:
    ``StoreUnavailable``, and a ``fresh`` claim, which has no steps, is released; a taken
    over one keeps its steps and gives its lease back). When the body raises (or ``judge``
    has nothing to store: a 5xx), the recorded steps are kept and the lease is given back at
    once, so the next attempt resumes at once. ``LeaseLost`` when another attempt owns the
    record now: at a step, or at the completion.
    """
    try:
        recorded = _store.recorded_steps(alias, record_id)
    except db.Error as exc:
        (release_quietly if fresh else give_back)(alias, record_id, token)
        raise _store_failed(exc) from exc
    steps = _Steps(alias, record_id, token, recorded)
    reset = _steps.set(steps)
    try:
        result = body()
        outcome = judge(result)
    except _KEEP_CLAIM:
        raise
    except BaseException:
        give_back(alias, record_id, token)
        raise
    finally:
        _steps.reset(reset)
    if outcome is None:
        give_back(alias, record_id, token)
        return Fenced(result, stored=False)
    try:
        with transaction.atomic(using=alias):
            _complete(alias, record_id, token, outcome)
    except db.Error as exc:  # the commit
        give_back(alias, record_id, token)
        raise _store_failed(exc) from exc
    except StoreUnavailable:
        give_back(alias, record_id, token)
        raise
    return Fenced(result, stored=True)


def run_owned(
    policy: Any,
    alias: str,
    record_id: int,
    token: Any,
    body: Callable[[], T],
    judge: Callable[[T], Outcome | None],
    fresh: bool = False,
) -> Fenced[T]:
    """The owner's execution for ``policy``: resumable steps under ``"resume"``, else one
    fenced transaction (:func:`run_fenced`). ``fresh``: the claim is new, not a takeover."""
    if policy == RESUME:
        return run_resumable(alias, record_id, token, body, judge, fresh)
    return run_fenced(alias, record_id, token, body, judge, keep_on_store_failure=policy != RETRY)


# -- recovery -------------------------------------------------------------------------------

Policy = str | Callable[[Any], Any]


@dataclass(frozen=True)
class Recovered:
    """What a recovery policy decided for a stale record.

    ``run``: go on as if new (the request path runs the view; the recovery job releases the
    record). ``outcome``: stored, and answered to every retry. ``undecided``: the policy
    answered something that cannot be stored; ``answer`` holds it. ``lease_lost``: the record
    changed meanwhile (completed, released or taken over) and was left alone.
    """

    run: bool = False
    outcome: Outcome | None = None
    undecided: bool = False
    answer: Any = None
    lease_lost: bool = False


def recover(
    policy: Policy,
    *,
    load_record: Callable[[], Any],
    fail_outcome: Callable[[], Outcome],
    as_outcome: Callable[[Any], Outcome | None],
    close: Callable[[Outcome], bool],
) -> Recovered:
    """Apply a recovery policy to a stale record: the one rule of the request path and of
    the recovery job.

    ``"retry"`` runs again. ``"fail"`` closes the record with ``fail_outcome()``. A callable
    gets the record (``load_record()``) and answers ``None`` (run again) or an answer that
    ``as_outcome`` turns into what is stored, or into ``None`` when it cannot be stored
    (undecided). ``close(outcome)`` stores an outcome, fenced, and says whether it could. A
    callable that raises propagates: the caller keeps the record stale for the next ask.
    """
    if policy in (RETRY, RESUME):
        # "resume" runs the body again too: its recorded steps are skipped.
        return Recovered(run=True)
    if policy == FAIL:
        outcome = fail_outcome()
        return Recovered(outcome=outcome) if _closed(close, outcome) else Recovered(lease_lost=True)
    assert callable(policy)
    try:
        record = load_record()
    except db.Error as exc:
        raise StoreUnavailable(f"the stale record could not be read ({exc})") from exc
    if record is None:
        return Recovered(lease_lost=True)
    answer = policy(record)
    if answer is None:
        return Recovered(run=True)
    stored = as_outcome(answer)
    if stored is None:
        return Recovered(undecided=True, answer=answer)
    if not _closed(close, stored):
        return Recovered(lease_lost=True, answer=answer)
    return Recovered(outcome=stored, answer=answer)


def _closed(close: Callable[[Outcome], bool], outcome: Outcome) -> bool:
    try:
        return close(outcome)
    except db.Error as exc:
        raise StoreUnavailable(
            f"the recovery policy's outcome could not be stored ({exc})"
        ) from exc


def refuse_unreadable(
    context: IdempotencyContext, problem: Unreadable, request: Any = None
) -> RecordUnreadable:
    """Log and signal (``record_unreadable``) a retry refused because its record's stored
    outcome cannot be read back; the exception that refuses it (the HTTP side answers it as
    ``503`` ``idempotency_record_unreadable``). Nothing runs: within its TTL an outcome that
    cannot be read is never produced a second time."""
    # The record is named by its id and the sealing key by its public id: never the client's
    # key, and never a key of ENCRYPTION_KEYS.
    logger.warning(
        "the stored outcome of record %s (%s) cannot be read back (%s); the retry was "
        "refused and nothing ran%s",
        context.record_id,
        context.operation,
        problem,
        f": configure the key {problem.key_id} again" if problem.key_id else "",
        extra={"key_id": problem.key_id},
    )
    if signals.record_unreadable.has_listeners(IdempotencyRecord):
        signals.record_unreadable.send(
            sender=IdempotencyRecord,
            request=request,
            account=context.account,
            operation=context.operation,
            key=context.key,
            key_id=problem.key_id,
            reason=str(problem),
        )
    remedy = (
        f"; it is answered again once a key that opens it (id {problem.key_id}) is in "
        "ENCRYPTION_KEYS"
        if problem.key_id
        else ""
    )
    return RecordUnreadable(
        f"the outcome of key {context.key!r} for {context.operation} is stored but cannot be "
        f"read back ({problem}). It was not run again{remedy}.",
        key_id=problem.key_id,
    )


def announce_recovery(
    account: str, operation: str, key: str, policy: str, outcome: str, record_id: int | None
) -> None:
    """Log and signal (``lease_recovered``) what a recovery policy did with a record."""
    # The record is named by its id: the client's key does not belong in logs.
    logger.info("recovery policy %s on record %s (%s): %s", policy, record_id, operation, outcome)
    if signals.lease_recovered.has_listeners(IdempotencyRecord):
        signals.lease_recovered.send(
            sender=IdempotencyRecord,
            account=account,
            operation=operation,
            key=key,
            policy=policy,
            outcome=outcome,
        )


def give_back(alias: str, record_id: int, token: Any, now: datetime | None = None) -> None:
    """End an owned lease now, keeping the record in progress (stale) for the next ask."""
    moment = now or timezone.now()
    _claim_side(
        alias, lambda: _store.give_back(alias, record_id, token, moment), "give a lease back"
    )


__all__ = [
    "COMPLETED",
    "FAIL",
    "FAILED",
    "RESUME",
    "RETRY",
    "Fenced",
    "IdempotencyContext",
    "LeaseLost",
    "Operation",
    "Outcome",
    "Recovered",
    "claim",
    "close",
    "current",
    "fetch",
    "finish",
    "recover",
    "recovery_name",
    "release_quietly",
    "resolve_recovery",
    "run_fenced",
    "run_owned",
    "run_resumable",
    "running",
    "step",
    "storable_name",
]
