"""The record's state transitions as database statements: the store.

Every guarantee rests on the database: the unique constraint on ``(account, operation, key)``
picks the single winner of a claim, and row-level conditional updates fence every owner's
statement by the lease token. Nothing here relies on process memory or a local lock, and
nothing here decides: the callers (:mod:`django_idempotency._claims`) do.

The hot path is fixed statements, built once per database: the claim (one statement whatever
the key's state), the fenced completion, the release. The ORM compiles none of them per
request. The rare paths (an expired record, a stale lease) take one conditional statement
more. Its parts:

- :mod:`.records`: a record as read back, its outcome opened and checked;
- :mod:`.statements`: cursors (prepared where the connection allows it), names, values;
- :mod:`.postgres`: PostgreSQL's one-statement claim;
- :mod:`.claiming`: the claim and the takeover, and the completion, on every database;
- :mod:`.owner`: the owner's other fenced statements and the steps.
"""

from __future__ import annotations

from django_idempotency._store.claiming import begin_riding, claim, complete, fetch
from django_idempotency._store.owner import (
    count_attempt,
    forget_steps,
    give_back,
    record_policy,
    record_step,
    recorded_steps,
    release,
)
from django_idempotency._store.records import ClaimResult, RecordState

__all__ = [
    "ClaimResult",
    "RecordState",
    "begin_riding",
    "claim",
    "complete",
    "count_attempt",
    "fetch",
    "forget_steps",
    "give_back",
    "record_policy",
    "record_step",
    "recorded_steps",
    "release",
]
