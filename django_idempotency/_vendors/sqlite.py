"""SQLite, for development and small sites: its answers to the checklist of
:class:`.base.Vendor`.

SQLite serialises writers on the whole database, so a second connection cannot commit a
claim while the caller's transaction has read or written: inside a caller's transaction the
claim stays in it (``"retry"`` only; see ``_autonomous``). It has no row locks, no server
to lose, and no replication.
"""

from __future__ import annotations

from django_idempotency._vendors.base import Vendor

__all__ = ["SQLite"]


class SQLite(Vendor):
    name = "sqlite"

    separate_claims = False
    single_file = True
