"""The record that stores one claimed idempotency key and, once done, its response."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any, cast

from django.db import connections, models
from django.db.models import Value
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency import _policies, _purge, states
from django_idempotency._purge import PURGED
from django_idempotency.conf import app_settings
from django_idempotency.states import expired_q, stale_q

__all__ = [
    "ARCHIVE_REASONS",
    "PURGED",
    "REPLACED",
    "IdempotencyAuditRecord",
    "IdempotencyRecord",
    "IdempotencyRecordQuerySet",
    "OutboxUniqueKey",
    "RecordStatus",
    "column",
    "expired_q",
    "stale_q",
]


class RecordStatus(models.TextChoices):
    """Where a record stands in its state machine (:mod:`django_idempotency.states`)."""

    IN_PROGRESS = states.IN_PROGRESS, _("in progress")
    COMPLETED = states.COMPLETED, _("completed")
    FAILED = states.FAILED, _("failed")


# Why a record left the deduplication window and was copied to the audit trail.
REPLACED = "replaced"
ARCHIVE_REASONS = [(PURGED, _("purged")), (REPLACED, _("replaced by a new request"))]


def column(model: type[models.Model], name: str) -> str:
    """The database column of one of ``model``'s concrete fields."""
    field = model._meta.get_field(name)
    assert isinstance(field, models.Field)
    return str(field.column)


class IdempotencyRecordQuerySet(models.QuerySet["IdempotencyRecord"]):
    """Selections that the engine, the maintenance jobs and the admin share."""

    def expired(self, now: datetime) -> IdempotencyRecordQuerySet:
        """Records the purge may delete at ``now`` (see :func:`expired_q`)."""
        return self.filter(expired_q(now))

    def stale(self, now: datetime) -> IdempotencyRecordQuerySet:
        """Records the recovery job handles at ``now`` (see :func:`stale_q`)."""
        return self.filter(stale_q(now))

    def archive(self, reason: str, *, now: datetime, lock: bool = False) -> int:
        """Copy these records to the audit trail in one ``INSERT ... SELECT``.

        The rows never travel through Python, so a batch of large stored bodies costs no
        memory here. ``lock``: take row locks (``FOR UPDATE``) so the rows cannot change
        before the caller deletes or replaces them in the same transaction.
        """
        sources = [source for _target, source in IdempotencyAuditRecord.copied_columns()]
        selection = self.annotate(
            _archived_at=Value(now, output_field=models.DateTimeField()),
            _reason=Value(reason, output_field=models.CharField()),
        ).values_list(*sources, "_archived_at", "_reason")
        if lock:
            selection = selection.select_for_update()
        select_sql, params = selection.query.get_compiler(self.db).as_sql()
        connection = connections[self.db]
        with connection.cursor() as cursor:
            cursor.execute(f"{IdempotencyAuditRecord.insert_sql(connection)} {select_sql}", params)
            return max(int(cursor.rowcount), 0)

    def archive_expired(self, account: str, operation: str, key: str, *, now: datetime) -> int:
        """Before a claim replaces an expired record: copy it to the audit trail.

        Does nothing unless ``IDEMPOTENCY["AUDIT"]`` is on. Call it inside the claim's
        transaction, just before the statement that replaces the record: the copy locks the
        expired row, so a concurrent claim of the same key waits for this transaction and
        then no longer finds it expired (a locking read sees the newest committed row); the
        record is copied exactly once.
        """
        if not app_settings.AUDIT:
            return 0
        identity = self.filter(account=account, operation=operation, key=key)
        return identity.expired(now).archive(REPLACED, now=now, lock=True)

    def delete_expired(
        self,
        *,
        batch_size: int | None = None,
        max_batches: int | None = None,
        dry_run: bool = False,
        now: datetime | None = None,
        progress: _purge.Progress | None = None,
    ) -> _purge.PurgeResult:
        """Delete, on this queryset's database and in bounded batches: these records once
        expired (copied to the audit trail first when ``AUDIT`` is on), audit records past
        ``AUDIT_RETENTION`` and sent outbox messages past ``OUTBOX_RETENTION``.

        The purge of the ``purge_idempotency`` command, the Celery task and the admin action;
        its batches are described in :func:`django_idempotency._purge.purge`.
        """
        now = now or timezone.now()
        alias = self.db
        archive = None
        if app_settings.AUDIT:
            archive = _purge.Archive(
                copy=lambda batch: cast(IdempotencyRecordQuerySet, batch).archive(PURGED, now=now),
                insert_sql=IdempotencyAuditRecord.insert_sql,
                columns=tuple(
                    column(IdempotencyRecord, source)
                    for _target, source in IdempotencyAuditRecord.copied_columns()
                ),
                params=(now, PURGED),
            )

        def outbox() -> models.QuerySet[OutboxMessage]:
            # Called in each batch's transaction: which runs hold a live lease is read again
            # there, so a run a worker took up while the records were purged keeps its key.
            running = running_tasks(alias, now)
            return (
                OutboxMessage.objects.using(alias)
                .filter(status=OutboxStatus.SENT, sent_at__lte=now - app_settings.OUTBOX_RETENTION)
                .exclude(models.Exists(OutboxUniqueKey.may_hold(now, running)))
            )

        return _purge.purge(
            records=self.filter(expired_q(now)),
            audits=IdempotencyAuditRecord.objects.using(alias).filter(
                archived_at__lte=now - app_settings.AUDIT_RETENTION
            ),
            outbox=outbox,
            archive=archive,
            batch_size=batch_size,
            max_batches=max_batches,
            dry_run=dry_run,
            progress=progress,
        )


