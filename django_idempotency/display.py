"""Stored data made fit to show, whatever it holds: response bodies, headers and JSON.

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
from typing import Any

from django.db import models
from django.db.models.functions import Cast
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from django_idempotency import storable

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
        return storable.read_json(text), None
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
    shown = format_html('<pre class="{}">{}</pre>', css_class, storable.storable_text(text))
    if not notes:
        return shown
    return format_html("{}{}", shown, format_html_join("", "<p>{}</p>", ((n,) for n in notes)))
