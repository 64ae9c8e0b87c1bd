"""What one claim is for: an operation's identity and the terms of its record.

``(account, operation, key)`` names a record; the request's fingerprint (``request_hash``,
made by ``fingerprint_version``), the recovery policy's name, the lease and the TTL are its
terms. Every entry point (a request, ``run_once``, a task, a tool call) builds one
:class:`Operation` and hands it to the same claim (:mod:`django_idempotency._claims`).
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django_idempotency import _storable
from django_idempotency.states import IN_PROGRESS

__all__ = ["HASHED", "Operation", "storable_name"]


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

    def new_row(self, token: uuid.UUID, now: datetime) -> dict[str, Any]:
        """The columns of the record a claim at ``now`` writes, with lease ``token``."""
        return {
            "account": self.account,
            "operation": self.operation,
            "key": self.key,
            "request_hash": self.request_hash,
            "fingerprint_version": self.fingerprint_version,
            "status": IN_PROGRESS,
            "lease_token": token,
            "lease_expires_at": now + self.lease,
            "recovery_policy": self.recovery_policy,
            "recovery_attempts": 0,
            "response_status": None,
            "response_headers": [],
            "response_body": None,
            "created_at": now,
            "completed_at": None,
            "expires_at": now + self.ttl,
        }


_MAX_NAME = 255


#: What a name stored by its hash begins with. A name given with this beginning is itself
#: stored by its hash, so no name stored as it is can take the form of a hashed one.
HASHED = "sha256:"


def storable_name(name: str) -> str:
    """An account or operation as stored: itself, or ``sha256:<hex>`` of it.

    Stored as it is when every supported database keeps it apart from every other name: at
    most 255 characters, no NUL, no lone surrogate, no whitespace at its end (MariaDB's
    collations compare ``'t1'`` and ``'t1 '`` as equal), and not beginning with ``sha256:``.
    Any other name is stored by its hash: ``sha256:`` and 64 hex digits, which no name
    stored as it is can spell. Deterministic, so every retry maps to the same record, and
    two different names never share one (short of a SHA-256 collision).
    """
    if len(name) <= _MAX_NAME and _plain(name):
        return name
    return HASHED + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def _plain(name: str) -> bool:
    # text_problem: a NUL or a lone surrogate, which no database stores.
    if name.startswith(HASHED) or (name and name[-1].isspace()):
        return False
    return _storable.text_problem(name) is None
