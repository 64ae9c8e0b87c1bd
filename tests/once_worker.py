"""A process that dies inside a ``run_once`` callable: ``python -m tests.once_worker KEY POLICY``.

With a third argument ``atomic``, ``run_once`` is called inside ``transaction.atomic()`` (a
consumer that opened a transaction of its own).

The callable records its ``current().downstream_key("provider")`` through the provider
connection (autocommit, so it survives), writes a local effect in the callable's
transaction, then SIGKILLs its own process before the completion commits.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import nullcontext

import django


def main(key: str, policy: str, caller: str = "") -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_idempotency import current, run_once
    from tests.testapp.models import Charge, ProviderCall

    def ship() -> str:
        context = current()
        assert context is not None
        ProviderCall.objects.using("provider").create(key=context.downstream_key("provider"))
        Charge.objects.create(account="consumer", amount=1, currency="EUR")
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    from django.db import transaction

    with transaction.atomic(durable=False) if caller == "atomic" else nullcontext():
        run_once(
            ship,
            account="consumer:shipping",
            operation="orders.ship",
            key=key,
            lease=1,
            recovery=policy,
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
