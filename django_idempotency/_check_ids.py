"""Every system check of the package, in the order of its id: the one list of them.

A setting's Error is named after the setting (``"TTL"``: ``django_idempotency.E003``); the
others after what they report. ``docs/checks.md`` lists the same ids in the same order, and
a test holds the two together. E040-E049 are kept for settings to come.
"""

from __future__ import annotations

__all__ = ["ERRORS", "PREFIX", "WARNINGS", "error", "warning"]

PREFIX = "django_idempotency."

ERRORS: dict[str, int] = {
    "NOT_A_DICT": 1,
    "UNKNOWN_KEY": 2,
    "TTL": 3,
    "TTL_NOT_LONGER_THAN_LEASE": 4,
    "HEADER": 5,
    "METHODS": 6,
    "DATABASE": 7,
    "ACCOUNT_RESOLVER": 8,
    "REPLAY_HEADERS": 9,
    "MAX_RESPONSE_BYTES": 10,
    "WAIT_NOT_SHORTER_THAN_LEASE": 11,
    "REQUIRED": 12,
    "LEASE": 13,
    "IN_PROGRESS_WAIT": 14,
    "FINGERPRINT": 15,
    "RECOVERY": 16,
    "TRANSIENT_STATUSES": 17,
    "RETRY_AFTER": 18,
    "RETRY_AFTER_MAX": 19,
    "AUDIT": 20,
    "AUDIT_RETENTION": 21,
    "PURGE_MAX_BATCHES": 22,
    "PURGE_BATCH_SIZE": 23,
    "ENCRYPTION_KEYS": 24,
    "CRYPTOGRAPHY_MISSING": 25,
    "SEALED_WITH_A_MISSING_KEY": 26,  # a database check: check --database, migrate
    "OUTBOX_SENDER": 30,
    "OUTBOX_MAX_ATTEMPTS": 31,
    "OUTBOX_RETENTION": 32,
    "OUTBOX_BATCH_SIZE": 33,
    "OUTBOX_BACKOFF": 34,
    "OUTBOX_BACKOFF_MAX": 35,
    "OUTBOX_POLL_INTERVAL": 36,
    "OUTBOX_SENDER_WITHOUT_CELERY": 37,
    "CLAIM_DATABASE": 38,
    "CLAIM_TIMEOUT": 39,
    "TASKS_DELIVER_TO": 50,  # the Tasks backend's OPTIONS, reported by the Tasks framework
    "CLAIM_DATABASE_ELSEWHERE": 51,  # check --database where a connection tells
    "TABLES_MISSING": 52,  # a database check: check --database
    "OPERATION_SHARED": 60,  # a URL check: two endpoints, one derived operation
    "DECORATOR_ON_DRF_DISPATCH": 61,  # a URL check: it would claim before DRF's checks
    "NINJA_IDEMPOTENT_ABOVE_ROUTES": 62,  # a URL check: a route it does not reach
    "NINJA_IDEMPOTENT_OFF_NINJA": 63,  # a URL check: ninja's decorator on a Django view
}

WARNINGS: dict[str, int] = {
    "DATABASE_NOT_DEFAULT": 2,
    "HEADER_UNDERSCORE": 3,
    "DATABASE_NOT_ROUTED": 10,
    "CLAIM_CONNECT_MAY_WAIT": 11,
    "NO_SYNCHRONOUS_STANDBY": 20,  # a database check: check --database
    "RECORDS_IN_SHARED_SCHEMA": 30,  # schemas per tenant: SHARED_APPS / TENANT_APPS
    "SMALL_PACKET": 40,  # a database check: check --database
}


def error(name: str) -> str:
    """The full id of the Error ``name``: ``error("TTL") == "django_idempotency.E003"``."""
    return f"{PREFIX}E{ERRORS[name]:03d}"


def warning(name: str) -> str:
    """The full id of the Warning ``name``."""
    return f"{PREFIX}W{WARNINGS[name]:03d}"
