"""Stored JSON and the recorded steps of a resumable record, as the admin shows them.

What the admin reads was written by views and steps that may echo anything a client sent:
JSON nested past Python's recursion limit, lone surrogates, megabytes of text. Every
function here shows such data bounded and escaped, and never fails on it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.db.models import F, Func, IntegerField
from django.db.models.functions import Substr
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_idempotency.models import IdempotencyStep

#: The steps listed on a record's page; past this many, how many more there are.
STEPS_SHOWN = 100
#: The characters of one step's result read from the database and shown.
STEP_PREVIEW_CHARS = 4096
# Indenting deeply nested JSON multiplies its size (each level adds to every line below
# it): past this factor of the original, the compact text is shown instead.
_INDENT_GROWTH = 4


def indented_json(text: str) -> str | None:
    """``text`` as indented JSON, or ``None`` when it is not JSON, is nested too deeply to
    parse, or would grow too much when indented.

    Non-ASCII characters are shown as themselves, unless the text holds a lone surrogate
    (``"\\ud800"``), which cannot be sent as UTF-8: then they stay escaped.
    """
    try:
        value = json.loads(text)
        pretty = json.dumps(value, indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    if len(pretty) > _INDENT_GROWTH * max(len(text), 64):
        return None
    try:
        pretty.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, indent=2)
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


def _result_html(preview: str, size: int) -> SafeString:
    if len(preview) > STEP_PREVIEW_CHARS:
        shown = preview[:STEP_PREVIEW_CHARS]
        note = _("first %(shown)d characters of %(size)s shown") % {
            "shown": len(shown),
            "size": _size(size),
        }
        return format_html('<pre class="idempotency-step">{}</pre><p>{}</p>', shown, note)
    return format_html('<pre class="idempotency-step">{}</pre>', indented_json(preview) or preview)


def has_steps(alias: str, record_id: int) -> bool:
    """Whether any step is recorded for the record (a record of another policy may have
    some: its operation was resumable when they were recorded)."""
    return bool(IdempotencyStep.objects.using(alias).filter(record_id=record_id).exists())


def render_steps(alias: str, record_id: int, show_results: bool) -> SafeString:
    """The recorded steps of a record, in the order they were recorded: a table of name,
    time and result (``show_results``) or the result's size.

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
        rows.values_list("name", "created_at", "size", *(["preview"] if show_results else []))[
            :STEPS_SHOWN
        ]
    )
    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (
                name,
                _when(created_at),
                _result_html(rest[0], size) if show_results else _size(size),
            )
            for name, created_at, size, *rest in shown
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
