"""A process that dies inside a resumable ``run_once``: ``python -m tests.steps_worker KEY STAGE``.

It runs ``tests.testapp.steps.book`` under ``recovery="resume"`` and SIGKILLs itself at
``STAGE`` (one of ``tests.testapp.steps.STAGES``).
"""

from __future__ import annotations

import os
import sys

import django


def main(key: str, kill: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_idempotency import run_once
    from tests.testapp.steps import book, dying_at_completion

    with dying_at_completion(kill):
        run_once(
            book, kill, account="consumer:rides", operation="rides.book", key=key, recovery="resume"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
