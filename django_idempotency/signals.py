"""Signals sent by django-idempotency, with ``sender=IdempotencyRecord`` (or ``OutboxMessage``).

Receivers run inline on the request path: keep them quick, and never let them raise.
"""

from __future__ import annotations

from django.dispatch import Signal

# A request claimed its key and is about to run the view.
# Arguments: request, account, operation, key, takeover (True when a stale lease was taken over).
record_claimed = Signal()

# A stored response was replayed. Arguments: request, account, operation, key, status.
response_replayed = Signal()

# A retry met an in-progress original and was answered 409.
# Arguments: request, account, operation, key.
request_conflicted = Signal()

# A key was reused with a different request and was answered 422.
# Arguments: request, account, operation, key.
payload_mismatched = Signal()

# An attempt could not complete because another attempt took its lease over; its database
# work was rolled back. Arguments: request, account, operation, key.
lease_lost = Signal()

# A stale lease was handled by a recovery policy, on a retry, by the recovery job or by an
# admin action.
# Arguments: account, operation, key, policy ("retry", "fail" or the callable's path),
# outcome ("retried", "released", "failed" or "completed").
lease_recovered = Signal()

# The purge deleted records. Arguments: count, audit (rows purged from the audit table),
# outbox (sent outbox messages purged).
records_purged = Signal()

# The outbox relay finished a batch (sent with sender=OutboxMessage).
# Arguments: sent, failed (to be retried after a backoff), dead (given up on); all counts.
outbox_relayed = Signal()
