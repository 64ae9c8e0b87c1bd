"""What one claim is for: an operation's identity and the terms of its record.

``(account, operation, key)`` names a record; the request's fingerprint (``request_hash``,
made by ``fingerprint_version``), the recovery policy's name, the lease and the TTL are its
terms. Every entry point (a request, ``run_once``, a task, a tool call) builds one
:class:`Operation` and hands it to the same claim (:mod:`django_idempotency._claims`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django_idempotency._storable import HASHED, storable_name
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
