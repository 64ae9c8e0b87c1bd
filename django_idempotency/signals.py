"""Signals sent by django-idempotency, with ``sender=IdempotencyRecord`` (or ``OutboxMessage``).

Receivers run inline on the request path: keep them quick, and never let them raise. Each
signal's docstring says when it is sent and with which keyword arguments. The signals of the
request path cache their receivers per sender (``use_caching``), so asking whether anybody
listens costs a dictionary lookup.
"""

from __future__ import annotations

from django.dispatch import Signal

record_claimed = Signal(use_caching=True)
"""A request claimed its key and is about to run the view. Arguments: request, account, operation,
key, takeover (True when a stale lease was taken over). A receiver that raises stops the
request before the view runs: the claim is released (on a takeover, its lease ends now and
the record waits for its recovery policy), and the error goes on."""

response_replayed = Signal(use_caching=True)
"""A stored response was replayed. Arguments: request, account, operation, key, status."""

request_conflicted = Signal(use_caching=True)
"""A retry met an in-progress original and was answered 409. Arguments: request, account,
operation, key."""

payload_mismatched = Signal(use_caching=True)
"""A key was reused with a different request and was answered 422. Arguments: request, account,
operation, key."""

lease_lost = Signal(use_caching=True)
"""An attempt could not complete because another attempt took its lease over; its database work was
rolled back. Arguments: request, account, operation, key."""

record_unreadable = Signal(use_caching=True)
"""A retry met a record whose stored outcome cannot be read back (sealed with a key that
ENCRYPTION_KEYS no longer holds, or damaged) and was refused: 503 for a request,
RecordUnreadable elsewhere; nothing ran. Arguments: request (None outside HTTP), account,
operation, key, key_id (the key that sealed it, None when unknown), reason."""

lease_recovered = Signal(use_caching=True)
"""A stale lease was handled by a recovery policy, on a retry, by the recovery job or by an admin
action. Arguments: account, operation, key, policy ("retry", "fail", "resume" or the callable's
path), outcome ("retried", "resumed", "released", "failed" or "completed"). "resumed": a retry
(a request, run_once or a task) took over a resumable operation's stale lease to resume it; the
recovery job leaves those records to that retry and sends nothing for them."""

records_purged = Signal()
"""The purge deleted records. Arguments: count, audit (rows purged from the audit table), outbox
(sent outbox messages purged)."""

outbox_relayed = Signal()
"""The outbox relay finished a batch (sent with sender=OutboxMessage). Arguments: sent, failed (to
be retried after a backoff), dead (given up on); all counts."""

outbox_relay_failed = Signal()
"""The outbox relay hit an unexpected error, anything but a failed send (sent with
sender=OutboxMessage): the batch in hand rolled back and its messages are sent later; a
long-running relay goes on after a pause, ``relay_outbox --once`` and the Celery task raise it.
Arguments: error (the exception)."""
