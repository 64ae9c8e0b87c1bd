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

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_idempotency import _display, _policies, _storable, _unique, maintenance, outbox
from django_idempotency._admin_filters import (
    ExpiredFilter,
    LeaseFilter,
    OperationFilter,
    ReadableFilter,
    TaskFilter,
    records_of,
)
from django_idempotency.conf import app_settings
from django_idempotency.models import (
    IdempotencyRecord,
    OutboxMessage,
    OutboxUniqueKey,
)

#: Who may see stored response bodies and headers (they can carry personal data).
VIEW_BODY_PERMISSION = "django_idempotency.view_response_body"


class _RecordsDatabase:
    """The ``_non_atomic_requests`` of a view (what ``transaction.non_atomic_requests``
    sets) naming the records' database, ``DATABASE`` as it is on each request.

    Under ``ATOMIC_REQUESTS`` the changelist's actions would otherwise run inside the
    request's transaction: every batch of *Purge expired records* a savepoint, every row it
    deleted locked until the page is answered. The maintenance jobs commit each batch and
    each record on their own, and refuse to run inside a caller's transaction; the
    changelist itself only reads.
    """

    def __contains__(self, alias: object) -> bool:
        return alias == app_settings.DATABASE

    def __iter__(self) -> Iterator[str]:
        return iter((app_settings.DATABASE,))


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

    #: The fields of the detail page that show stored data (bodies, headers, step results,
    #: task arguments), each with what takes its place (``None``: nothing) for a user
    #: without ``view_response_body``.
    stored_data_fields: dict[str, str | None] = {}

    def has_view_response_body_permission(self, request: HttpRequest) -> bool:
        """See stored data (bodies, headers, step results, task arguments):
        ``django_idempotency.view_response_body``."""
        return bool(request.user.has_perm(VIEW_BODY_PERMISSION))

    def shown_to(self, request: HttpRequest, fieldsets: list[Any]) -> list[Any]:
        """``fieldsets`` as ``request``'s user may see them: without ``view_response_body``,
        every field of :attr:`stored_data_fields` replaced by its summary."""
        if self.has_view_response_body_permission(request):
            return fieldsets
        hidden = self.stored_data_fields
        shown = []
        for name, options in fieldsets:
            fields = [hidden.get(f, f) if isinstance(f, str) else f for f in options["fields"]]
            shown.append((name, {**options, "fields": [f for f in fields if f is not None]}))
        return shown

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Every filter of the URL, ours and the admin's own, compares its value with a
        # column: one no column holds (a NUL, which PostgreSQL refuses in any text
        # parameter) would fail the page's query. Refused here: 400, on every database.
        if isinstance(value, str) and _storable.text_problem(value) is not None:
            return False
        allowed: bool = super().lookup_allowed(lookup, value, request)  # type: ignore[misc]
        return allowed


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[IdempotencyRecord]
else:  # ModelAdmin is generic only in the type stubs
    _ModelAdmin = admin.ModelAdmin


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdminMixin, _ModelAdmin):
    """View-only admin of :class:`IdempotencyRecord` with maintenance actions."""

    # Six columns that fit a 1280-pixel window beside the filters: the status with the
    # response's status or the lease's state; the key cut short to its column (whole in its
    # title), the account and the operation whole, broken across lines where they must be;
    # the age on one line. The stylesheet fixes the columns' widths.
    list_display = ("key_cell", "account_cell", "operation_cell", "state", "age", "expiry")
    list_display_links = ("key_cell",)
    # Only columns an index can sort: ordering a million rows by key, status or response
    # status takes about a second each.
    sortable_by = ("account_cell", "age", "expiry")
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

    # Without view_response_body, the body's size and content type take the place of the
    # stored headers and body, and the steps' result sizes that of their results.
    stored_data_fields = {
        "response_headers_pretty": None,
        "response_body_pretty": "response_summary",
        "steps_pretty": "steps_summary",
    }

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = list(super().get_fieldsets(request, obj))
        if obj is not None and (
            _policies.recovery_policy(obj.recovery_policy).resumable
            or _display.has_steps(app_settings.DATABASE, obj.pk)
        ):
            fieldsets.insert(2, (_("Steps"), {"fields": ("steps_pretty",)}))
        return self.shown_to(request, fieldsets)

    # -- queries ---------------------------------------------------------------------------

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        """The list and its actions, outside ``ATOMIC_REQUESTS``' transaction on the records'
        database (:class:`_RecordsDatabase`): the actions commit as they go."""
        return super().changelist_view(request, extra_context)

    # Read by Django's handler on each request, on the URL's view, which copies it from here.
    changelist_view._non_atomic_requests = _RecordsDatabase()  # type: ignore[attr-defined]

    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyRecord]:
        # Records live on the IDEMPOTENCY database, whatever the project's routers say.
        # Bodies can be a megabyte each, and headers anything another program wrote: only the
        # detail page reads them, undecoded (_display.stored_columns).
        return records_of(
            super()
            .get_queryset(request)
            .using(app_settings.DATABASE)
            .defer(*_display.RESPONSE_COLUMNS)
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
        # An account is stored by its hash where the table could not keep it apart as it is
        # (over 255 characters, ending in whitespace, spelling a hash): searched as stored.
        accounts = {term, _storable.storable_name(term), _storable.storable_name(search_term)}
        return queryset.filter(key=term) | queryset.filter(account__in=accounts), False

    class Media:
        css = {"all": ("django_idempotency/admin.css",)}

    # -- columns and fields ---------------------------------------------------------------

    @admin.display(description=_("key"))
    def key_cell(self, record: IdempotencyRecord) -> SafeString:
        """The key, cut short to its column in the list, whole in its title."""
        return _display.cut(record.key)

    @admin.display(description=_("account"), ordering="account")
    def account_cell(self, record: IdempotencyRecord) -> SafeString:
        """The account, whole, broken across lines where its column needs it."""
        return _display.whole(record.account)

    @admin.display(description=_("operation"))
    def operation_cell(self, record: IdempotencyRecord) -> SafeString:
        """The operation, whole, broken across lines where its column needs it."""
        return _display.whole(record.operation)

    @admin.display(description=_("status"))
    def state(self, record: IdempotencyRecord) -> str:
        """The status, with the response's status once done, the lease's while in progress."""
        return _display.record_state(record)

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
        return _display.lease_state(record)

    @admin.display(description=_("encryption"))
    def encryption(self, record: IdempotencyRecord) -> str:
        """Whether the stored response is sealed, and with which key (by its id)."""
        return _display.encryption_state(record)

    @admin.display(description=_("response headers"))
    def response_headers_pretty(self, record: IdempotencyRecord) -> SafeString:
        """The stored headers, one per line (or as stored, when they are not pairs)."""
        return _display.headers_html(record)

    @admin.display(description=_("response body"))
    def response_body_pretty(self, record: IdempotencyRecord) -> SafeString:
        """The stored body: indented JSON, escaped text, or a size for binary data."""
        return _display.with_response(
            record, lambda headers, body: _display.render_body(body, headers)
        )

    @admin.display(description=_("response body"))
    def response_summary(self, record: IdempotencyRecord) -> SafeString:
        """The body's size and content type, for users who may not see the body."""
        return _display.with_response(record, _display.summary_html)

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
    search_fields = ("=id", "=task", "=unique_key__key")
    search_help_text = _("An exact message id, task name or unique key.")
    actions = ("requeue",)
    readonly_fields = ("args_pretty", "kwargs_pretty", "arguments_summary", "unique_key_held")
    # Task arguments are the customers' data as stored bodies are: without
    # view_response_body, their size takes their place.
    stored_data_fields = {"args_pretty": "arguments_summary", "kwargs_pretty": None}
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "task",
                    "status",
                    "args_pretty",
                    "kwargs_pretty",
                    "unique_key_held",
                )
            },
        ),
        (
            _("Sending"),
            {
                "fields": (
                    "attempts",
                    "last_error",
                    "created_at",
                    "available_at",
                    "sent_at",
                    "run_reported",
                )
            },
        ),
    )

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """Requeue dead messages: the model's ``change`` permission, never used for edits."""
        return self._has_model_perm(request, "change")

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.shown_to(request, list(super().get_fieldsets(request, obj)))

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

    @admin.display(description=_("arguments"))
    def arguments_summary(self, message: OutboxMessage) -> SafeString:
        """The arguments' size as stored, for users who may not see them."""
        stored = _display.stored_columns(message, *_ARGUMENT_COLUMNS).values()
        return _display.arguments_summary_html(sum(len((text or "").encode()) for text in stored))

    @admin.display(description=_("unique key"))
    def unique_key_held(self, message: OutboxMessage) -> str:
        """The key of ``enqueue_once`` this message holds, and whether it still holds it."""
        holder = (
            OutboxUniqueKey.objects.using(app_settings.DATABASE)
            .filter(message_id=message.pk)
            .first()
        )
        if holder is None:
            return "-"
        return _key_state(holder)

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


