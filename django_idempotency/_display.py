"""Stored data made fit to show, whatever it holds: response bodies, headers, JSON and the
recorded steps of resumable records.

The admin renders every record and every outbox message through these functions, and
they never raise: a body nested 30,000 levels deep, a megabyte of JSON, bytes that are not
UTF-8, headers that are not a list of pairs, a lone surrogate in a JSON string. What they
show is bounded (:data:`PREVIEW_CHARS`), with a note saying what was cut; the stored data
is never changed.

JSON columns are read as their text (:func:`stored_columns`) and decoded here, so a value
that Python cannot decode does not stop the page from loading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

from django.db import models
from django.db.models import F, Func, IntegerField
from django.db.models.functions import Cast, Substr
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_idempotency import _storable, crypto, states
from django_idempotency.conf import app_settings
from django_idempotency.models import IdempotencyRecord, IdempotencyStep

# Stored bodies can reach MAX_RESPONSE_BYTES (1 MiB by default); a page shows at most this
# much of one, and at most this many characters of any text (indented JSON included).
BODY_PREVIEW_BYTES = 64 * 1024
PREVIEW_CHARS = 64 * 1024


def stored_columns(instance: models.Model, *names: str) -> dict[str, Any]:
    """The columns ``names`` of a saved row as the database holds them, read in one query and
    remembered on the instance: JSON columns as their text (undecoded), others as stored."""
    cache: dict[str, Any] = instance.__dict__.setdefault("_stored_columns", {})
    missing = [name for name in names if name not in cache]
    if missing:
        model = type(instance)
        expressions = {
            f"stored_{name}": Cast(name, models.TextField())
            if isinstance(model._meta.get_field(name), models.JSONField)
            else models.F(name)
            for name in missing
        }
        row = (
            model._default_manager.using(instance._state.db)
            .filter(pk=instance.pk)
            .values(**expressions)
            .first()
        ) or {}
        cache.update({name: row.get(f"stored_{name}") for name in missing})
    return {name: cache[name] for name in names}


def read_json(text: str | None) -> tuple[Any, str | None]:
    """Stored JSON text decoded, and ``None``; or ``None`` and why it cannot be decoded."""
    if text is None:
        return None, _("nothing stored")
    try:
        return _storable.read_json(text), None
    except ValueError as exc:
        return None, str(exc)


def header_pairs(headers: Any) -> list[tuple[str, str]] | None:
    """Stored headers as ``(name, value)`` pairs; ``None`` when they are not a list of pairs
    of strings."""
    if not isinstance(headers, list):
        return None
    pairs = []
    for pair in headers:
        if not (isinstance(pair, list) and len(pair) == 2):
            return None
        name, value = pair
        if not (isinstance(name, str) and isinstance(value, str)):
            return None
        pairs.append((name, value))
    return pairs


def content_type(headers: Any) -> str:
    """The stored ``Content-Type``, ``""`` when there is none (or the headers are broken)."""
    pairs = header_pairs(headers) or []
    return next((value for name, value in pairs if name.lower() == "content-type"), "")


def render_headers(text: str | None) -> SafeString:
    """Stored headers (the JSON text of the column), one ``name: value`` per line."""
    headers, problem = read_json(text)
    if problem is None:
        pairs = header_pairs(headers)
        if pairs is not None:
            lines = "\n".join(f"{name}: {value}" for name, value in pairs)
            return _pre(lines or "-", "idempotency-headers")
        problem = _("not a list of [name, value] pairs of strings")
    return _pre(text or "", "idempotency-headers", _("Stored as shown: %s.") % problem)


def render_json(text: str | None) -> SafeString:
    """A stored JSON column (its text), indented when it can be decoded."""
    value, problem = read_json(text)
    if problem is None:
        indented = _indented(value)
        if indented is not None:
            return _pre(indented, "idempotency-json")
        problem = _("nested too deeply to be indented")
    return _pre(text or "", "idempotency-json", _("Stored as shown: %s.") % problem)


def render_body(body: bytes | memoryview | None, headers: Any) -> SafeString:
    """A stored body for display: indented JSON, escaped text, or the size of binary data.

    ``headers`` are the record's decoded headers (anything: only a well-formed
    ``Content-Type`` pair is used).
    """
    if body is None:
        return format_html("<em>{}</em>", _("no response stored"))
    data = bytes(body)
    if not data:
        return format_html("<em>{}</em>", _("empty body"))
    shown = data[:BODY_PREVIEW_BYTES]
    cut = len(data) > len(shown)
    try:
        text = shown.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Cutting the preview may split the last multi-byte character: drop that one.
        # Anything else that is not UTF-8 is binary.
        if not (cut and exc.start >= len(shown) - 3):
            return _binary(data)
        text = shown[: exc.start].decode("utf-8")
    if "\x00" in text:
        return _binary(data)
    notes = []
    if cut:
        counts = {"shown": len(shown), "total": len(data)}
        notes.append(_("first %(shown)s of %(total)s bytes shown") % counts)
    elif _may_be_json(headers):
        value, problem = read_json(text)
        indented = _indented(value) if problem is None else None
        if indented is not None:
            text = indented
        elif _says_json(headers):
            notes.append(_("not indented: %s") % (problem or _("nested too deeply")))
    return _pre(text, "idempotency-body", *notes)


def _binary(data: bytes) -> SafeString:
    return format_html("{} {}", len(data), _("bytes of binary data (not shown)"))


def _media(headers: Any) -> str:
    return content_type(headers).split(";")[0].strip().lower()


def _says_json(headers: Any) -> bool:
    media = _media(headers)
    return media == "application/json" or media.endswith("+json")


def _may_be_json(headers: Any) -> bool:
    return not _media(headers) or _says_json(headers)


def _indented(value: Any) -> str | None:
    try:
        return json.dumps(value, indent=2, ensure_ascii=False)
    except (RecursionError, ValueError):
        return None


def _pre(text: str, css_class: str, *notes: str) -> SafeString:
    """``text`` escaped in a ``<pre>``, cut to ``PREVIEW_CHARS``, then the notes."""
    if len(text) > PREVIEW_CHARS:
        notes = (
            _("first %(shown)s of %(total)s characters shown")
            % {"shown": PREVIEW_CHARS, "total": len(text)},
            *notes,
        )
        text = text[:PREVIEW_CHARS]
    # A lone surrogate (from a JSON escape) cannot be encoded into the page: show it escaped.
    shown = format_html('<pre class="{}">{}</pre>', css_class, _storable.storable_text(text))
    if not notes:
        return shown
    return format_html("{}{}", shown, format_html_join("", "<p>{}</p>", ((n,) for n in notes)))


# -- the recorded steps of a resumable record ------------------------------------------------

#: The steps listed on a record's page; past this many, how many more there are.
STEPS_SHOWN = 100
#: The characters of one step's result read from the database and shown.
STEP_PREVIEW_CHARS = 4096
# Indenting deeply nested JSON multiplies its size (each level adds to every line below
# it): past this factor of the original, the compact text is shown instead.
_INDENT_GROWTH = 4


def indented_json(text: str) -> str | None:
    """``text`` as indented JSON, or ``None`` when it is not JSON, is nested too deeply to
    parse, or would grow too much when indented."""
    value, problem = read_json(text)
    pretty = _indented(value) if problem is None else None
    if pretty is None or len(pretty) > _INDENT_GROWTH * max(len(text), 64):
        return None
    return pretty


class OctetLength(Func):
    """The size of a text column in bytes (UTF-8), on each database."""

    function = "OCTET_LENGTH"
    output_field = IntegerField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="LENGTH(CAST(%(expressions)s AS BLOB))", **extra
        )

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, function="LENGTH", **extra)


def _when(moment: datetime) -> str:
    # To the millisecond: the steps of one attempt are often recorded within a second.
    local = timezone.localtime(moment) if timezone.is_aware(moment) else moment
    return local.isoformat(sep=" ", timespec="milliseconds")


def _size(n: int) -> str:
    return ngettext("%(size)d byte", "%(size)d bytes", n) % {"size": n}


def _sealed_result_html(alias: str, pk: int) -> SafeString:
    # Read whole (a sealed result cannot be cut before it is opened), one step at a time,
    # then cut as a result in the clear is.
    stored = IdempotencyStep.objects.using(alias).filter(pk=pk).values_list("result", flat=True)
    try:
        text = crypto.open_step_result(str(stored.get()))
    except crypto.Unreadable as exc:
        return format_html("<em>{}</em>", _("Cannot be read (%(why)s).") % {"why": exc})
    except IdempotencyStep.DoesNotExist:  # deleted since the page read it
        return format_html("<em>{}</em>", _("no longer recorded"))
    return _result_html(text[: STEP_PREVIEW_CHARS + 1], len(text.encode()))


def _result_html(preview: str, size: int) -> SafeString:
    if len(preview) > STEP_PREVIEW_CHARS:
        shown = preview[:STEP_PREVIEW_CHARS]
        note = _("first %(shown)d characters of %(size)s shown") % {
            "shown": len(shown),
            "size": _size(size),
        }
        return _pre(shown, "idempotency-step", note)
    return _pre(indented_json(preview) or preview, "idempotency-step")


def has_steps(alias: str, record_id: int) -> bool:
    """Whether any step is recorded for the record (a record of another policy may have
    some: its operation was resumable when they were recorded)."""
    return bool(IdempotencyStep.objects.using(alias).filter(record_id=record_id).exists())


def render_steps(alias: str, record_id: int, show_results: bool) -> SafeString:
    """The recorded steps of a record, in the order they were recorded: a table of name,
    time and result (``show_results``: opened, when sealed) or the result's size (as
    stored).

    At most :data:`STEPS_SHOWN` steps, each result cut to :data:`STEP_PREVIEW_CHARS`
    characters in the query itself, so a record with many or large steps never makes the
    page large. Without ``show_results`` no result leaves the database, only its size.
    """
    steps = IdempotencyStep.objects.using(alias).filter(record_id=record_id)
    total = steps.count()
    if not total:
        return format_html("<em>{}</em>", _("no step recorded"))
    rows = steps.order_by("created_at", "pk").annotate(size=OctetLength(F("result")))
    if show_results:
        rows = rows.annotate(preview=Substr("result", 1, STEP_PREVIEW_CHARS + 1))
    shown = list(
        rows.values_list(
            "pk", "name", "created_at", "size", *(["preview"] if show_results else [])
        )[:STEPS_SHOWN]
    )

    def result(pk: int, size: int, *preview: str) -> SafeString | str:
        if not show_results:
            return _size(size)
        if crypto.step_sealed_with(preview[0]) is not None:
            return _sealed_result_html(alias, pk)
        return _result_html(preview[0], size)

    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (name, _when(created_at), result(pk, size, *rest))
            for pk, name, created_at, size, *rest in shown
        ),
    )
    table = format_html(
        '<table class="idempotency-steps"><thead><tr><th>{}</th><th>{}</th><th>{}</th></tr>'
        "</thead><tbody>{}</tbody></table>",
        _("step"),
        _("recorded at"),
        _("result") if show_results else _("result size"),
        body,
    )
    notes = []
    if total > len(shown):
        notes.append(
            _("The first %(shown)d of %(total)d steps are shown.")
            % {"shown": len(shown), "total": total}
        )
    if not show_results:
        notes.append(_("Step results are shown to users with the view_response_body permission."))
    if not notes:
        return table
    return format_html("{}<p><em>{}</em></p>", table, " ".join(notes))


def lease_state(record: IdempotencyRecord, now: datetime | None = None) -> str:
    """``live``/``stale`` with how long, for an in-progress record; ``-`` once it is done."""
    if record.status != states.IN_PROGRESS or record.lease_expires_at is None:
        return "-"
    now = now or timezone.now()
    if record.lease_expires_at > now:
        return str(
            _("live, %(left)s left") % {"left": timesince(now, record.lease_expires_at, depth=1)}
        )
    return str(_("stale for %(ago)s") % {"ago": timesince(record.lease_expires_at, now, depth=1)})


def whole(value: str) -> SafeString:
    """A changelist cell's text shown whole, broken across lines where it must be (an
    account or an operation: a cut one could read as another)."""
    return format_html('<span class="idempotency-whole">{}</span>', value)


def cut(value: str) -> SafeString:
    """A changelist cell's text that the stylesheet may cut short to fit its column, shown
    whole in its title (on hover, and to a screen reader)."""
    return format_html('<span class="idempotency-cut" title="{}">{}</span>', value, value)


def record_state(record: IdempotencyRecord, now: datetime | None = None) -> str:
    """The status in one cell: with the response's status once done, with the lease's state
    while in progress (``completed, 201``; ``in progress, live, 40 seconds left``)."""
    status = str(record.get_status_display())
    if record.status == states.IN_PROGRESS:
        lease = lease_state(record, now)
        return status if lease == "-" else f"{status}, {lease}"
    if record.response_status is None:
        return status
    return f"{status}, {record.response_status}"


def stored_response(record: IdempotencyRecord) -> tuple[Any, bytes | None] | crypto.Unreadable:
    """The record's stored headers (decoded JSON: anything, pairs when intact) and body,
    opened when sealed, or the :class:`~django_idempotency.crypto.Unreadable` that says why
    they cannot be. Read undecoded from the database (``stored_columns``), so no
    stored value stops the page; kept on the record: one page shows it in several fields."""
    cached = getattr(record, "_stored_response", None)
    if cached is None:
        stored = stored_columns(record, *RESPONSE_COLUMNS)
        headers, _problem = read_json(stored["response_headers"])
        body = stored["response_body"]
        try:
            cached = crypto.open_response(headers, body)
        except crypto.Unreadable as exc:  # a string is sealed, or damaged: as the claim sees it
            cached = exc
        record._stored_response = cached  # type: ignore[attr-defined]
    return cast("tuple[Any, bytes | None] | crypto.Unreadable", cached)


def encryption_state(record: IdempotencyRecord) -> str:
    """How the record's response is stored: in the clear, or sealed with which key."""
    if record.response_status is None:
        return "-"
    stored = stored_columns(record, *RESPONSE_COLUMNS)
    headers, _problem = read_json(stored["response_headers"])
    kid = crypto.sealed_with(headers)
    if kid is None:
        return str(_("not encrypted"))
    keys = app_settings.ENCRYPTION_KEYS
    ids = [crypto.key_id(key) for key in keys]
    if kid in ids[:1]:
        where = _("the first of ENCRYPTION_KEYS")
    elif kid in ids:
        where = _("in ENCRYPTION_KEYS, not the first: rotate_idempotency_encryption reseals it")
    else:
        where = _("not in ENCRYPTION_KEYS: it cannot be read")
    return str(_("sealed with key %(key)s (%(where)s)") % {"key": kid or "?", "where": where})


