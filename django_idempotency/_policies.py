"""Every policy named by a word, declared once, with the traits its readers ask for.

Two families live here: the recovery policies (what becomes of a record whose owner stopped
before it finished: ``"retry"``, ``"fail"``, ``"resume"``, or a callable) and the
uniqueness options of ``outbox.enqueue_once`` (when a live message stops holding its key:
``"started"``, ``"finished"``, or a duration). A reader never compares a policy's name: it
asks the declared policy for a trait (``recovery_policy(name).reruns``). A new policy, or a
new ``unique_until``, is one entry here.

This module imports nothing of the project, so that the settings' validation can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "CALLABLE",
    "DURATION",
    "FAIL",
    "FINISHED",
    "RECOVERY_POLICIES",
    "RESUME",
    "RETRY",
    "STARTED",
    "UNIQUE_UNTIL",
    "RecoveryPolicy",
    "UniqueUntil",
    "names_where",
    "recovery_policy",
    "unique_until_of",
]


# -- recovery policies --------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryPolicy:
    """A recovery policy and what it implies wherever a record is claimed, run or recovered."""

    #: How the policy is written and stored on the record (a callable's dotted path is stored
    #: for :data:`CALLABLE`).
    name: str
    #: After a dead owner, the next attempt runs the body again (else the record is closed).
    reruns: bool
    #: A callable decides what becomes of a stale record (it may also answer "run again").
    asks_callable: bool
    #: The claim must be committed, durably and on its own, before the body runs: the
    #: policy's promise outlives a crash only if the claim does (everything but "retry",
    #: whose claim may commit with the work and need not wait for a disk flush).
    durable_claim: bool
    #: The body runs as recorded steps, each in its own transaction; a later attempt
    #: resumes after the last one (never released: that would delete its steps).
    resumable: bool
    #: When the completion cannot be stored after the body ran, the record stays claimed
    #: (its lease given back) rather than released: the body's external calls may have
    #: happened, and the policy decides as after a crash.
    keeps_claim_on_store_failure: bool


RETRY = RecoveryPolicy(
    "retry",
    reruns=True,
    asks_callable=False,
    durable_claim=False,
    resumable=False,
    keeps_claim_on_store_failure=False,
)
FAIL = RecoveryPolicy(
    "fail",
    reruns=False,
    asks_callable=False,
    durable_claim=True,
    resumable=False,
    keeps_claim_on_store_failure=True,
)
RESUME = RecoveryPolicy(
    "resume",
    reruns=True,
    asks_callable=False,
    durable_claim=True,
    resumable=True,
    keeps_claim_on_store_failure=True,
)
#: A callable ``recover(record)``, or the dotted path of one: not named by a word.
CALLABLE = RecoveryPolicy(
    "<callable>",
    reruns=False,
    asks_callable=True,
    durable_claim=True,
    resumable=False,
    keeps_claim_on_store_failure=True,
)

#: The recovery policies named by a word, by name.
RECOVERY_POLICIES: dict[str, RecoveryPolicy] = {p.name: p for p in (RETRY, FAIL, RESUME)}


def recovery_policy(value: str | Callable[..., Any] | RecoveryPolicy) -> RecoveryPolicy:
    """The declared policy of ``value``: a name, a policy, or else a callable (or its
    dotted path), which is :data:`CALLABLE`."""
    if isinstance(value, RecoveryPolicy):
        return value
    if isinstance(value, str):
        return RECOVERY_POLICIES.get(value, CALLABLE)
    return CALLABLE


def names_where(trait: str) -> tuple[str, ...]:
    """The names of the word-named recovery policies that have ``trait``, for queries over
    the stored ``recovery_policy`` column."""
    return tuple(name for name, policy in RECOVERY_POLICIES.items() if getattr(policy, trait))


# -- uniqueness of enqueued tasks ---------------------------------------------------------------


@dataclass(frozen=True)
class UniqueUntil:
    """When a message stops holding its key (``outbox.enqueue_once(unique_until=...)``).

    Every message holds its key while it waits to be sent. After that, the traits say what
    frees it.
    """

    #: How it is written and stored with the key.
    name: str
    #: The key is held for a fixed time after the enqueue, whatever the message's state.
    by_time: bool
    #: Freed once a worker started the task (its ``@idempotent_task`` record exists, or
    #: its start was reported on the key).
    frees_at_start: bool
    #: Freed once the task reached a terminal state: succeeded, failed, or its worker died
    #: and its lease ran out; or once the message is dead (never sent).
    frees_at_finish: bool
    #: Whether the worker must tell: by its ``@idempotent_task`` record of the run, or by
    #: reporting the run on the key (any other task).
    needs_task_record: bool


STARTED = UniqueUntil(
    "started", by_time=False, frees_at_start=True, frees_at_finish=True, needs_task_record=True
)
FINISHED = UniqueUntil(
    "finished", by_time=False, frees_at_start=False, frees_at_finish=True, needs_task_record=True
)
#: Given as a ``timedelta``: held that long after the first enqueue.
DURATION = UniqueUntil(
    "duration", by_time=True, frees_at_start=False, frees_at_finish=False, needs_task_record=False
)

#: The ``unique_until`` options, by their stored name.
UNIQUE_UNTIL: dict[str, UniqueUntil] = {u.name: u for u in (STARTED, FINISHED, DURATION)}
#: The options written as a word (a duration is written as a ``timedelta``).
UNIQUE_UNTIL_WORDS = tuple(u.name for u in UNIQUE_UNTIL.values() if not u.by_time)


def unique_until_of(value: object) -> UniqueUntil:
    """The declared option of a stored name; ``KeyError`` for an unknown one."""
    if isinstance(value, timedelta):
        return DURATION
    return UNIQUE_UNTIL[str(value)]
