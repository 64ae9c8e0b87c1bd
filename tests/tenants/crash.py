"""A process that dies inside ``run_once`` in one tenant's schema:
``python -m tests.tenants.crash SCHEMA KEY POLICY``.

``run_once`` is called inside ``transaction.atomic()``, so its claim commits on a connection
of its own. The callable records its downstream key at the provider (the tenant's ledger,
through a connection of its own in autocommit, so it survives), writes a charge in the
callable's transaction, then SIGKILLs its own process before the completion commits.
"""

from __future__ import annotations

import os
import signal
import sys

import django


def main(schema: str, key: str, policy: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.tenants.settings")
    django.setup()
    from django.db import connections, transaction
    from django_tenants.utils import schema_context

    from django_idempotency import current, run_once
    from tests.testapp.models import Charge, ProviderCall

    def charge() -> str:
        context = current()
        assert context is not None
        connections["provider"].set_schema(schema)
        ProviderCall.objects.using("provider").create(key=context.downstream_key("provider"))
        Charge.objects.create(account="user:1", amount=1, currency="EUR")
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    with schema_context(schema), transaction.atomic():
        run_once(
            charge, account="user:1", operation="charges.create", key=key, lease=1, recovery=policy
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