#: The account of every ``@idempotent_task`` record: no request's account is ever "task",
#: so task records and request records never collide.
TASK_ACCOUNT = "task"


def running_tasks(alias: str, now: datetime) -> list[uuid.UUID]:
    """The outbox messages whose run's record (``@idempotent_task``, keyed by the message)
    is in progress under a live lease at ``now`` (as many as runs go on at once): their
    ``enqueue_once`` keys hold whenever their message was sent."""
    keys = (
        IdempotencyRecord.objects.using(alias)
        .filter(states.live_lease_q(now), account=TASK_ACCOUNT)
        .values_list("key", flat=True)
    )
    found = []
    for key in keys:
        try:
            found.append(uuid.UUID(key))
        except ValueError:
            continue
    return found


class IdempotencyRecord(models.Model):
    """One logical operation: ``(account, operation, key)`` is unique.

    A row is created by the atomic claim (``in_progress`` with a lease and an owner token),
    becomes ``completed`` in the same transaction as the view's own writes, or ``failed``
    when a stale lease meets the ``"fail"`` recovery policy. A released claim is deleted.
    """

    account = models.CharField(max_length=255)
    operation = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    fingerprint_version = models.CharField(max_length=64, default="v1")
    status = models.CharField(
        max_length=16, choices=RecordStatus.choices, default=RecordStatus.IN_PROGRESS
    )
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    recovery_policy = models.CharField(max_length=255, default="retry")
    recovery_attempts = models.PositiveIntegerField(default=0)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_headers = models.JSONField(default=list, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    # The shared selections, the purge and the audit copy, on the manager and on querysets
    # alike: ``IdempotencyRecord.objects.using(alias).archive_expired(...)``.
    objects = IdempotencyRecordQuerySet.as_manager()

    class Meta:
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")
        db_table = "django_idempotency_record"
        # The admin shows a stored response's body and headers only with this permission.
        permissions = [("view_response_body", _("Can view stored response bodies"))]
        constraints = [
            models.UniqueConstraint(
                fields=["account", "operation", "key"], name="idempotency_record_unique_key"
            ),
        ]
        # Every index is written by every claim; each one earns its place here. The hot path
        # needs only the unique constraint. The completion changes ``status``, so an index
        # over it (or filtered by it) keeps the completion from being a HOT update on
        # PostgreSQL; only the small in-flight index does (see benchmarks/RESULTS.md).
        indexes = [
            # The purge and the "expired" admin filter and statistic: by expiry.
            models.Index(fields=["expires_at"], name="idempotency_expires_idx"),
            # The recovery job, the stale-lease statistic and the oldest-in-progress metric,
            # the admin's lease filter: in-flight records only, so it stays as small as the
            # number of requests running.
            models.Index(
                fields=["lease_expires_at"],
                name="idempotency_inflight_idx",
                condition=models.Q(status=states.IN_PROGRESS),
            ),
            # The admin's operation filter (its choices by a loose index scan).
            models.Index(fields=["operation"], name="idempotency_operation_idx"),
            # The admin's default order (newest first) and its date hierarchy.
            models.Index(fields=["created_at"], name="idempotency_created_idx"),
            # The resumable records' statistic and gauge, by status: only records under the
            # "resume" policy, so no other claim writes to it. Not over status, which the
            # completion changes (that would end HOT completions for every record); the
            # few rows it finds are read for their status. (MariaDB has no partial index:
            # Django leaves it out there.)
            models.Index(
                fields=["recovery_policy"],
                name="idempotency_resumable_idx",
                condition=models.Q(recovery_policy=_policies.RESUME.name),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation} {self.key} ({self.status})"


class IdempotencyStep(models.Model):
    """One recorded step of a resumable operation (``recovery="resume"``): its result.

    Written by ``django_idempotency.step`` in the step's own transaction, together with
    the step's work, fenced by the record's lease token; read once when an attempt starts, so
    a later attempt skips what an earlier one finished. Deleted with its record (the purge, a
    release, the admin), and when an expired record is replaced by a new operation.
    """

    # No constraint managed by Django: the migration makes it ON DELETE CASCADE on
    # PostgreSQL and MariaDB, so every way a record is deleted (the purge's raw batches
    # included) takes its steps along; elsewhere the ORM cascades.
    record = models.ForeignKey(
        IdempotencyRecord,
        on_delete=models.CASCADE,
        related_name="steps",
        db_constraint=False,
        # The unique (record, name) constraint serves the reads by record.
        db_index=False,
    )
    name = models.CharField(max_length=255)
    #: The step's result as JSON text, exactly as it was recorded.
    result = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = _("idempotency step")
        verbose_name_plural = _("idempotency steps")
        db_table = "django_idempotency_step"
        constraints = [
            # One result per step name and record; it serves the reads by record too.
            models.UniqueConstraint(fields=["record", "name"], name="idempotency_step_unique"),
        ]

    def __str__(self) -> str:
        return self.name


class IdempotencyAuditRecord(models.Model):
    """A copy of a record taken when it left the deduplication window (append-only).

    Written only when ``IDEMPOTENCY["AUDIT"]`` is on: by the purge, and by a claim that
    replaces an expired record. Kept for ``AUDIT_RETENTION`` after ``archived_at``, then
    deleted by the same purge, in the same bounded batches.
    """

    record_id = models.BigIntegerField(help_text=_("The id the record had in its own table."))
    account = models.CharField(max_length=255)
    operation = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    fingerprint_version = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=RecordStatus.choices)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    recovery_policy = models.CharField(max_length=255)
    recovery_attempts = models.PositiveIntegerField()
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_headers = models.JSONField(default=list, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    archived_at = models.DateTimeField(default=timezone.now)
    reason = models.CharField(max_length=16, choices=ARCHIVE_REASONS)

    class Meta:
        verbose_name = _("idempotency audit record")
        verbose_name_plural = _("idempotency audit records")
        db_table = "django_idempotency_audit"
        indexes = [
            # The retention purge scans by archive time; audits look a key up.
            models.Index(fields=["archived_at"], name="idempotency_audit_arch_idx"),
            models.Index(fields=["account", "operation", "key"], name="idempotency_audit_key_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.operation} {self.key} ({self.reason})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        # Append-only: an audit trail that can be edited proves nothing.
        if not self._state.adding:
            raise TypeError("idempotency audit records are append-only")
        super().save(*args, **kwargs)

    @classmethod
    def insert_sql(cls, connection: Any) -> str:
        """``INSERT INTO <audit> (<copied columns>, archived_at, reason)``, ready for a SELECT.

        The SELECT yields the record's columns of :meth:`copied_columns`, then the archive
        time and the reason.
        """
        quote = connection.ops.quote_name
        targets = [target for target, _source in cls.copied_columns()] + ["archived_at", "reason"]
        columns = ", ".join(quote(column(cls, name)) for name in targets)
        return f"INSERT INTO {quote(cls._meta.db_table)} ({columns})"

    @classmethod
    def copied_columns(cls) -> list[tuple[str, str]]:
        """``(audit field, record field)`` pairs copied from :class:`IdempotencyRecord`."""
        own = {"id", "record_id", "archived_at", "reason"}
        pairs = [("record_id", "id")]
        pairs += [(f.name, f.name) for f in cls._meta.concrete_fields if f.name not in own]
        return pairs


class OutboxStatus(models.TextChoices):
    """Where an outbox message stands: waiting for the relay, sent, or given up on."""

    PENDING = "pending", _("pending")
    SENT = "sent", _("sent")
    DEAD = "dead", _("dead")


class OutboxMessage(models.Model):
    """A message committed with the business state, sent by the relay (``relay_outbox``).

    Written by ``django_idempotency.outbox.enqueue`` in the caller's transaction, so it
    exists exactly when that transaction committed. The relay sends it at least once, with
    its ``id`` as the task id; a failed send counts an attempt and moves ``available_at``
    later, and after ``OUTBOX_MAX_ATTEMPTS`` the message is ``dead`` (kept, requeued by
    hand). Sent messages are purged after ``OUTBOX_RETENTION``.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.CharField(max_length=255, help_text=_("The registered name of the task."))
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    status = models.CharField(
        max_length=8, choices=OutboxStatus.choices, default=OutboxStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0, help_text=_("Failed sends so far."))
    available_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    delivery = models.JSONField(
        default=dict,
        blank=True,
        help_text=_(
            "For a task of Django's Tasks framework: the backend it was enqueued on, its "
            "priority, queue and run_after, and the result of its last hand-over."
        ),
    )
    run_reported = models.BooleanField(
        default=False,
        help_text=_(
            "The worker reports this message's run on its unique key (enqueue_once until "
            "started or finished, the task not under @idempotent_task())."
        ),
    )

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        db_table = "django_idempotency_outbox"
        indexes = [
            # The relay's "due" query: pending, available_at <= now, oldest first.
            models.Index(fields=["status", "available_at"], name="idempotency_outbox_due_idx"),
            # The retention purge: sent, sent_at <= cutoff, oldest first.
            models.Index(fields=["status", "sent_at"], name="idempotency_outbox_sent_idx"),
            # The admin's list, newest first.
            models.Index(fields=["created_at"], name="idempotency_outbox_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task} {self.id} ({self.status})"


class OutboxUniqueKey(models.Model):
    """Which message holds a key of ``outbox.enqueue_once``: one row per (task, key).

    Written in the enqueue's transaction with its message, so the key is held exactly when
    that message committed; ``(task, key)`` is unique, so two enqueues racing in two
    transactions give one message. The row stays after its message stopped being live: the
    next enqueue of the key finds it free (its message sent and started or finished, dead,
    or its time up) and points it at the new message. Deleted with its message (the purge).
    """

    task = models.CharField(max_length=255, help_text=_("The registered name of the task."))
    key = models.CharField(max_length=255)
    # No constraint managed by Django: the migration makes it ON DELETE CASCADE on
    # PostgreSQL and MariaDB, so the purge's raw batches take the key along; elsewhere the
    # ORM cascades. One key per message: it serves the admin's and the audit's lookups.
    message = models.OneToOneField(
        OutboxMessage, on_delete=models.CASCADE, related_name="unique_key", db_constraint=False
    )
    unique_until = models.CharField(
        max_length=16,
        choices=[(name, name) for name in _policies.UNIQUE_UNTIL],
        help_text=_("When the message stops holding the key."),
    )
    held_until = models.DateTimeField(
        null=True, blank=True, help_text=_("For a duration: the key is held until then.")
    )
    run_ttl = models.DurationField(
        null=True,
        blank=True,
        help_text=_(
            "How long the worker keeps its record of a run: a message sent longer ago with "
            "no record of a run no longer holds the key."
        ),
    )
    finished_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_(
            "When the task's run ended with an error (a success is its record's); for a run "
            "the worker reports here, when it ended."
        ),
    )
    started_at = models.DateTimeField(
        null=True, blank=True, help_text=_("For a run the worker reports here: when it started.")
    )
    lease_expires_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_(
            "For a run the worker reports here: it holds the key until then unless it ended "
            "(a worker that died never says so)."
        ),
    )
    run_id = models.CharField(
        max_length=255,
        default="",
        blank=True,
        help_text=_(
            "For a run the worker reports here: the id the worker knows it by, where it is "
            "not the message's (the result id of Django's Tasks framework's backend)."
        ),
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = _("outbox unique key")
        verbose_name_plural = _("outbox unique keys")
        db_table = "django_idempotency_outbox_key"
        constraints = [
            models.UniqueConstraint(fields=["task", "key"], name="idempotency_outbox_key_unique"),
        ]
        indexes = [
            # A run of Django's Tasks framework finds its key by ``run_id =`` (no LIKE:
            # no pattern-ops index on PostgreSQL, as ``db_index`` would add).
            models.Index(fields=["run_id"], name="idempotency_outbox_key_run_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task} {self.key} -> {self.message_id}"

    @classmethod
    def may_hold(
        cls, now: datetime, running: Iterable[uuid.UUID] = ()
    ) -> models.QuerySet[OutboxUniqueKey]:
        """The key of the outer query's sent message, where it may still hold at ``now``
        (``_unique.holds`` decides): a duration not over yet; or a word's, its run not ended
        with an error, the message sent less long ago than the run's record lives
        (``run_ttl``) or its run among ``running`` (those whose record holds a live lease,
        ``running_tasks``: a run a worker took up later than ``run_ttl`` after the
        hand-over) or reported on the key under a live lease. The purge keeps such a
        message, and so its key, past ``OUTBOX_RETENTION``: a key is never freed by the
        purge before its time."""
        kept = models.ExpressionWrapper(
            models.OuterRef("sent_at") + models.F("run_ttl"), output_field=models.DateTimeField()
        )
        # A run its worker reports on the key: started, under a live lease.
        live = models.Q(kept__gt=now) | models.Q(lease_expires_at__gt=now)
        if running := list(running):
            live |= models.Q(message_id__in=running)
        return (
            cls.objects.filter(message_id=models.OuterRef("pk"))
            .alias(kept=kept)
            .filter(
                models.Q(held_until__gt=now)
                | (models.Q(finished_at=None, run_ttl__isnull=False) & live)
            )
        )
