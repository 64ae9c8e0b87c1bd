"""A read-only admin for inspecting idempotency records, with a few maintenance actions.

Nobody adds, edits or deletes a single record here: a record belongs to the request that
claimed it, and hand edits would break the guarantees the engine gives. What an operator
may do goes through :mod:`django_idempotency.maintenance`, the same code the management
commands and the Celery tasks run:

- *Release stale claims* and *Mark as failed* need the model's ``change`` permission;
- *Purge expired records* needs its ``delete`` permission.

A stored response's body and headers are shown only to users with the permission
``django_idempotency.view_response_body`` (a superuser has it); others see the body's size
and content type. Responses sealed with ``ENCRYPTION_KEYS`` are shown opened. The page of a
resumable record (recovery policy ``"resume"``) lists its recorded steps: each one's name and
time, and its result under the same permission (others see its size). *Release stale
claims* leaves resumable records alone (it would delete their steps, which would then run
again); *Mark as failed* closes them like any other.

The changelist is built for tables of millions of rows: every filter is served by an
index, the full count is never taken, and the list never loads stored response bodies.

Every record and every outbox message renders, whatever its stored body, headers or
arguments hold: they are read as stored and shown through :mod:`django_idempotency._display`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_idempotency import _display, _stats, crypto, maintenance, outbox, states
from django_idempotency._recovery import RESUME
from django_idempotency.conf import app_settings
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxStatus,
    RecordStatus,
    expired_q,
)

#: Who may see stored response bodies and headers (they can carry personal data).
VIEW_BODY_PERMISSION = "django_idempotency.view_response_body"


def _qs(queryset: Any) -> QuerySet[IdempotencyRecord]:
    # The stubs type a filtered QuerySet[Any] as Any; this names what it is.
    return cast("QuerySet[IdempotencyRecord]", queryset)


class OperationFilter(admin.SimpleListFilter):
    """Filter by operation; the choices are read through an index, bounded in number."""

    title = _("operation")
    parameter_name = "operation"
    # The choices are computed on every changelist view; past this many the list is cut
    # (a name can still be filtered on through the URL or the search box).
    max_choices = 100

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = _stats.operations(limit=self.max_choices)
        current = self.value()
        if current and current not in names:
            names.append(current)
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        return _qs(queryset.filter(operation=value)) if value else None


class ExpiredFilter(admin.SimpleListFilter):
    """What the purge would delete now: past ``expires_at`` and not held by a live lease."""

    title = _("expired")
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Expired, not yet purged")), ("no", _("Not expired"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return _qs(queryset.filter(expired_q(timezone.now())))
        if self.value() == "no":
            return _qs(queryset.exclude(expired_q(timezone.now())))
        return None


class LeaseFilter(admin.SimpleListFilter):
    """In-progress records whose lease is still running, or has run out (stale)."""

    title = _("lease")
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("live", _("Live lease")), ("stale", _("Stale lease"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        now = timezone.now()
        in_progress = queryset.filter(status=RecordStatus.IN_PROGRESS)
        if self.value() == "live":
            return _qs(in_progress.filter(lease_expires_at__gt=now))
        if self.value() == "stale":
            return _qs(in_progress.filter(lease_expires_at__lte=now))
        return None


class ReadableFilter(admin.SimpleListFilter):
    """Completed and failed records whose stored outcome no key of ``ENCRYPTION_KEYS`` opens:
    their retries are refused until the key that sealed them is configured again. (A token
    damaged under a configured key is found only when read: its page says so.)"""

    title = _("outcome readable")
    parameter_name = "readable"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("no", _("No: sealed with a key not in ENCRYPTION_KEYS"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "no":
            return _qs(crypto.unopenable(queryset.exclude(status=RecordStatus.IN_PROGRESS)))
        return None


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


def stored_response(record: IdempotencyRecord) -> tuple[Any, bytes | None] | crypto.Unreadable:
    """The record's stored headers (decoded JSON: anything, pairs when intact) and body,
    opened when sealed, or the :class:`~django_idempotency.crypto.Unreadable` that says why
    they cannot be. Read undecoded from the database (``_display.stored_columns``), so no
    stored value stops the page; kept on the record: one page shows it in several fields."""
    cached = getattr(record, "_stored_response", None)
    if cached is None:
        stored = _display.stored_columns(record, *_RESPONSE_COLUMNS)
        headers, _problem = _display.read_json(stored["response_headers"])
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
    stored = _display.stored_columns(record, *_RESPONSE_COLUMNS)
    headers, _problem = _display.read_json(stored["response_headers"])
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


def _with_response(
    record: IdempotencyRecord, show: Callable[[Any, bytes | None], SafeString]
) -> SafeString:
    opened = stored_response(record)
    if isinstance(opened, crypto.Unreadable):
        return _unreadable(opened)
    return show(*opened)


def _headers_html(record: IdempotencyRecord) -> SafeString:
    text = _display.stored_columns(record, *_RESPONSE_COLUMNS)["response_headers"]
    stored, _problem = _display.read_json(text)
    if not crypto.sealed_with(stored):  # in the clear, or no sealed value at all: as stored
        return _display.render_headers(text)
    opened = stored_response(record)
    if isinstance(opened, crypto.Unreadable):
        return _unreadable(opened)
    return _display.render_headers(json.dumps(opened[0]))  # as they were answered


def _summary_html(headers: Any, body: bytes | None) -> SafeString:
    if body is None:
        return format_html("<em>{}</em>", _("no response stored"))
    return format_html(
        "{} · {}<br><em>{}</em>",
        ngettext("%(size)d byte", "%(size)d bytes", len(body)) % {"size": len(body)},
        _display.content_type(headers) or _("no content type"),
        _("The body and headers are shown to users with the view_response_body permission."),
    )


def _unreadable(exc: crypto.Unreadable) -> SafeString:
    return format_html(
        "<em>{}</em>",
        _(
            "Cannot be read (%(why)s). Its retries are refused (503, RecordUnreadable) "
            "until a key that opens it is configured again; it leaves at its expiry."
        )
        % {"why": exc},
    )


class ReadOnlyAdminMixin:
    """No add, change or delete: the maintenance actions check model permissions instead.

    Also what both tables need as they grow large: newest first, never counted in full.
    """

    opts: Any
    ordering: Any = ("-created_at",)
    # Counting a million rows on every page view is what makes big changelists slow.
    show_full_result_count = False
    # Facet counts run one COUNT per filter choice over the table: never on these.
    show_facets = admin.ShowFacets.NEVER

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def _has_model_perm(self, request: HttpRequest, action: str) -> bool:
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}")


# Read only on the detail page, in one query, undecoded.
_RESPONSE_COLUMNS = ("response_headers", "response_body")

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[IdempotencyRecord]
else:  # ModelAdmin is generic only in the type stubs
    _ModelAdmin = admin.ModelAdmin


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdminMixin, _ModelAdmin):
    """View-only admin of :class:`IdempotencyRecord` with maintenance actions."""

    list_display = (
        "key",
        "account",
        "operation",
        "status",
        "response_status",
        "age",
        "expiry",
        "lease",
    )
    list_display_links = ("key",)
    # Only columns an index can sort: ordering a million rows by key, status or response
    # status takes about a second each.
    sortable_by = ("account", "age", "expiry")
    list_filter = ("status", OperationFilter, ExpiredFilter, LeaseFilter, ReadableFilter)
    date_hierarchy = "created_at"
    search_fields = ("key", "account")
    search_help_text = _("An exact key or account, e.g. user:42.")
    actions = ("release_stale_claims", "mark_as_failed", "purge_expired_records")
    # Each click purges at most this many batches of PURGE_BATCH_SIZE rows, so the request
    # stays short; the purge command or task handles any backlog.
    purge_max_batches = 20

    readonly_fields = (
        "lease",
        "age",
        "encryption",
        "response_headers_pretty",
        "response_body_pretty",
        "response_summary",
        "steps_pretty",
        "steps_summary",
    )
    fieldsets = (
        (None, {"fields": ("account", "operation", "key", "status")}),
        (
            _("Response"),
            {
                "fields": (
                    "response_status",
                    "encryption",
                    "response_headers_pretty",
                    "response_body_pretty",
                )
            },
        ),
        (
            _("Lease"),
            {
                "fields": (
                    "lease",
                    "lease_expires_at",
                    "lease_token",
                    "recovery_policy",
                    "recovery_attempts",
                )
            },
        ),
        (_("Times"), {"fields": ("created_at", "age", "completed_at", "expires_at")}),
        (_("Fingerprint"), {"fields": ("request_hash", "fingerprint_version")}),
    )

    # -- permissions: view, plus the maintenance actions ----------------------------------

    def has_maintain_permission(self, request: HttpRequest) -> bool:
        """Release and mark failed: the model's ``change`` permission, never used for edits."""
        return self._has_model_perm(request, "change")

    def has_purge_permission(self, request: HttpRequest) -> bool:
        """Purge expired records: the model's ``delete`` permission."""
        return self._has_model_perm(request, "delete")

    def has_view_response_body_permission(self, request: HttpRequest) -> bool:
        """See stored bodies and headers: ``django_idempotency.view_response_body``."""
        return bool(request.user.has_perm(VIEW_BODY_PERMISSION))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        # Without the permission, the body's size and content type take the place of the
        # stored headers and body, and the steps' result sizes that of their results.
        fieldsets = list(super().get_fieldsets(request, obj))
        if obj is not None and (
            obj.recovery_policy == RESUME or _display.has_steps(app_settings.DATABASE, obj.pk)
        ):
            fieldsets.insert(2, (_("Steps"), {"fields": ("steps_pretty",)}))
        if self.has_view_response_body_permission(request):
            return fieldsets
        hidden = {
            "response_headers_pretty": None,
            "response_body_pretty": "response_summary",
            "steps_pretty": "steps_summary",
        }
        shown = []
        for name, options in fieldsets:
            fields = [hidden.get(f, f) if isinstance(f, str) else f for f in options["fields"]]
            shown.append((name, {**options, "fields": [f for f in fields if f is not None]}))
        return shown

    # -- queries ---------------------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyRecord]:
        # Records live on the IDEMPOTENCY database, whatever the project's routers say.
        # Bodies can be a megabyte each, and headers anything another program wrote: only the
        # detail page reads them, undecoded (_display.stored_columns).
        return _qs(
            super().get_queryset(request).using(app_settings.DATABASE).defer(*_RESPONSE_COLUMNS)
        )

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        # Expired records are the oldest ones: listing them newest-created first would walk
        # the created_at index through every live record. By expiry, most recent first, the
        # expires_at index finds them at once (and the order is nearly the same).
        if request.GET.get(ExpiredFilter.parameter_name) == "yes":
            return ("-expires_at",)
        return tuple(self.ordering or ())

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord], search_term: str
    ) -> tuple[QuerySet[IdempotencyRecord], bool]:
        # Exact matches only: keys are case-sensitive, and a substring search would read
        # every row of a big table.
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(key=term) | queryset.filter(account=term), False

    # -- columns and fields ---------------------------------------------------------------

    @admin.display(description=_("age"), ordering="-created_at")
    def age(self, record: IdempotencyRecord) -> str:
        """Time since the claim."""
        return timesince(record.created_at, depth=1)

    @admin.display(description=_("expiry"), ordering="expires_at")
    def expiry(self, record: IdempotencyRecord) -> str:
        """When the record stops deduplicating, relative to now."""
        now = timezone.now()
        if record.expires_at <= now:
            return str(
                _("expired %(ago)s ago") % {"ago": timesince(record.expires_at, now, depth=1)}
            )
        return str(_("in %(left)s") % {"left": timesince(now, record.expires_at, depth=1)})

    @admin.display(description=_("lease"))
    def lease(self, record: IdempotencyRecord) -> str:
        """Live or stale, for in-progress records."""
        return lease_state(record)

    @admin.display(description=_("encryption"))
    def encryption(self, record: IdempotencyRecord) -> str:
        """Whether the stored response is sealed, and with which key (by its id)."""
        return encryption_state(record)

    @admin.display(description=_("response headers"))
    def response_headers_pretty(self, record: IdempotencyRecord) -> SafeString:
        """The stored headers, one per line (or as stored, when they are not pairs)."""
        return _headers_html(record)

    @admin.display(description=_("response body"))
    def response_body_pretty(self, record: IdempotencyRecord) -> SafeString:
        """The stored body: indented JSON, escaped text, or a size for binary data."""
        return _with_response(record, lambda headers, body: _display.render_body(body, headers))

    @admin.display(description=_("response body"))
    def response_summary(self, record: IdempotencyRecord) -> SafeString:
        """The body's size and content type, for users who may not see the body."""
        return _with_response(record, _summary_html)

    @admin.display(description=_("recorded steps"))
    def steps_pretty(self, record: IdempotencyRecord) -> SafeString:
        """The steps of a resumable record: name, when, and the result, bounded."""
        return _display.render_steps(app_settings.DATABASE, record.pk, show_results=True)

    @admin.display(description=_("recorded steps"))
    def steps_summary(self, record: IdempotencyRecord) -> SafeString:
        """The steps' names and times, and their results' sizes, for users who may not see
        stored results."""
        return _display.render_steps(app_settings.DATABASE, record.pk, show_results=False)

    # -- actions: all through the maintenance module --------------------------------------

    @admin.action(permissions=["maintain"], description=_("Release stale claims"))
    def release_stale_claims(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
    ) -> None:
        """Delete the selected in-progress records whose lease ran out, so a retry runs.

        Resumable records (recovery policy ``"resume"``) are left alone, with a message:
        releasing one would delete its recorded steps, and its next attempt would run them
        again. Their next attempt resumes them; *Mark as failed* closes them.
        """
        selected = queryset.count()
        resumable = maintenance.resumable_stale(queryset)
        released = maintenance.release_stale(queryset)
        self._report(request, released, selected, _("released"), resumable=resumable)
        if resumable:
            self.message_user(
                request,
                ngettext(
                    "%(count)d selected record is resumable and was not released: releasing "
                    "it would delete its recorded steps, and they would run again. Its next "
                    "attempt resumes it; Mark as failed closes it.",
                    "%(count)d selected records are resumable and were not released: "
                    "releasing them would delete their recorded steps, and they would run "
                    "again. Their next attempt resumes them; Mark as failed closes them.",
                    resumable,
                )
                % {"count": resumable},
                messages.WARNING,
            )

    @admin.action(permissions=["maintain"], description=_("Mark as failed"))
    def mark_as_failed(self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]) -> None:
        """Close the selected stale claims with an "outcome unknown" answer, never run again."""
        selected = queryset.count()
        failed = maintenance.mark_failed(queryset)
        self._report(request, failed, selected, _("marked as failed"))

    @admin.action(
        permissions=["purge"],
        description=_("Purge expired records (all of them, not only the selected)"),
    )
    def purge_expired_records(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
    ) -> None:
        """Delete expired records in bounded batches; the selection only starts the action."""
        result = maintenance.purge_expired(
            using=app_settings.DATABASE, max_batches=self.purge_max_batches
        )
        message = ngettext(
            "Purged %(count)d expired record.",
            "Purged %(count)d expired records.",
            result.deleted,
        ) % {"count": result.deleted}
        if result.audit_deleted:
            message += " " + ngettext(
                "Purged %(count)d audit record past its retention.",
                "Purged %(count)d audit records past their retention.",
                result.audit_deleted,
            ) % {"count": result.audit_deleted}
        if not result.complete:
            message += " " + str(
                _("More may remain: run manage.py purge_idempotency or the purge task.")
            )
        self.message_user(request, message, messages.SUCCESS)

    def _report(
        self, request: HttpRequest, done: int, selected: int, verb: Any, resumable: int = 0
    ) -> None:
        # Resumable records left alone get a message of their own.
        skipped = selected - done - resumable
        message = _("%(done)d of %(selected)d selected records %(verb)s.") % {
            "done": done,
            "selected": selected,
            "verb": verb,
        }
        if skipped:
            message += " " + str(
                _("The others were not in progress with a stale lease, and were left alone.")
            )
        self.message_user(request, message, messages.SUCCESS if done else messages.WARNING)


