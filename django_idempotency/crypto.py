"""Stored responses sealed at rest: ``IDEMPOTENCY["ENCRYPTION_KEYS"]``.

With keys set, the body and the stored headers of every response a record keeps are written
sealed with the first key (Fernet, through ``MultiFernet``: AES-128-CBC with HMAC-SHA256)
and opened on read with any of them. Everything else a record holds stays in the clear,
because the engine's statements, the purge, the statistics and the admin's filters work on
it: the account, the operation, the key, the request's fingerprint, the status, the response
status, the lease and the times.

A row says it is sealed in its ``response_headers`` column, so no column is added to the hot
path. Headers in the clear are a JSON array (the engine never stores anything else there);
sealed ones are a JSON string, ``"fernet:<key id>:<token>"``, which no stored plaintext can
be. The body is then the raw bytes of its own Fernet token (its base64 text would be a third
larger). A record in progress stores no response, so nothing of it is sealed. Records written
before keys were set stay readable in the clear until ``rotate_idempotency_encryption``
seals them.

The result of each ``step()`` (a resumable operation's recorded steps) is sealed too, in its
own text column: ``"fernet:<key id>:<token>"`` in place of its JSON text, which no JSON text
can be (nothing that is JSON begins with ``f`` but ``false``). It is sealed where it is
recorded, in the statement that records it; a result recorded in the clear stays readable.

A sealed response that no configured key opens (its key was removed, the keys were emptied,
a rotation step was skipped, or the row is damaged) is never replayed and never run again:
within its TTL the record is refused (``503`` ``idempotency_record_unreadable``,
``RecordUnreadable``), and once a key that opens it is configured again it is replayed as it
was. ``manage.py check --database <alias>`` reports the key ids that sealed outcomes still
need (``E026``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import Count, QuerySet, TextField
from django.db.models.functions import Cast, Substr

from django_idempotency import _storable, _validation
from django_idempotency._purge import budgeted_batches
from django_idempotency._vendors import of
from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyAuditRecord, IdempotencyRecord, IdempotencyStep
from django_idempotency.states import IN_PROGRESS

if TYPE_CHECKING:
    from cryptography.fernet import MultiFernet

__all__ = [
    "ROTATE_BATCH_SIZE",
    "Keys",
    "RotationResult",
    "Unreadable",
    "key_id",
    "missing_key_ids",
    "missing_step_key_ids",
    "open_response",
    "open_step_result",
    "opened",
    "rotate",
    "seal_response",
    "seal_step_result",
    "sealed_with",
    "step_sealed_with",
    "unopenable",
]

SCHEME = "fernet"
_PREFIX = f"{SCHEME}:"

Headers = list[list[str]]


class Unreadable(Exception):
    """A stored response that cannot be read back: sealed, and no key of
    ``ENCRYPTION_KEYS`` opens it (``key_id`` names the key that sealed it), or damaged
    (``key_id`` is ``None`` when the damage hides it)."""

    def __init__(self, key_id: str | None, reason: str) -> None:
        self.key_id = key_id
        super().__init__(f"sealed with key {key_id}: {reason}" if key_id else reason)


def key_id(key: str | bytes) -> str:
    """A key's public name: 12 hex digits of the SHA-256 of its 32 bytes.

    Stored beside each sealed response and shown by the admin, the logs and the rotation,
    it says which key sealed what without revealing anything of the key.
    """
    return hashlib.sha256(base64.urlsafe_b64decode(key)).hexdigest()[:12]


@dataclass(frozen=True)
class Keys:
    """The configured keys, ready: ``fernet`` seals with the first and opens with any."""

    fernet: MultiFernet
    first: str
    ids: frozenset[str]


@functools.lru_cache(maxsize=8)
def keys_of(keys: tuple[str, ...]) -> Keys:
    """The :class:`Keys` of a validated ``ENCRYPTION_KEYS``, built once per value."""
    from cryptography.fernet import Fernet, MultiFernet

    return Keys(
        fernet=MultiFernet([Fernet(key) for key in keys]),
        first=key_id(keys[0]),
        ids=frozenset(key_id(key) for key in keys),
    )


def _configured() -> Keys | None:
    keys = app_settings.ENCRYPTION_KEYS
    return keys_of(keys) if keys else None


def sealed_with(stored_headers: Any) -> str | None:
    """The id of the key that sealed a stored response; ``None`` when it is in the clear."""
    if not isinstance(stored_headers, str):
        return None
    scheme, _, rest = stored_headers.partition(":")
    kid, separator, _token = rest.partition(":")
    return kid if scheme == SCHEME and separator else ""


# -- sealing and opening ------------------------------------------------------------------


def seal_response(headers: Headers, body: bytes) -> tuple[Headers | str, bytes]:
    """The headers and body of a response as they are stored.

    Sealed with the first key of ``ENCRYPTION_KEYS``; returned as they are when it is empty
    (one look at the cached setting).
    """
    keys = app_settings.ENCRYPTION_KEYS
    if not keys:
        return headers, body
    return _seal(keys_of(keys), headers, body)


def _seal(keys: Keys, headers: Headers, body: bytes) -> tuple[str, bytes]:
    text = json.dumps(headers, separators=(",", ":")).encode("ascii")
    return _label(keys, text), base64.urlsafe_b64decode(keys.fernet.encrypt(body))


def _label(keys: Keys, data: bytes) -> str:
    """``data`` sealed with the first key, as stored text: ``"fernet:<key id>:<token>"``."""
    return f"{_PREFIX}{keys.first}:{keys.fernet.encrypt(data).decode('ascii')}"


def _unlabel(keys: Keys | None, label: str, what: str) -> tuple[str, bytes]:
    """The id of the key that sealed a stored ``"fernet:<key id>:<token>"`` and what it
    sealed; ``Unreadable`` when no configured key opens it (``what``: the stored value, when
    it is not such a label at all)."""
    kid = sealed_with(label)
    if not kid:
        raise Unreadable(None, f"{what} is neither in the clear nor sealed")
    if keys is None:
        raise Unreadable(kid, "ENCRYPTION_KEYS is empty")
    # Only now: without keys (and so perhaps without cryptography) nothing is opened.
    from cryptography.fernet import InvalidToken

    try:
        return kid, keys.fernet.decrypt(label.split(":", 2)[2])
    except InvalidToken:
        raise _unopened(keys, kid) from None


def _unopened(keys: Keys, kid: str) -> Unreadable:
    reason = "no key of ENCRYPTION_KEYS opens it"
    return Unreadable(kid, reason if kid not in keys.ids else f"{reason} (damaged)")


def open_response(stored_headers: Any, stored_body: Any) -> tuple[Headers, bytes | None]:
    """A stored response's headers and body as they were answered.

    In the clear: returned as they are. Sealed: opened with whichever configured key sealed
    them; ``Unreadable`` when none does.
    """
    if not isinstance(stored_headers, str):
        return stored_headers or [], None if stored_body is None else bytes(stored_body)
    return _open(_configured(), stored_headers, stored_body)


def _open(keys: Keys | None, stored_headers: str, stored_body: Any) -> tuple[Headers, bytes | None]:
    kid, text = _unlabel(keys, stored_headers, "the stored header set")
    assert keys is not None  # _unlabel opened the headers with them
    from cryptography.fernet import InvalidToken

    try:
        # read_json: sealed JSON nested past Python's decoder is damage like any other.
        headers = _storable.read_json(text.decode("utf-8"))
        if stored_body is None:
            return headers, None
        return headers, keys.fernet.decrypt(base64.urlsafe_b64encode(bytes(stored_body)))
    except (InvalidToken, ValueError):  # binascii.Error is a ValueError
        raise _unopened(keys, kid) from None


def seal_step_result(text: str) -> str:
    """A step's result (its JSON text) as it is recorded: sealed with the first key of
    ``ENCRYPTION_KEYS``, or as it is when that is empty (one look at the cached setting)."""
    keys = app_settings.ENCRYPTION_KEYS
    if not keys:
        return text
    return _label(keys_of(keys), text.encode("utf-8"))


def step_sealed_with(result: Any) -> str | None:
    """The id of the key that sealed a recorded step result; ``None`` when it is in the
    clear (JSON text), ``""`` when its label is damaged."""
    if not isinstance(result, str) or not result.startswith(_PREFIX):
        return None
    return sealed_with(result)


def open_step_result(result: str) -> str:
    """A recorded step result as its step returned it (JSON text, not checked here): as it
    is when in the clear, opened with whichever configured key sealed it, ``Unreadable``
    when none does."""
    return _open_step_result(_configured(), result)


def _open_step_result(keys: Keys | None, result: str) -> str:
    if step_sealed_with(result) is None:
        return result
    kid, text = _unlabel(keys, result, "the recorded step result")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        assert keys is not None
        raise _unopened(keys, kid) from None


def opened(stored_headers: Any, stored_body: Any) -> tuple[Headers, Any, Unreadable | None]:
    """``(headers, body, None)`` of a stored response, for the store's reads; a sealed one
    that cannot be opened comes back as no response and the :class:`Unreadable` that says
    why (the refusal is logged where it is answered, naming the key id)."""
    try:
        headers, body = open_response(stored_headers, stored_body)
    except Unreadable as exc:
        return [], None, exc
    return headers, body, None


def missing_key_ids(using: str) -> dict[str, int]:
    """``{key id: records}`` of the completed and failed records of ``using`` sealed with a
    key that ``ENCRYPTION_KEYS`` does not hold (all of them when it is empty): the outcomes
    that are refused until that key is configured again.

    One pass over the records table (the key id is read from the start of each stored
    header set): for ``manage.py check --database``, the admin and ``idempotency_stats``,
    not for the request path.
    """
    return _missing(
        _sealed_key_ids(IdempotencyRecord.objects.using(using).exclude(status=IN_PROGRESS))
    )


def missing_step_key_ids(using: str) -> dict[str, int]:
    """``{key id: step results}`` of ``using`` sealed with a key that ``ENCRYPTION_KEYS``
    does not hold (all of them when it is empty): a resumable operation's next attempt that
    reaches one is refused until that key is configured again. One pass over the steps table,
    as :func:`missing_key_ids` makes over the records."""
    return _missing(_labelled(IdempotencyStep.objects.using(using), "result", _PREFIX))


def _missing(sealed: QuerySet[Any]) -> dict[str, int]:
    configured = _configured()
    known = configured.ids if configured is not None else frozenset()
    counts = sealed.values_list("sealed_key_id").annotate(rows=Count("*")).order_by()
    return {str(kid): int(n) for kid, n in counts if kid not in known}


def _sealed_key_ids(records: QuerySet[Any]) -> QuerySet[Any]:
    # The stored headers as JSON text: a sealed set is the JSON string "fernet:<id>:<token>",
    # so its key id is the 12 characters after the quote and the scheme.
    text = Cast("response_headers", TextField())
    return _labelled(records.annotate(_headers_text=text), "_headers_text", f'"{_PREFIX}')


def _labelled(rows: QuerySet[Any], column: str, prefix: str) -> QuerySet[Any]:
    """Those of ``rows`` whose text ``column`` begins with ``prefix`` and a key id, that id
    annotated as ``sealed_key_id``."""
    sealed: QuerySet[Any] = rows.filter(**{f"{column}__startswith": prefix}).annotate(
        sealed_key_id=Substr(column, len(prefix) + 1, 12)
    )
    return sealed


def unopenable(records: QuerySet[Any]) -> QuerySet[Any]:
    """Those of ``records`` sealed with a key that ``ENCRYPTION_KEYS`` does not hold (the
    admin's filter). A token damaged under a configured key is found only when read."""
    configured = _configured()
    sealed = _sealed_key_ids(records)
    if configured is None:
        return sealed
    return sealed.exclude(sealed_key_id__in=sorted(configured.ids))


# -- rotation -------------------------------------------------------------------------------

#: Rows per rotation batch by default: each batch holds at most this many bodies in memory
#: (up to MAX_RESPONSE_BYTES each) and locks its rows until it commits.
ROTATE_BATCH_SIZE = 100

Progress = Callable[[int, int], None]


@dataclass
class RotationResult:
    """What one rotation run did (or, with ``dry_run``, would do)."""

    #: Records and audit records sealed with the first key by this run (plaintext ones too).
    records: int = 0
    audit_records: int = 0
    #: Results of ``step()`` sealed with the first key by this run.
    steps: int = 0
    #: Already sealed with the first key: left as they are.
    current: int = 0
    #: Sealed with a key ``ENCRYPTION_KEYS`` no longer holds: left as they are.
    unreadable: int = 0
    #: Replaced, completed anew or deleted between the batch's read and its write: left to
    #: whoever changed them (a new completion is sealed with the first key already).
    changed: int = 0
    #: Held by another transaction when their batch came (a claim's lock, an edit): left
    #: under their key; a run that found none is needed before a key is removed.
    in_use: int = 0
    #: Larger, once sealed, than one statement the database takes (MariaDB's and MySQL's
    #: ``max_allowed_packet``): left as they are, readable.
    too_large: int = 0
    batches: int = 0
    longest_batch_seconds: float = 0.0
    dry_run: bool = False
    key_id: str = ""


@dataclass
class _Walk:
    """One table's rows in id order, a batch at a time: each batch reads ids and headers
    (locked, skipping rows another transaction holds), then the bodies it must reseal."""

    rows: QuerySet[Any]
    counter: str
    #: Columns whose values pin the version of the stored response that was read; the
    #: update matches only while they are unchanged.
    fence: tuple[str, ...]
    keys: Keys
    result: RotationResult
    last: Any = 0
    tally: dict[str, int] = field(default_factory=dict)

    def batch(self, size: int) -> int:
        self.tally = dict.fromkeys(
            ("current", "unreadable", "changed", "too_large", "in_use", self.counter), 0
        )
        alias = self.rows.db
        with transaction.atomic(using=alias):
            page = self.rows.filter(pk__gt=self.last).order_by("pk")
            skip = connections[alias].features.has_select_for_update_skip_locked
            ids: list[Any] | None = None
            if not self.result.dry_run and skip:
                # The batch's rows first, unlocked: those the locked read then skips are held
                # by another transaction, left under their key and counted.
                ids = list(page.values_list("pk", flat=True)[:size])
                page = page.filter(pk__in=ids)
            if not self.result.dry_run:
                page = page.select_for_update(skip_locked=skip)
            found = self._read(page, size)
            if ids is not None:
                self.tally["in_use"] = len(ids) - len(found)
            todo = self._todo(found)
            if self.result.dry_run:
                self.tally[self.counter] += len(todo)
            elif todo:
                self._reseal(todo)
        # Counted once the batch committed: a batch run again after a deadlock counts once.
        for name, count in self.tally.items():
            setattr(self.result, name, getattr(self.result, name) + count)
        walked = ids if ids is not None else [row[0] for row in found]
        if walked:
            self.last = walked[-1]
        return len(walked)

    def _read(self, page: QuerySet[Any], size: int) -> list[tuple[Any, ...]]:
        """``(pk, what says how it is sealed, *fence)`` of the batch's rows."""
        # The headers as their JSON text, decoded here: a set the JSON field could not
        # decode (nested past Python's decoder) is counted, never the end of the walk.
        page = page.annotate(_headers_text=Cast("response_headers", TextField()))
        return [
            (pk, _decoded(text), *version)
            for pk, text, *version in page.values_list("pk", "_headers_text", *self.fence)[:size]
        ]

    def _todo(self, found: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The rows to seal (again); the others counted."""
        return [row for row in found if self._needs_sealing(row[1])]

    def _needs_sealing(self, stored_headers: Any) -> bool:
        if stored_headers is _UNDECODABLE:
            self.tally["unreadable"] += 1
            return False
        kid = sealed_with(stored_headers)
        if kid == self.keys.first:
            self.tally["current"] += 1
            return False
        if (
            kid is not None
            and kid not in self.keys.ids
            and not self._headers_open(kid, stored_headers)
        ):
            self.tally["unreadable"] += 1
            return False
        if kid is None and not _storable.header_pairs(stored_headers):
            # Damaged in the clear: sealing it would only hide the damage.
            self.tally["unreadable"] += 1
            return False
        return True

    def _headers_open(self, kid: str, stored_headers: str) -> bool:
        # A key id is not authenticated, its token is: one that no configured key has (a
        # damaged id) is taken at its word only once no configured key opens the token of
        # the headers, which the batch has read already.
        if not kid:
            return False
        from cryptography.fernet import InvalidToken

        try:
            self.keys.fernet.decrypt(stored_headers.split(":", 2)[2])
        except InvalidToken:
            return False
        return True

    def _reseal(self, todo: list[tuple[Any, ...]]) -> None:
        manager = self.rows.model._default_manager.using(self.rows.db)
        bodies = dict(
            manager.filter(pk__in=[row[0] for row in todo]).values_list("pk", "response_body")
        )
        for pk, stored_headers, *version in todo:
            if bodies.get(pk) is None:  # deleted, or taken over (no response yet)
                self.tally["changed"] += 1
                continue
            headers, body = stored_headers, bodies[pk]
            if isinstance(stored_headers, str):
                try:
                    headers, body = _open(self.keys, stored_headers, body)
                except Unreadable:
                    self.tally["unreadable"] += 1
                    continue
            sealed_headers, sealed_body = _seal(self.keys, headers, bytes(body))
            if self._too_large(sealed_body, json.dumps(sealed_headers)):
                # Its sealed bytes escape to more than its clear ones did: sent, the update
                # would make the server drop the connection, and every run stop here.
                self.tally["too_large"] += 1
                continue
            updated = manager.filter(pk=pk, **dict(zip(self.fence, version, strict=True))).update(
                response_headers=sealed_headers, response_body=sealed_body
            )
            self.tally[self.counter if updated else "changed"] += 1

    def _too_large(self, body: bytes, text: str) -> bool:
        vendor = of(self.rows.db)
        if vendor.packet_limit_sql is None:  # a server that caps a statement's size
            return False
        connection = connections[self.rows.db]
        return vendor.statement_limit(connection, body, text) is not None


#: Of a recorded step result, what says whether and with which key it is sealed.
_STEP_LABEL = len(_PREFIX) + 12 + 1


class _StepWalk(_Walk):
    """The recorded step results: rows that never change once written (a purge or a new
    operation may delete them), read by their label first; only those not sealed with the
    first key are read whole, opened and checked before they are counted or sealed."""

    def _read(self, page: QuerySet[Any], size: int) -> list[tuple[Any, ...]]:
        page = page.annotate(_label=Substr("result", 1, _STEP_LABEL))
        return list(page.values_list("pk", "_label")[:size])

    def _todo(self, found: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        pending = []
        for pk, label in found:
            if step_sealed_with(label) == self.keys.first:
                self.tally["current"] += 1
            else:
                pending.append(pk)
        manager = self.rows.model._default_manager.using(self.rows.db)
        results = dict(manager.filter(pk__in=pending).values_list("pk", "result"))
        todo = []
        for pk in pending:
            if pk not in results:  # deleted meanwhile (SQLite: no row locks)
                self.tally["changed"] += 1
                continue
            try:
                text = _open_step_result(self.keys, results[pk])
            except Unreadable:
                self.tally["unreadable"] += 1
                continue
            if _decoded(text) is _UNDECODABLE:
                # Damaged: sealing it would only hide the damage.
                self.tally["unreadable"] += 1
                continue
            todo.append((pk, text))
        return todo

    def _reseal(self, todo: list[tuple[Any, ...]]) -> None:
        manager = self.rows.model._default_manager.using(self.rows.db)
        for pk, text in todo:
            sealed = _label(self.keys, text.encode("utf-8"))
            if self._too_large(b"", sealed):
                self.tally["too_large"] += 1
                continue
            updated = manager.filter(pk=pk).update(result=sealed)
            self.tally[self.counter if updated else "changed"] += 1


#: Stored headers whose JSON text cannot be decoded (see ``_decoded``).
_UNDECODABLE = object()


def _decoded(text: Any) -> Any:
    try:
        return _storable.read_json(text)
    except (TypeError, ValueError):
        return _UNDECODABLE


def rotate(
    *,
    using: str,
    batch_size: int | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RotationResult:
    """Seal every stored response of ``using`` with the first key of ``ENCRYPTION_KEYS``:
    the records' (never one in progress) and the audit records', then every recorded step
    result (those of records in progress too: a step's row is never updated but here), in
    bounded batches.

    Responses in the clear are sealed; those sealed with another configured key are
    opened and sealed again; those already sealed with the first key are left as they are,
    so a run can be repeated or stopped at any time. Each batch is one short transaction
    of at most ``batch_size`` rows (default ``ROTATE_BATCH_SIZE``, shrunk under the
    purge's time budget) that locks its rows, skipping rows another transaction holds on
    PostgreSQL and MySQL (a live claim or completion is never waited for). A record's
    update is fenced by its status and its ``created_at`` and ``completed_at``: a record
    replaced or completed anew since the batch read it is left alone. ``progress(batches,
    sealed)`` is called after each batch. Raises ``ImproperlyConfigured`` without keys.
    """
    batch_size = _validation.counted_argument("batch_size", batch_size)
    configured = _configured()
    if configured is None:
        raise ImproperlyConfigured(
            "IDEMPOTENCY['ENCRYPTION_KEYS'] is empty: there is no key to seal the stored "
            "responses with."
        )
    result = RotationResult(dry_run=dry_run, key_id=configured.first)
    records = IdempotencyRecord.objects.using(using).exclude(status=IN_PROGRESS)
    audits = IdempotencyAuditRecord.objects.using(using)
    walks = (
        _Walk(
            records.filter(response_body__isnull=False),
            "records",
            ("status", "created_at", "completed_at"),
            configured,
            result,
        ),
        # Audit records never change once written: only a purge may delete one meanwhile.
        _Walk(audits.filter(response_body__isnull=False), "audit_records", (), configured, result),
        _StepWalk(IdempotencyStep.objects.using(using), "steps", (), configured, result),
    )
    for walk in walks:
        for _rows, seconds in budgeted_batches(walk.batch, batch_size or ROTATE_BATCH_SIZE, None):
            result.batches += 1
            result.longest_batch_seconds = max(result.longest_batch_seconds, seconds)
            if progress is not None:
                progress(result.batches, result.records + result.audit_records + result.steps)
    return result
