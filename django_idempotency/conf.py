"""The ``IDEMPOTENCY`` setting: one typed, validated property per entry.

Read everything through :data:`app_settings`, e.g. ``app_settings.TTL``. Nothing is written
into ``django.conf.settings`` and nothing is read at import time: the first read validates
the whole setting and keeps the result until ``setting_changed`` reports a change (so
``override_settings`` works).

A wrong value is never coerced, ignored or replaced by its default. When any entry breaks
its rule, every read raises ``ImproperlyConfigured`` naming the entries, what each expected
and the id of its system check. A request under a wrong setting therefore fails before its
view runs, instead of running unprotected. ``manage.py check`` reports the same rules as
Errors, one id per setting.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from django_idempotency import _check_ids, _policies, _validation
from django_idempotency._validation import Invalid

# Never stored, never replayed: they describe one hop or one moment, or carry credentials.
# Naming one in REPLAY_HEADERS is an error (check E009), not something silently dropped.
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
# Content-Encoding with them: a body the view compressed (@gzip_page beneath @idempotent) is
# bytes that only it makes readable, and a replay without it is compressed bytes taken for
# JSON. Content-Type first: the replay hands it to the response's constructor.
ALWAYS_STORED_HEADERS = ("Content-Type", "Location", "Content-Encoding")


def _replay_headers(value: Any) -> tuple[str, ...]:
    return _validation.header_names(value, NEVER_STORED_HEADERS)


def _database(value: Any) -> str:
    aliases = sorted(settings.DATABASES)
    if not isinstance(value, str) or value not in settings.DATABASES:
        raise Invalid(f"the alias of a database in DATABASES ({', '.join(aliases)})", value)
    return value


def _optional_database(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return _database(value)
    except Invalid as exc:
        raise Invalid(f"None or {exc.expected}", value) from None


@dataclass(frozen=True)
class Setting:
    """One entry of ``IDEMPOTENCY``: its default and its rule (its check is named after it
    in :mod:`._check_ids`)."""

    name: str
    default: Any
    parse: Callable[[Any], Any]

    @property
    def id(self) -> str:
        """The id of the system check that reports a wrong value of this entry."""
        return _check_ids.error(self.name)


SETTINGS: tuple[Setting, ...] = (
    Setting("HEADER", "Idempotency-Key", _validation.header_name),
    Setting("REQUIRED", True, _validation.flag),
    Setting("TTL", timedelta(hours=24), _validation.duration),
    Setting("LEASE", timedelta(seconds=60), _validation.duration),
    Setting("METHODS", ("POST", "PATCH"), _validation.methods),
    Setting(
        "ACCOUNT_RESOLVER", "django_idempotency.accounts.user_account", _validation.callable_ref
    ),
    Setting(
        "FINGERPRINT",
        "django_idempotency.fingerprint.default_fingerprint",
        _validation.fingerprint,
    ),
    Setting("RECOVERY", _policies.RETRY.name, _validation.recovery),
    Setting("DATABASE", "default", _database),
    Setting("REPLAY_HEADERS", (), _replay_headers),
    Setting("MAX_RESPONSE_BYTES", 1024 * 1024, _validation.optional_positive_int),
    Setting("TRANSIENT_STATUSES", (409, 429), _validation.client_error_statuses),
    Setting("IN_PROGRESS_WAIT", timedelta(0), _validation.duration_or_zero),
    Setting("RETRY_AFTER", 1, _validation.seconds),
    Setting("RETRY_AFTER_MAX", None, _validation.optional_seconds),
    Setting("PURGE_BATCH_SIZE", 1000, _validation.positive_int),
    Setting("PURGE_MAX_BATCHES", None, _validation.optional_positive_int),
    Setting("AUDIT", False, _validation.flag),
    Setting("AUDIT_RETENTION", timedelta(days=90), _validation.duration),
    # Stored responses sealed at rest (django_idempotency.crypto); E025 below.
    Setting("ENCRYPTION_KEYS", (), _validation.fernet_keys),
    # Where a claim made inside a caller's transaction commits (django_idempotency._autonomous).
    Setting("CLAIM_DATABASE", None, _optional_database),
    Setting("CLAIM_TIMEOUT", timedelta(seconds=5), _validation.duration),
)

# -- the transactional outbox (django_idempotency.outbox), ids E030-E039 ------------------------

DEFAULT_OUTBOX_SENDER = "django_idempotency.celery_sender.send"


#: The Tasks backend of the outbox, as ``TASKS`` names it.
TASKS_OUTBOX_BACKEND = "django_idempotency.tasks_backend.OutboxBackend"


def tasks_through_outbox() -> bool:
    """Whether a ``TASKS`` backend is the outbox's: its messages go to another Tasks
    backend, so that the relay needs no ``OUTBOX_SENDER`` (nor Celery) for them."""
    backends = getattr(settings, "TASKS", None)
    return isinstance(backends, Mapping) and any(
        isinstance(params, Mapping) and params.get("BACKEND") == TASKS_OUTBOX_BACKEND
        for params in backends.values()
    )


def only_tasks_through_outbox() -> bool:
    """Whether the relay may go without ``OUTBOX_SENDER``: it is the default, Celery's,
    Celery is not installed, and a ``TASKS`` backend is the outbox's (a project on Django's
    Tasks framework alone)."""
    raw = getattr(settings, "IDEMPOTENCY", {})
    value = raw.get("OUTBOX_SENDER", DEFAULT_OUTBOX_SENDER) if isinstance(raw, Mapping) else None
    return sender_lacks_celery(value) and tasks_through_outbox()


def sender_lacks_celery(value: Any) -> bool:
    """Whether ``value`` is the default sender, Celery's, and Celery is not installed."""
    if value != DEFAULT_OUTBOX_SENDER:
        return False
    try:
        return importlib.util.find_spec("celery") is None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return True