def with_response(
    record: IdempotencyRecord, show: Callable[[Any, bytes | None], SafeString]
) -> SafeString:
    opened = stored_response(record)
    if isinstance(opened, crypto.Unreadable):
        return unreadable_html(opened)
    return show(*opened)


def headers_html(record: IdempotencyRecord) -> SafeString:
    text = stored_columns(record, *RESPONSE_COLUMNS)["response_headers"]
    stored, _problem = read_json(text)
    if not crypto.sealed_with(stored):  # in the clear, or no sealed value at all: as stored
        return render_headers(text)
    opened = stored_response(record)
    if isinstance(opened, crypto.Unreadable):
        return unreadable_html(opened)
    return render_headers(json.dumps(opened[0]))  # as they were answered


def summary_html(headers: Any, body: bytes | None) -> SafeString:
    if body is None:
        return format_html("<em>{}</em>", _("no response stored"))
    return format_html(
        "{} · {}<br><em>{}</em>",
        ngettext("%(size)d byte", "%(size)d bytes", len(body)) % {"size": len(body)},
        content_type(headers) or _("no content type"),
        _("The body and headers are shown to users with the view_response_body permission."),
    )


def arguments_summary_html(size: int) -> SafeString:
    return format_html(
        "{}<br><em>{}</em>",
        ngettext("%(size)d byte", "%(size)d bytes", size) % {"size": size},
        _("The arguments are shown to users with the view_response_body permission."),
    )


def unreadable_html(exc: crypto.Unreadable) -> SafeString:
    return format_html(
        "<em>{}</em>",
        _(
            "Cannot be read (%(why)s). Its retries are refused (503, RecordUnreadable) "
            "until a key that opens it is configured again; it leaves at its expiry."
        )
        % {"why": exc},
    )


# Read only on the detail page, in one query, undecoded.
RESPONSE_COLUMNS = ("response_headers", "response_body")
