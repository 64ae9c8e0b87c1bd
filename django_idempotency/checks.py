"""System checks for the ``IDEMPOTENCY`` setting (ids ``django_idempotency.E0xx``/``W0xx``)."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from django_idempotency import conf

_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_SAFE_METHODS = {"GET", "HEAD", "OPTIONS", "TRACE"}


def _error(n: int, msg: str, hint: str | None = None) -> Error:
    return Error(msg, hint=hint, id=f"django_idempotency.E{n:03d}")


def _warning(n: int, msg: str, hint: str | None = None) -> Warning:
    return Warning(msg, hint=hint, id=f"django_idempotency.W{n:03d}")


def _duration(value: Any) -> timedelta | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    return None


def _check_durations() -> Iterable[CheckMessage]:
    durations = {}
    for name in ("TTL", "LEASE", "IN_PROGRESS_WAIT"):
        value = _duration(conf.get(name))
        allow_zero = name == "IN_PROGRESS_WAIT"
        if value is None or value < timedelta(0) or (value == timedelta(0) and not allow_zero):
            yield _error(
                3,
                f"IDEMPOTENCY['{name}'] must be a positive timedelta or number of seconds.",
            )
        durations[name] = value
    ttl, lease, wait = durations["TTL"], durations["LEASE"], durations["IN_PROGRESS_WAIT"]
    if ttl and lease and ttl <= lease:
        yield _error(
            4,
            "IDEMPOTENCY['TTL'] must be longer than IDEMPOTENCY['LEASE'].",
            hint="A record must outlive its lease, or a live claim could expire under its owner.",
        )
    if wait and lease and wait >= lease:
        yield _error(
            11,
            "IDEMPOTENCY['IN_PROGRESS_WAIT'] must be shorter than IDEMPOTENCY['LEASE'].",
        )


def _check_callable(name: str, extra: Callable[[Any], bool] = lambda v: False) -> Iterable[Error]:
    value = conf.get(name)
    if extra(value) or callable(value):
        return
    try:
        imported = conf.resolve_callable(value)
    except (ImportError, TypeError, ValueError) as exc:
        yield _error(8, f"IDEMPOTENCY['{name}'] cannot be imported: {exc}.")
        return
    if not callable(imported):
        yield _error(8, f"IDEMPOTENCY['{name}'] is not callable.")


def _check_numbers() -> Iterable[CheckMessage]:
    limit = conf.get("MAX_RESPONSE_BYTES")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
        yield _error(10, "IDEMPOTENCY['MAX_RESPONSE_BYTES'] must be a positive integer or None.")
    for name in ("PURGE_BATCH_SIZE",):
        value = conf.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            yield _error(10, f"IDEMPOTENCY['{name}'] must be a positive integer.")
    retry_after = conf.get("RETRY_AFTER")
    if not isinstance(retry_after, int) or isinstance(retry_after, bool) or retry_after < 0:
        yield _error(10, "IDEMPOTENCY['RETRY_AFTER'] must be a whole number of seconds (>= 0).")
    statuses = conf.get("TRANSIENT_STATUSES")
    if not all(isinstance(s, int) and 400 <= s < 500 for s in statuses):
        yield _error(10, "IDEMPOTENCY['TRANSIENT_STATUSES'] must hold 4xx status codes.")


@register(Tags.compatibility)
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    """Validate ``IDEMPOTENCY`` and its interplay with ``DATABASES``."""
    raw = getattr(settings, "IDEMPOTENCY", None)
    if raw is not None and not isinstance(raw, dict):
        return [_error(1, "The IDEMPOTENCY setting must be a dict.")]
    messages: list[CheckMessage] = [
        _error(2, f"IDEMPOTENCY has an unknown key '{name}'.", hint="Check its spelling.")
        for name in conf.unknown_keys()
    ]
    messages += _check_durations()
    header = conf.get("HEADER")
    if not isinstance(header, str) or not _HEADER_NAME.match(header):
        messages.append(_error(5, "IDEMPOTENCY['HEADER'] must be a valid HTTP header name."))
    methods = {str(m).upper() for m in conf.get("METHODS")}
    if methods & _SAFE_METHODS:
        messages.append(
            _error(
                6,
                f"IDEMPOTENCY['METHODS'] holds safe methods: {sorted(methods & _SAFE_METHODS)}.",
                hint="Safe methods have no side effect to deduplicate.",
            )
        )
    alias = conf.get("DATABASE")
    if alias not in settings.DATABASES:
        messages.append(_error(7, f"IDEMPOTENCY['DATABASE'] names an unknown database {alias!r}."))
    messages += _check_callable("ACCOUNT_RESOLVER")
    messages += _check_callable("FINGERPRINT")
    messages += _check_callable("RECOVERY", extra=lambda v: v in ("retry", "fail"))
    forbidden = {h.lower() for h in conf.get("REPLAY_HEADERS")} & conf.NEVER_STORED_HEADERS
    if forbidden:
        messages.append(
            _error(
                9,
                f"IDEMPOTENCY['REPLAY_HEADERS'] names headers that are never stored: "
                f"{sorted(forbidden)}.",
            )
        )
    messages += _check_numbers()
    if alias in settings.DATABASES:
        messages += _check_database(alias)
    return messages


def _check_database(alias: str) -> Iterable[CheckMessage]:
    if settings.DATABASES[alias].get("ATOMIC_REQUESTS"):
        yield _warning(
            1,
            f"ATOMIC_REQUESTS is on for the idempotency database {alias!r}.",
            hint=(
                "Protected views are taken out of the request transaction (the claim must "
                "commit before the view runs) and run in a transaction of their own that also "
                "completes the record. The mixin and @idempotent do this for you; a view "
                "under DRF's @api_view needs @transaction.non_atomic_requests above "
                "@api_view, or its claim waits for the whole request's transaction. "
                "django-ninja operations cannot be taken out of it: a protected ninja "
                "operation refuses to run under ATOMIC_REQUESTS."
            ),
        )
    # Where the views' writes go unless they say otherwise: 'default' without routers (W002),
    # else what the routers answer for the project's models (W010). Elsewhere, the record's
    # completion no longer commits in one transaction with the business state.
    hint = (
        "The record completes in the same transaction as the view's writes only for "
        "writes to this database; writes to other databases are not covered."
    )
    if not settings.DATABASE_ROUTERS:
        if alias != "default":
            yield _warning(2, f"IDEMPOTENCY['DATABASE'] is {alias!r}, not 'default'.", hint=hint)
        return
    write_alias = _routed_write_alias()
    if write_alias is not None and alias != write_alias:
        yield _warning(
            10,
            f"IDEMPOTENCY['DATABASE'] is {alias!r}, but DATABASE_ROUTERS send the project's "
            f"writes to {write_alias!r}.",
            hint=hint,
        )


def _routed_write_alias() -> str | None:
    """The alias ``db_for_write`` answers for most of the project's models, or ``None``.

    The project's models are those outside ``django.contrib`` and this app; a project made
    only of contrib apps is judged by those.
    """
    from collections import Counter

    from django.apps import apps
    from django.db import router

    models = [m for m in apps.get_models() if m._meta.app_label != "django_idempotency"]
    own = [m for m in models if not m.__module__.startswith("django.contrib.")]
    try:
        votes = Counter(router.db_for_write(model) for model in own or models)
    except Exception:  # a router that cannot answer without a request: nothing to compare
        return None
    return votes.most_common(1)[0][0] if votes else None


@register(Tags.compatibility)
def check_maintenance_settings(**kwargs: Any) -> list[CheckMessage]:
    """Validate the purge and audit-trail entries of ``IDEMPOTENCY`` (ids E020-E029)."""
    raw = getattr(settings, "IDEMPOTENCY", None)
    if raw is not None and not isinstance(raw, dict):
        return []  # E001 already says so
    messages: list[CheckMessage] = []
    audit = conf.get("AUDIT")
    if not isinstance(audit, bool):
        messages.append(_error(20, "IDEMPOTENCY['AUDIT'] must be True or False."))
    retention = _duration(conf.get("AUDIT_RETENTION"))
    if retention is None or retention <= timedelta(0):
        messages.append(
            _error(
                21,
                "IDEMPOTENCY['AUDIT_RETENTION'] must be a positive timedelta or number of seconds.",
            )
        )
    max_batches = conf.get("PURGE_MAX_BATCHES")
    if max_batches is not None and (
        not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches <= 0
    ):
        messages.append(
            _error(22, "IDEMPOTENCY['PURGE_MAX_BATCHES'] must be a positive integer or None.")
        )
    return messages


# -- the transactional outbox (ids E030-E039) ----------------------------------------------------

_OUTBOX_DURATIONS = {
    "OUTBOX_RETENTION": 32,
    "OUTBOX_BACKOFF": 34,
    "OUTBOX_BACKOFF_MAX": 35,
    "OUTBOX_POLL_INTERVAL": 36,
}
_OUTBOX_COUNTS = {"OUTBOX_MAX_ATTEMPTS": 31, "OUTBOX_BATCH_SIZE": 33}


def _check_outbox_sender() -> Iterable[CheckMessage]:
    value = conf.get("OUTBOX_SENDER")
    if callable(value):
        return
    if (
        value == conf.OUTBOX_DEFAULTS["OUTBOX_SENDER"]
        and importlib.util.find_spec("celery") is None
    ):
        # The outbox is optional: without Celery the default sender is simply never used,
        # and relay_outbox says so if it is run.
        return
    try:
        imported = conf.resolve_callable(value)
    except (ImportError, TypeError, ValueError) as exc:
        yield _error(30, f"IDEMPOTENCY['OUTBOX_SENDER'] cannot be imported: {exc}.")
        return
    if not callable(imported):
        yield _error(30, "IDEMPOTENCY['OUTBOX_SENDER'] is not callable.")


@register(Tags.compatibility)
def check_outbox_settings(**kwargs: Any) -> list[CheckMessage]:
    """Validate the ``OUTBOX_*`` entries of ``IDEMPOTENCY`` (ids E030-E039)."""
    raw = getattr(settings, "IDEMPOTENCY", None)
    if raw is not None and not isinstance(raw, dict):
        return []  # E001 already says so
    messages: list[CheckMessage] = list(_check_outbox_sender())
    for name, n in _OUTBOX_COUNTS.items():
        value = conf.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            messages.append(_error(n, f"IDEMPOTENCY['{name}'] must be a positive integer."))
    durations = {}
    for name, n in _OUTBOX_DURATIONS.items():
        durations[name] = value = _duration(conf.get(name))
        if value is None or value <= timedelta(0):
            messages.append(
                _error(
                    n, f"IDEMPOTENCY['{name}'] must be a positive timedelta or number of seconds."
                )
            )
    backoff, longest = durations["OUTBOX_BACKOFF"], durations["OUTBOX_BACKOFF_MAX"]
    if backoff and longest and backoff > timedelta(0) and longest < backoff:
        messages.append(
            _error(35, "IDEMPOTENCY['OUTBOX_BACKOFF_MAX'] must not be shorter than OUTBOX_BACKOFF.")
        )
    return messages