class TaskFilter(admin.SimpleListFilter):
    """Filter by task. The choices are the tasks of pending and dead messages (what an
    operator looks for, few and found through the status index), plus the chosen one; any
    task can be filtered on through the URL."""

    title = _("task")
    parameter_name = "task"
    max_choices = 100

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        waiting = OutboxMessage.objects.using(app_settings.DATABASE).filter(
            status__in=[OutboxStatus.PENDING, OutboxStatus.DEAD]
        )
        names = sorted(set(waiting.values_list("task", flat=True)[: self.max_choices * 10]))
        names = names[: self.max_choices]
        current = self.value()
        if current and current not in names:
            names.append(current)
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        return queryset.filter(task=self.value()) if self.value() else queryset


_ARGUMENT_COLUMNS = ("args", "kwargs")

if TYPE_CHECKING:
    _OutboxAdmin = admin.ModelAdmin[OutboxMessage]
else:
    _OutboxAdmin = admin.ModelAdmin


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdminMixin, _OutboxAdmin):
    """View-only admin of the outbox, with a "requeue" action for dead messages.

    Requeueing needs the model's ``change`` permission, which allows no edit here.
    """

    list_display = ("id", "task", "status", "attempts", "created_at", "available_at", "sent_at")
    list_filter = ("status", TaskFilter)
    search_fields = ("=id", "=task")
    search_help_text = _("An exact message id or task name.")
    actions = ("requeue",)
    readonly_fields = ("args_pretty", "kwargs_pretty")
    fieldsets = (
        (None, {"fields": ("id", "task", "status", "args_pretty", "kwargs_pretty")}),
        (
            _("Sending"),
            {"fields": ("attempts", "last_error", "created_at", "available_at", "sent_at")},
        ),
    )

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """Requeue dead messages: the model's ``change`` permission, never used for edits."""
        return self._has_model_perm(request, "change")

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxMessage]:
        # Messages live on the IDEMPOTENCY database, whatever the project's routers say. The
        # arguments are read only on the detail page, undecoded (_display.stored_columns).
        return super().get_queryset(request).using(app_settings.DATABASE).defer(*_ARGUMENT_COLUMNS)

    @admin.display(description=_("args"))
    def args_pretty(self, message: OutboxMessage) -> SafeString:
        """The positional arguments, as indented JSON (or as stored)."""
        return _display.render_json(_display.stored_columns(message, *_ARGUMENT_COLUMNS)["args"])

    @admin.display(description=_("kwargs"))
    def kwargs_pretty(self, message: OutboxMessage) -> SafeString:
        """The keyword arguments, as indented JSON (or as stored)."""
        return _display.render_json(_display.stored_columns(message, *_ARGUMENT_COLUMNS)["kwargs"])

    @admin.action(permissions=["requeue"], description=_("Requeue dead messages"))
    def requeue(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """Make the selected dead messages pending again: due now, attempts back to 0."""
        selected = queryset.count()
        done = outbox.requeue(queryset)
        message = _("%(done)d of %(selected)d selected messages requeued.") % {
            "done": done,
            "selected": selected,
        }
        if done < selected:
            message += " " + str(_("The others were not dead, and were left alone."))
        self.message_user(request, message, messages.SUCCESS if done else messages.WARNING)