def _held(holder: OutboxUniqueKey) -> str:
    live = _unique.holds(app_settings.DATABASE, holder, timezone.now())
    return str(_("held (live)") if live else _("free (its message is no longer live)"))


def _key_state(holder: OutboxUniqueKey) -> str:
    return f"{holder.key} ({holder.unique_until}): {_held(holder)}"


if TYPE_CHECKING:
    _KeyAdmin = admin.ModelAdmin[OutboxUniqueKey]
else:
    _KeyAdmin = admin.ModelAdmin


@admin.register(OutboxUniqueKey)
class OutboxUniqueKeyAdmin(ReadOnlyAdminMixin, _KeyAdmin):
    """View-only: which message holds each key of ``outbox.enqueue_once``, and whether it
    is still live (a key whose message is not is taken by the next enqueue)."""

    list_display = ("task", "key", "message_link", "unique_until", "held", "created_at")
    list_filter = ("unique_until",)
    search_fields = ("=key", "=task", "=message__id")
    search_help_text = _("An exact key, task name or message id.")
    fields = (
        "task",
        "key",
        "message_link",
        "unique_until",
        "held",
        "held_until",
        "started_at",
        "lease_expires_at",
        "finished_at",
        "run_id",
        "created_at",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxUniqueKey]:
        return super().get_queryset(request).using(app_settings.DATABASE)

    @admin.display(description=_("message"))
    def message_link(self, holder: OutboxUniqueKey) -> SafeString:
        """The message that holds (or last held) the key, linked to its page."""
        from django.urls import reverse
        from django.utils.html import format_html

        url = reverse("admin:django_idempotency_outboxmessage_change", args=[holder.message_id])
        return format_html('<a href="{}">{}</a>', url, holder.message_id)

    @admin.display(description=_("held"))
    def held(self, holder: OutboxUniqueKey) -> str:
        """Whether the message still holds the key (it is live), as enqueue_once decides."""
        return _held(holder)
