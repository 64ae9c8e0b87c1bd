"""The record's state machine: its statuses, its transitions, and its predicates, once.

::

    absent ──claim──────────────> in_progress ──complete, with the business state──> completed
                                   │   │  │
                                   │   │  └── 5xx / exception ──> released (the row is deleted:
                                   │   │                           a retry runs afresh)
                                   │   └── lease ran out ──> recovery policy:
                                   │         "retry": taken over (in_progress, new token)
                                   │         "fail": failed (outcome unknown, replayed)
                                   │         a callable: completed, or taken over
                                   └── lease lost ──> the late owner's work is rolled back
    completed / failed ──TTL ran out (expired)──> replaced by the next claim, or purged

Every place that asks "is this record expired?", "is its lease live?", "may this claim
replace it?" asks it here. Each predicate is one expression that renders three ways: as a
Django ``Q`` (for the ORM: the purge, the recovery job, the admin, the statistics), as SQL
(for the engine's fixed statements) and as a Python test of a fetched row; a table-driven
test proves the three agree on every case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Q

IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
#: Not a stored status: a released claim is deleted, so the key is absent again.
RELEASED = "released"

#: The statuses a record can be stored with.
STATUSES = (IN_PROGRESS, COMPLETED, FAILED)
#: Statuses whose stored answer is replayed to every retry.
DONE = frozenset({COMPLETED, FAILED})

#: ``(from, to) -> what moves a record along that edge``; ``None`` is the absent record.
TRANSITIONS: dict[tuple[str | None, str], str] = {
    (None, IN_PROGRESS): "claim",
    (IN_PROGRESS, COMPLETED): "complete, fenced by the lease token, with the business state",
    (IN_PROGRESS, RELEASED): "release after a 5xx, an exception or an unstorable response",
    (IN_PROGRESS, IN_PROGRESS): "take over a stale lease (recovery policy 'retry')",
    (IN_PROGRESS, FAILED): "close a stale lease (recovery policy 'fail')",
    (COMPLETED, IN_PROGRESS): "replace an expired record",
    (FAILED, IN_PROGRESS): "replace an expired record",
}

# Columns that may hold NULL: a comparison with NULL is false in all three renderings.
_NULLABLE = frozenset({"lease_expires_at"})

_SQL_OPS = {"eq": "=", "ne": "<>", "lt": "<", "lte": "<=", "gt": ">", "gte": ">="}
_PY_OPS = {"eq": "==", "ne": "!=", "lt": "<", "lte": "<=", "gt": ">", "gte": ">="}


class Predicate:
    """A boolean expression over a record's columns and named parameters."""

    def q(self, **params: Any) -> Q:
        """The expression as a ``Q`` for the ORM."""
        raise NotImplementedError

    def sql(self, quote: Callable[[str], str], prefix: str = "") -> str:
        """The expression as SQL, with ``%(name)s`` placeholders for the parameters."""
        raise NotImplementedError

    def test(self, row: Mapping[str, Any], **params: Any) -> bool:
        """The expression evaluated on a fetched row (a mapping of column to value)."""
        return bool(self._compiled(row, params))

    def python(self) -> str:
        """The expression as Python over ``r`` (the row) and ``p`` (the parameters)."""
        raise NotImplementedError

    @functools.cached_property
    def _compiled(self) -> Callable[[Mapping[str, Any], Mapping[str, Any]], Any]:
        # The tree is turned into one Python expression once, rather than walked on every
        # request: the claim asks REPLACEABLE of every record in its way. The text holds
        # only column and parameter names and the module's own constants.
        function: Callable[[Mapping[str, Any], Mapping[str, Any]], Any] = eval(
            f"lambda r, p: {self.python()}"
        )
        return function

    def __and__(self, other: Predicate) -> Predicate:
        return _All((self, other))

    def __or__(self, other: Predicate) -> Predicate:
        return _Any((self, other))

    def __invert__(self) -> Predicate:
        return _Not(self)


