"""Typed access to the ``IDEMPOTENCY`` setting.

Nothing is written into ``django.conf.settings`` and nothing is read at import time: every
accessor reads the current value, with a small cache that ``setting_changed`` clears, so
``override_settings`` works in tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

# -- the transactional outbox (django_idempotency.outbox) -------------------------------------
# One block, with its accessors at the end of this module.
OUTBOX_DEFAULTS: dict[str, Any] = {
    "OUTBOX_SENDER": "django_idempotency.celery_sender.send",
    "OUTBOX_MAX_ATTEMPTS": 20,
    "OUTBOX_RETENTION": timedelta(days=7),
    "OUTBOX_BATCH_SIZE": 100,
    "OUTBOX_BACKOFF": timedelta(seconds=1),
    "OUTBOX_BACKOFF_MAX": timedelta(minutes=5),
    "OUTBOX_POLL_INTERVAL": timedelta(seconds=1),
}

DEFAULTS: dict[str, Any] = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": True,
    "TTL": timedelta(hours=24),
    "LEASE": timedelta(seconds=60),
    "METHODS": ("POST", "PATCH"),
    "ACCOUNT_RESOLVER": "django_idempotency.accounts.user_account",
    "FINGERPRINT": "django_idempotency.fingerprint.default_fingerprint",
    "RECOVERY": "retry",
    "DATABASE": "default",
    "REPLAY_HEADERS": (),
    "MAX_RESPONSE_BYTES": 1024 * 1024,
    "TRANSIENT_STATUSES": (409, 429),
    "IN_PROGRESS_WAIT": timedelta(0),
    "RETRY_AFTER": 1,
    "PURGE_BATCH_SIZE": 1000,
    "PURGE_MAX_BATCHES": None,
    "AUDIT": False,
    "AUDIT_RETENTION": timedelta(days=90),
    **OUTBOX_DEFAULTS,
}

# Never stored, never replayed, whatever REPLAY_HEADERS says: they describe one hop or one
# moment, or they carry credentials.
NEVER_STORED_HEADERS = frozenset(
    {
        "set-cookie",
        "date",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "vary",
    }
)
ALWAYS_STORED_HEADERS = ("Content-Type", "Location")


@functools.lru_cache(maxsize=1)
def _user_settings() -> dict[str, Any]:
    value = getattr(settings, "IDEMPOTENCY", None) or {}
    return dict(value)


def get(name: str) -> Any:
    """The current value of one ``IDEMPOTENCY`` entry, falling back to its default."""
    return _user_settings().get(name, DEFAULTS[name])


def unknown_keys() -> list[str]:
    """Entries of the ``IDEMPOTENCY`` setting that this version does not know."""
    return sorted(set(_user_settings()) - set(DEFAULTS))


@receiver(setting_changed)
def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting == "IDEMPOTENCY":
        _user_settings.cache_clear()
        _import_cached.cache_clear()


@functools.lru_cache(maxsize=64)
def _import_cached(path: str) -> Any:
    return import_string(path)


def resolve_callable(value: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable given as itself or as a dotted import path."""
    if isinstance(value, str):
        imported: Callable[..., Any] = _import_cached(value)
        return imported
    return value


def as_timedelta(value: timedelta | int | float) -> timedelta:
    """Durations may be given as ``timedelta`` or as a number of seconds."""
    if isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


def header() -> str:
    return str(get("HEADER"))


def required() -> bool:
    return bool(get("REQUIRED"))


def ttl() -> timedelta:
    return as_timedelta(get("TTL"))


def lease() -> timedelta:
    return as_timedelta(get("LEASE"))


def methods() -> frozenset[str]:
    return frozenset(m.upper() for m in get("METHODS"))


def database() -> str:
    return str(get("DATABASE"))


def replay_headers() -> tuple[str, ...]:
    extra = tuple(h for h in get("REPLAY_HEADERS") if h.lower() not in NEVER_STORED_HEADERS)
    return ALWAYS_STORED_HEADERS + extra


def max_response_bytes() -> int | None:
    value = get("MAX_RESPONSE_BYTES")
    return None if value is None else int(value)


def transient_statuses() -> frozenset[int]:
    return frozenset(int(s) for s in get("TRANSIENT_STATUSES"))


def in_progress_wait() -> timedelta:
    return as_timedelta(get("IN_PROGRESS_WAIT"))


def retry_after() -> int:
    return int(get("RETRY_AFTER"))


def purge_batch_size() -> int:
    return int(get("PURGE_BATCH_SIZE"))


def purge_max_batches() -> int | None:
    """How many batches one purge run may take per table; ``None``: until done."""
    value = get("PURGE_MAX_BATCHES")
    return None if value is None else int(value)


def audit() -> bool:
    """Whether records leaving the deduplication window are first copied to the audit trail."""
    return bool(get("AUDIT"))


def audit_retention() -> timedelta:
    """How long an audit record is kept after it was archived."""
    return as_timedelta(get("AUDIT_RETENTION"))


# -- the transactional outbox ------------------------------------------------------------------


def outbox_sender() -> Callable[..., Any]:
    """The callable that sends one outbox message (``OUTBOX_SENDER``)."""
    return resolve_callable(get("OUTBOX_SENDER"))


def outbox_max_attempts() -> int:
    """Failed sends after which a message is ``dead``."""
    return int(get("OUTBOX_MAX_ATTEMPTS"))


def outbox_retention() -> timedelta:
    """How long a sent message is kept before the purge deletes it."""
    return as_timedelta(get("OUTBOX_RETENTION"))


def outbox_batch_size() -> int:
    """Messages the relay takes (and locks) per batch."""
    return int(get("OUTBOX_BATCH_SIZE"))


def outbox_backoff() -> timedelta:
    """The wait after a message's first failed send; it doubles with every further failure."""
    return as_timedelta(get("OUTBOX_BACKOFF"))


def outbox_backoff_max() -> timedelta:
    """The longest wait between two sends of one message."""
    return as_timedelta(get("OUTBOX_BACKOFF_MAX"))


def outbox_poll_interval() -> timedelta:
    """How often a waiting relay looks for due messages, with or without a notification."""
    return as_timedelta(get("OUTBOX_POLL_INTERVAL"))