def sender_reports_runs() -> bool:
    """Whether ``OUTBOX_SENDER`` is the default sender, Celery's: the only one that asks the
    worker to report a message's run on its ``enqueue_once`` key (another sender's
    consumer, Kafka's or a webhook's, has no way to)."""
    value = app_settings.loaded()["OUTBOX_SENDER"]
    if value == DEFAULT_OUTBOX_SENDER:
        return True
    default = sys.modules.get("django_idempotency.celery_sender")
    return default is not None and value is getattr(default, "send", None)


def _outbox_sender(value: Any) -> str | Callable[..., Any]:
    # Without Celery the default sender is never imported here: the settings stay valid for
    # the requests, `check` reports it (E037, checks.py), and relay_outbox refuses to start
    # (outbox.configured_sender).
    if sender_lacks_celery(value):
        return DEFAULT_OUTBOX_SENDER
    return _validation.callable_ref(value)


OUTBOX_SETTINGS: tuple[Setting, ...] = (
    Setting("OUTBOX_SENDER", DEFAULT_OUTBOX_SENDER, _outbox_sender),
    Setting("OUTBOX_MAX_ATTEMPTS", 20, _validation.positive_int),
    Setting("OUTBOX_RETENTION", timedelta(days=7), _validation.duration),
    Setting("OUTBOX_BATCH_SIZE", 100, _validation.positive_int),
    Setting("OUTBOX_BACKOFF", timedelta(seconds=1), _validation.duration),
    Setting("OUTBOX_BACKOFF_MAX", timedelta(minutes=5), _validation.duration),
    Setting("OUTBOX_POLL_INTERVAL", timedelta(seconds=1), _validation.duration),
)
OUTBOX_DEFAULTS: dict[str, Any] = {setting.name: setting.default for setting in OUTBOX_SETTINGS}
SETTINGS += OUTBOX_SETTINGS
BY_NAME = {setting.name: setting for setting in SETTINGS}
DEFAULTS: dict[str, Any] = {setting.name: setting.default for setting in SETTINGS}


@dataclass(frozen=True)
class Problem:
    """One broken rule: the id of its check, a message naming the entry, and a hint."""

    id: str
    message: str
    hint: str | None = None


_MISSING = object()


def _relations(values: Mapping[str, Any]) -> list[Problem]:
    problems: list[Problem] = []
    ttl, lease, wait = (values.get(name) for name in ("TTL", "LEASE", "IN_PROGRESS_WAIT"))
    if ttl is not None and lease is not None and ttl <= lease:
        problems.append(
            Problem(
                _check_ids.error("TTL_NOT_LONGER_THAN_LEASE"),
                f"IDEMPOTENCY['TTL'] ({ttl}) must be longer than IDEMPOTENCY['LEASE'] ({lease}).",
                "A record must outlive its lease, or a live claim could expire under its owner.",
            )
        )
    claims = values.get("CLAIM_DATABASE")
    if claims is not None and claims == values.get("DATABASE"):
        problems.append(
            Problem(
                BY_NAME["CLAIM_DATABASE"].id,
                f"IDEMPOTENCY['CLAIM_DATABASE'] must be another alias than "
                f"IDEMPOTENCY['DATABASE'] ({claims!r}): a claim made inside a transaction on "
                "that alias must commit on a connection of its own.",
                "Add a DATABASES entry for the same database (through a PgBouncer pool of "
                "its own, say) and name it here, or leave CLAIM_DATABASE as None.",
            )
        )
    backoff, longest = values.get("OUTBOX_BACKOFF"), values.get("OUTBOX_BACKOFF_MAX")
    if backoff is not None and longest is not None and longest < backoff:
        problems.append(
            Problem(
                BY_NAME["OUTBOX_BACKOFF_MAX"].id,
                f"IDEMPOTENCY['OUTBOX_BACKOFF_MAX'] ({longest}) must not be shorter than "
                f"IDEMPOTENCY['OUTBOX_BACKOFF'] ({backoff}).",
            )
        )
    if wait is not None and lease is not None and wait >= lease:
        problems.append(
            Problem(
                _check_ids.error("WAIT_NOT_SHORTER_THAN_LEASE"),
                f"IDEMPOTENCY['IN_PROGRESS_WAIT'] ({wait}) must be shorter than "
                f"IDEMPOTENCY['LEASE'] ({lease}).",
            )
        )
    return problems


