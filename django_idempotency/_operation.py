"""What one claim is for: an operation's identity and the terms of its record.

``(account, operation, key)`` names a record; the request's fingerprint (``request_hash``,
made by ``fingerprint_version``), the recovery policy's name, the lease and the TTL are its
terms. Every entry point (a request, ``run_once``, a task, a tool call) builds one
:class:`Operation` and hands it to the same claim (:mod:`django_idempotency._claims`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django_idempotency._storable import HASHED, storable_name, stored_names

__all__ = ["HASHED", "Operation", "storable_name", "stored_names"]


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
    #: :func:`legacy_names`): the claim adopts a record written so. ``None`` for nearly all.
    #: A third item, where the operation's spelling changed and the fingerprint reads it: the
    #: request's hash as the earlier release made it, which the adopted record takes today's.
    legacy: tuple[str, ...] | None = None
