"""A rotation that dies inside a batch: ``python -m tests.rotate_proc BATCHES``.

``IDEMPOTENCY_ENCRYPTION_KEYS`` (comma-separated) are its ``ENCRYPTION_KEYS``. It rotates in
batches of 10 and SIGKILLs its own process once the batch after ``BATCHES`` committed ones
has written its updates, before that batch commits.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import django


def main(batches: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.test import override_settings

    from django_idempotency import crypto, maintenance

    committed = 0
    real_reseal = crypto._Walk._reseal

    def reseal(walk: Any, todo: Any) -> None:
        real_reseal(walk, todo)
        if committed == int(batches):
            os.kill(os.getpid(), signal.SIGKILL)

    def progress(done: int, sealed: int) -> None:
        nonlocal committed
        committed = done

    crypto._Walk._reseal = reseal  # type: ignore[method-assign, assignment]
    keys = os.environ["IDEMPOTENCY_ENCRYPTION_KEYS"].split(",")
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": keys}):
        maintenance.rotate_encryption(batch_size=10, progress=progress)


if __name__ == "__main__":
    main(sys.argv[1])
