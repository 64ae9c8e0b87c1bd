"""Steps: the parts of a resumable operation (recovery policy ``"resume"``) that run once.

:func:`step` records each step's result with the step's own work, fenced by the lease
token; a later attempt of the operation gets the recorded result back without running the
step again. :func:`recording` makes an attempt's steps (read once, when it starts) the ones
that :func:`step` finds.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django import db
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.utils import timezone

from django_idempotency import _store
from django_idempotency._claims import Claim, LeaseLost, store_failed
from django_idempotency._context import IdempotencyContext, current
from django_idempotency._outcomes import refuse_unreadable
from django_idempotency.crypto import Unreadable, open_step_result, seal_step_result

__all__ = ["outside_steps", "recording", "step"]

T = TypeVar("T")


@dataclass
class _Steps:
    """The running attempt of a resumable operation: its claim and what is recorded."""

    claim: Claim
    recorded: dict[str, str]
    used: set[str] = field(default_factory=set)
    running: bool = False
    #: A step found the record taken over by another attempt: this one runs no more steps
    #: (a body that swallowed that ``LeaseLost`` would otherwise run the next beside it).
    lost: bool = False


_steps: contextvars.ContextVar[_Steps | None] = contextvars.ContextVar(
    "django_idempotency_steps", default=None
)


@contextmanager
def recording(claim: Claim, recorded: dict[str, str]) -> Iterator[None]:
    """While the body runs, :func:`step` records for ``claim``, whose earlier attempts
    recorded ``recorded``."""
    reset = _steps.set(_Steps(claim, recorded))
    try:
        yield
    finally:
        _steps.reset(reset)


@contextmanager
def outside_steps() -> Iterator[None]:
    """While the body runs, :func:`step` belongs to no operation (an operation run inside a
    resumable one has steps of its own, or none)."""
    reset = _steps.set(None)
    try:
        yield
    finally:
        _steps.reset(reset)


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


def _inside_a_transaction(alias: str) -> bool:
    """Whether a step on ``alias`` would commit only with a transaction opened around it
    (by the body, or by a decorator beneath the protecting one): an atomic block that is not
    a test case's, or autocommit turned off. The body itself runs outside any (the claim
    refuses ``"resume"`` inside a caller's transaction)."""
    connection = db.connections[alias]
    if connection.in_atomic_block:
        blocks: list[Any] = connection.atomic_blocks
        return any(not getattr(block, "_from_testcase", False) for block in blocks)
    return connection.connection is not None and not connection.get_autocommit()


def _step_json(name: str, result: Any) -> str:
    try:
        return json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # nested past the stack's depth
        raise TypeError(
            f"step {name!r} returned {type(result).__name__}, which cannot be recorded as JSON "
            f"({exc}); nothing was recorded and its work was rolled back"
        ) from exc


class _RolledBack(Exception):
    """The step marked its own transaction for rollback and returned (``text``: its result
    as JSON); ``raw``: the driver's connection its transaction ran on."""

    def __init__(self, text: str, raw: Any) -> None:
        self.text = text
        self.raw = raw


def _run_step(owner: Claim, name: str, func: Callable[..., Any], args: Any, kwargs: Any) -> str:
    """Run the step and record its result with its work, in one transaction; the result as
    JSON text."""
    alias = owner.alias
    try:
        with transaction.atomic(using=alias):
            text = _step_json(name, func(*args, **kwargs))
            if transaction.get_rollback(using=alias):
                raise _RolledBack(text, db.connections[alias].connection)
            _record(owner, name, text)
    except _RolledBack as rolled_back:
        # The step undid its own writes (transaction.set_rollback) and answered: its answer
        # is still its result, recorded on its own, as a body's answer is stored after its
        # rollback. Not when the rollback found the connection lost (Django replaced it):
        # the answer of a transaction the store lost is never recorded as final.
        if db.connections[alias].connection is not rolled_back.raw:
            lost = db.OperationalError("the connection was lost during the step's transaction")
            raise store_failed(lost) from None
        text = rolled_back.text
        with transaction.atomic(using=alias):
            _record(owner, name, text)
    return text


def _record(owner: Claim, name: str, text: str) -> None:
    """Record step ``name``'s result ``text`` for the record ``owner`` holds (sealed when
    ``ENCRYPTION_KEYS`` is set), fenced by its lease token: ``LeaseLost`` when another
    attempt owns the record now."""
    stored = seal_step_result(text)
    try:
        kept = _store.record_step(
            owner.alias, owner.record_id, owner.token, name, stored, timezone.now()
        )
    except db.Error as exc:
        raise store_failed(exc) from exc
    if not kept:
        raise LeaseLost


def step(name: str, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``func(*args, **kwargs)`` once per resumable operation, as its step ``name``.

    Inside an operation under the ``"resume"`` recovery policy: ``func`` runs inside
    ``transaction.atomic()`` on the idempotency database, together with the record of
    ``(name, result)``, fenced by the lease token (the result sealed with the first key of
    ``ENCRYPTION_KEYS`` when it is set). A step recorded by an earlier attempt of the
    operation returns its recorded result without calling ``func``; one that no configured
    key opens, or that is damaged, ends the attempt with ``RecordUnreadable`` (``503`` for
    a view) and never runs again. Either way the
    value returned is what ``json.loads`` gives back for the result, so a body behaves the
    same on every attempt.

    Raises ``RuntimeError`` outside such an operation (and for a step inside a step, or
    inside a ``transaction.atomic()`` the body opened, which it could commit only with),
    ``ValueError`` for a name used twice in one attempt (names are unique within an
    operation: ``f"ship:{line.id}"``), ``TypeError`` for a result that is not JSON (nothing
    is recorded, the step's work rolls back). A step that marks its own transaction for
    rollback (``transaction.set_rollback(True)``) has its work rolled back and its result
    recorded. When the attempt lost its lease, the step's work rolls back and the attempt
    ends (``409`` for a view, ``InProgress`` for ``run_once``); a body that catches that
    runs no further step (each raises again before its function runs).
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
    if _inside_a_transaction(steps.claim.alias):
        # Its record would commit only with that transaction: a crash after the step and
        # before that COMMIT would lose it, and the next attempt would run the step again.
        raise RuntimeError(
            f"step {name!r} was called inside a transaction (transaction.atomic() in the "
            "body, or a decorator beneath @idempotent): a step must commit as it finishes, "
            "so that a later attempt finds it. Call step() outside transaction.atomic(); "
            "work that must commit together belongs in one step"
        )
    if name in steps.used:
        raise ValueError(
            f"step name {name!r} is used twice in one attempt; names are unique within an "
            'operation (e.g. f"ship:{line.id}")'
        )
    if steps.lost:
        raise LeaseLost
    steps.used.add(name)
    recorded = steps.recorded.get(name)
    if recorded is None:
        steps.running = True
        try:
            recorded = _run_step(steps.claim, name, func, args, kwargs)
        except LeaseLost:
            steps.lost = True
            raise
        finally:
            steps.running = False
        steps.recorded[name] = recorded
    try:
        return json.loads(open_step_result(recorded))
    except Unreadable as exc:  # sealed, and no configured key opens it
        unreadable = exc
    except (ValueError, RecursionError):
        unreadable = Unreadable(None, f"the recorded result of step {name!r} is not JSON")
    context = current() or IdempotencyContext("", "", "", record_id=steps.claim.record_id)
    raise refuse_unreadable(context, unreadable) from None