def _cryptography_problems(values: Mapping[str, Any]) -> list[Problem]:
    if not values.get("ENCRYPTION_KEYS"):
        return []
    try:
        import cryptography.fernet  # noqa: F401
    except ImportError as exc:
        return [
            Problem(
                _check_ids.error("CRYPTOGRAPHY_MISSING"),
                "IDEMPOTENCY['ENCRYPTION_KEYS'] is set, but the cryptography package cannot be "
                f"imported ({exc}).",
                'Install the crypto extra: pip install "django-idempotency[crypto]".',
            )
        ]
    return []


def _did_you_mean(name: object) -> str:
    """`` Did you mean 'TTL'?`` for a key close to a known one (``difflib``), else ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name.upper(), DEFAULTS, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def validate(raw: Any = _MISSING) -> tuple[dict[str, Any], list[Problem]]:
    """Every entry of ``IDEMPOTENCY`` (the current setting unless ``raw`` is given), parsed.

    Returns the parsed values of the valid entries and one :class:`Problem` per broken
    rule. Never raises: a rule that fails in an unforeseen way is reported as a problem of
    its entry.
    """
    if raw is _MISSING:
        raw = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(raw, Mapping):
        message = f"The IDEMPOTENCY setting must be a dict; got {_validation.describe(raw)}."
        return {}, [Problem(_check_ids.error("NOT_A_DICT"), message)]
    problems = [
        Problem(
            _check_ids.error("UNKNOWN_KEY"),
            f"IDEMPOTENCY has an unknown key {name!r}.{_did_you_mean(name)}",
            f"Check its spelling; the known keys are {', '.join(DEFAULTS)}.",
        )
        for name in sorted(set(raw) - set(DEFAULTS), key=repr)
    ]
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        value = raw.get(setting.name, setting.default)
        try:
            values[setting.name] = setting.parse(value)
        except Invalid as exc:
            problems.append(Problem(setting.id, f"IDEMPOTENCY['{setting.name}'] {exc}."))
        except Exception as exc:  # the check must report, never crash
            problems.append(
                Problem(
                    setting.id,
                    f"IDEMPOTENCY['{setting.name}'] could not be validated: "
                    f"{type(exc).__name__}: {exc}.",
                )
            )
    return values, problems + _relations(values) + _cryptography_problems(values)


class IdempotencySettings:
    """The validated ``IDEMPOTENCY`` setting: one typed attribute per entry of :data:`SETTINGS`.

    The first read validates every entry; a wrong one makes every read raise
    ``ImproperlyConfigured`` (see the module's docstring). A value read once is kept as a
    plain attribute until ``setting_changed`` reports a change (as DRF's ``api_settings``
    does): the hot path reads an instance attribute. Thread-safe.
    """

    #: The request header that carries the key.
    HEADER: str
    #: Whether a protected method without a key is refused with ``400``.
    REQUIRED: bool
    #: How long a record deduplicates retries, from its claim.
    TTL: timedelta
    #: How long a claim is owned before a retry may take it over.
    LEASE: timedelta
    #: The protected methods, upper-case.
    METHODS: frozenset[str]
    #: ``request -> str | None``: the caller's server-side identity (imported).
    ACCOUNT_RESOLVER: Callable[[Any], str | None]
    #: ``request -> str``: the hash a retry is compared by (imported).
    FINGERPRINT: Callable[[Any], str]
    #: ``"retry"``, ``"fail"``, a callable, or a dotted path known to import one.
    RECOVERY: str | Callable[..., Any]
    #: The alias of the database that holds the records.
    DATABASE: str
    #: The extra response headers to store and replay, as configured.
    REPLAY_HEADERS: tuple[str, ...]
    #: The largest body kept for replay; ``None``: no limit.
    MAX_RESPONSE_BYTES: int | None
    #: 4xx statuses that are not stored: the view's work is rolled back.
    TRANSIENT_STATUSES: frozenset[int]
    #: How long an in-flight duplicate may wait for the original's outcome.
    IN_PROGRESS_WAIT: timedelta
    #: The ``Retry-After`` seconds of a ``503``.
    RETRY_AFTER: int
    #: The most seconds a refused duplicate in flight is told to wait (``None``: the lease's).
    RETRY_AFTER_MAX: int | None
    #: Rows per purge batch, and records per page of the recovery job.
    PURGE_BATCH_SIZE: int
    #: The most batches one purge run takes per table; ``None``: until done.
    PURGE_MAX_BATCHES: int | None
    #: Whether records are copied to the audit trail before they leave the window.
    AUDIT: bool
    #: How long an audit record is kept after it was archived.
    AUDIT_RETENTION: timedelta
    #: Fernet keys that seal stored responses: the first seals, any opens; empty: off.
    ENCRYPTION_KEYS: tuple[str, ...]
    #: The alias a claim made inside a caller's transaction commits on; ``None``: a
    #: connection of the claim's own to the ``DATABASE`` database, outside any pool.
    CLAIM_DATABASE: str | None
    #: How long such a claim may wait for its connection and its statements.
    CLAIM_TIMEOUT: timedelta
    #: Failed sends after which a message is ``dead``.
    OUTBOX_MAX_ATTEMPTS: int
    #: How long a sent message is kept before the purge deletes it.
    OUTBOX_RETENTION: timedelta
    #: Messages the relay takes (and locks) per batch.
    OUTBOX_BATCH_SIZE: int
    #: The wait after a message's first failed send; it doubles with every failure.
    OUTBOX_BACKOFF: timedelta
    #: The longest wait between two sends of one message.
    OUTBOX_BACKOFF_MAX: timedelta
    #: How often a waiting relay looks for due messages.
    OUTBOX_POLL_INTERVAL: timedelta

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._values: dict[str, Any] | None = None
        self._error: str | None = None

    def reload(self) -> None:
        """Forget the validated values: the next read validates the setting again."""
        with self._lock:
            self._generation += 1
            self._values = None
            self._error = None
            for name in BY_NAME:
                self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        # Called for an entry not read since the last change (and for any unknown name).
        if name not in BY_NAME:
            raise AttributeError(f"IDEMPOTENCY has no entry {name!r}")
        generation = self._generation
        value = self.loaded()[name]
        with self._lock:
            if generation == self._generation:  # no change since: keep it
                self.__dict__[name] = value
        return value

    def _load(self) -> dict[str, Any]:
        with self._lock:
            generation = self._generation
        values, problems = validate()
        error = None
        if problems:
            error = "The IDEMPOTENCY setting is invalid: " + " ".join(
                f"{p.message} ({p.id})" for p in problems
            )
        with self._lock:
            # A change reported while this load ran wins: keep nothing read before it.
            if generation == self._generation:
                self._values, self._error = (None, error) if error else (values, None)
        if error:
            raise ImproperlyConfigured(error)
        return values

    def loaded(self) -> dict[str, Any]:
        """The validated values as one mapping, the same object until the setting changes:
        what is worked out from them can be kept as long as it is this one."""
        values, error = self._values, self._error
        if error is not None:
            raise ImproperlyConfigured(error)
        return values if values is not None else self._load()

    @property
    def stored_headers(self) -> tuple[str, ...]:
        """Every response header a record keeps: ``Content-Type``, ``Location``,
        ``Content-Encoding``, the extras."""
        return _stored_headers(self.REPLAY_HEADERS)

    @property
    def OUTBOX_SENDER(self) -> Callable[..., Any]:
        """The callable that sends one outbox message (imported; ``ImportError`` when the
        default sender's Celery is not installed)."""
        return resolve_callable(self.loaded()["OUTBOX_SENDER"])


@functools.lru_cache(maxsize=8)
def _stored_headers(extra: tuple[str, ...]) -> tuple[str, ...]:
    # Read by every completion: worked out once per value of REPLAY_HEADERS.
    always = {name.lower() for name in ALWAYS_STORED_HEADERS}
    return ALWAYS_STORED_HEADERS + tuple(name for name in extra if name.lower() not in always)


app_settings = IdempotencySettings()


@receiver(setting_changed)
def _reload(*, setting: str, **kwargs: Any) -> None:
    # DATABASES too: the DATABASE entry is checked against it.
    if setting in ("IDEMPOTENCY", "DATABASES"):
        app_settings.reload()
        _validation.import_cached.cache_clear()


def resolve_callable(value: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable given as itself or as a dotted import path (imports are remembered)."""
    if isinstance(value, str):
        imported: Callable[..., Any] = _validation.import_cached(value)
        return imported
    return value


def as_timedelta(value: timedelta | int | float) -> timedelta:
    """A duration given as a ``timedelta`` or as a number of seconds."""
    if isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)
