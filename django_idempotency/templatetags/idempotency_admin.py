"""Template tags of the idempotency records admin.

``idempotency_date_hierarchy`` replaces Django's ``date_hierarchy`` tag on the records
changelist. Django's tag finds the years, months or days that hold rows with a
``SELECT DISTINCT`` over every row that matches the filters, which takes most of a second
on a million rows. This one reads only the oldest and newest ``created_at`` of the whole
table (two probes of its index) and offers every year, month or day in that range: a day
without matching rows just shows an empty list.
"""

from __future__ import annotations

import calendar
import datetime
from typing import Any

from django import template
from django.db.models import Max, Min
from django.utils import formats, timezone
from django.utils.text import capfirst
from django.utils.translation import gettext as _

register = template.Library()


def _local(value: datetime.datetime) -> datetime.date:
    return (timezone.localtime(value) if timezone.is_aware(value) else value).date()


def _days(first: datetime.date, last: datetime.date, year: int, month: int) -> list[datetime.date]:
    start = max(first, datetime.date(year, month, 1))
    end = min(last, datetime.date(year, month, calendar.monthrange(year, month)[1]))
    return [start + datetime.timedelta(days=n) for n in range((end - start).days + 1)]


def _months(first: datetime.date, last: datetime.date, year: int) -> list[datetime.date]:
    return [
        datetime.date(year, month, 1)
        for month in range(1, 13)
        if (first.year, first.month) <= (year, month) <= (last.year, last.month)
    ]


@register.inclusion_tag("admin/date_hierarchy.html")
def idempotency_date_hierarchy(cl: Any) -> dict[str, Any]:
    """The date drill-down of the changelist ``cl``, from the table's date range only."""
    name = cl.date_hierarchy
    year_field, month_field, day_field = (f"{name}__{part}" for part in ("year", "month", "day"))
    year, month, day = (cl.params.get(f) for f in (year_field, month_field, day_field))

    def link(filters: dict[str, Any]) -> str:
        return str(cl.get_query_string(filters, [f"{name}__"]))

    bounds = cl.root_queryset.order_by().aggregate(first=Min(name), last=Max(name))
    if bounds["first"] is None or bounds["last"] is None:
        return {"show": False}
    first, last = _local(bounds["first"]), _local(bounds["last"])
    if not (year or month or day) and first.year == last.year:
        year = first.year
        if first.month == last.month:
            month = first.month
    try:
        if year and month and day:
            chosen = datetime.date(int(year), int(month), int(day))
            return {
                "show": True,
                "back": {
                    "link": link({year_field: year, month_field: month}),
                    "title": capfirst(formats.date_format(chosen, "YEAR_MONTH_FORMAT")),
                },
                "choices": [{"title": capfirst(formats.date_format(chosen, "MONTH_DAY_FORMAT"))}],
            }
        if year and month:
            return {
                "show": True,
                "back": {"link": link({year_field: year}), "title": str(year)},
                "choices": [
                    {
                        "link": link({year_field: year, month_field: month, day_field: d.day}),
                        "title": capfirst(formats.date_format(d, "MONTH_DAY_FORMAT")),
                    }
                    for d in _days(first, last, int(year), int(month))
                ],
            }
        if year:
            return {
                "show": True,
                "back": {"link": link({}), "title": _("All dates")},
                "choices": [
                    {
                        "link": link({year_field: year, month_field: m.month}),
                        "title": capfirst(formats.date_format(m, "YEAR_MONTH_FORMAT")),
                    }
                    for m in _months(first, last, int(year))
                ],
            }
    except (TypeError, ValueError):  # a hand-edited URL; Django's changelist rejects it too
        return {"show": False}
    return {
        "show": True,
        "back": None,
        "choices": [
            {"link": link({year_field: str(y)}), "title": str(y)}
            for y in range(first.year, last.year + 1)
        ],
    }