@dataclass(frozen=True)
class _Compare(Predicate):
    column: str
    op: str
    # A parameter's name, or a fixed value when ``fixed`` is set.
    param: str = ""
    fixed: str | None = None

    def _value(self, params: Mapping[str, Any]) -> Any:
        return self.fixed if self.fixed is not None else params[self.param]

    def q(self, **params: Any) -> Q:
        value = self._value(params)
        if self.op == "ne":
            return ~Q(**{self.column: value})
        lookup = self.column if self.op == "eq" else f"{self.column}__{self.op}"
        return Q(**{lookup: value})

    def sql(self, quote: Callable[[str], str], prefix: str = "") -> str:
        value = f"'{self.fixed}'" if self.fixed is not None else f"%({self.param})s"
        text = f"{prefix}{quote(self.column)} {_SQL_OPS[self.op]} {value}"
        return f"COALESCE({text}, false)" if self.column in _NULLABLE else f"({text})"

    def python(self) -> str:
        value = repr(self.fixed) if self.fixed is not None else f"p[{self.param!r}]"
        current = f"r[{self.column!r}]"
        return f"({current} is not None and {current} {_PY_OPS[self.op]} {value})"


@dataclass(frozen=True)
class _All(Predicate):
    parts: tuple[Predicate, ...]

    def q(self, **params: Any) -> Q:
        result = Q()
        for part in self.parts:
            result &= part.q(**params)
        return result

    def sql(self, quote: Callable[[str], str], prefix: str = "") -> str:
        return "(" + " AND ".join(p.sql(quote, prefix) for p in self.parts) + ")"

    def python(self) -> str:
        return "(" + " and ".join(p.python() for p in self.parts) + ")"


@dataclass(frozen=True)
class _Any(Predicate):
    parts: tuple[Predicate, ...]

    def q(self, **params: Any) -> Q:
        result = Q()
        for part in self.parts:
            result |= part.q(**params)
        return result

    def sql(self, quote: Callable[[str], str], prefix: str = "") -> str:
        return "(" + " OR ".join(p.sql(quote, prefix) for p in self.parts) + ")"

    def python(self) -> str:
        return "(" + " or ".join(p.python() for p in self.parts) + ")"


@dataclass(frozen=True)
class _Not(Predicate):
    part: Predicate

    def q(self, **params: Any) -> Q:
        return ~self.part.q(**params)

    def sql(self, quote: Callable[[str], str], prefix: str = "") -> str:
        return f"(NOT {self.part.sql(quote, prefix)})"

    def python(self) -> str:
        return f"(not {self.part.python()})"


def _status_is(status: str) -> Predicate:
    return _Compare("status", "eq", fixed=status)


# -- the predicates ----------------------------------------------------------------------------
# Parameters: ``now`` (the moment of the question), ``hash`` and ``version`` (the claiming
# request's fingerprint and the version of the fingerprint function that made it).

#: In progress, and its owner's lease still runs: nobody else may touch it.
LIVE_LEASE = _status_is(IN_PROGRESS) & _Compare("lease_expires_at", "gt", "now")
#: In progress, but the lease ran out: its owner died or is stuck.
STALE_LEASE = _status_is(IN_PROGRESS) & _Compare("lease_expires_at", "lte", "now")
#: Past its TTL and not held by a live lease: absent for a claim, deletable by the purge.
EXPIRED = _Compare("expires_at", "lte", "now") & ~LIVE_LEASE
#: A stale lease inside its TTL: what the recovery job handles (past the TTL the purge does).
STALE = STALE_LEASE & _Compare("expires_at", "gt", "now")
#: The stored request is the claiming one: the same hash, or a hash made by another
#: fingerprint version, which cannot be compared.
SAME_REQUEST = _Compare("request_hash", "eq", "hash") | _Compare(
    "fingerprint_version", "ne", "version"
)
#: What a claim may replace: an expired record, or a stale lease of the same request.
REPLACEABLE = EXPIRED | (STALE_LEASE & SAME_REQUEST)


def expired_q(now: datetime) -> Q:
    """Records the purge may delete at ``now``, and a claim may replace."""
    return EXPIRED.q(now=now)


def stale_q(now: datetime) -> Q:
    """Records whose stale lease the recovery job handles at ``now``."""
    return STALE.q(now=now)


def stale_lease_q(now: datetime) -> Q:
    """In progress with a lease that ran out, whatever the TTL (the admin's actions)."""
    return STALE_LEASE.q(now=now)


def live_lease_q(now: datetime) -> Q:
    """In progress with a live lease."""
    return LIVE_LEASE.q(now=now)
