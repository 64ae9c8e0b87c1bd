"""Slows the webhook recipes' handlers down when ``TEST_WEBHOOK_DELAY`` (seconds) is set, so
that concurrent deliveries of one event reach a live server while the first one runs."""

from __future__ import annotations

import os
import time
from typing import Any

from django.db.models.signals import post_save


def _slow_webhook(**kwargs: Any) -> None:
    # post_save of the handler's row: inside the handler's transaction, under its claim.
    delay = float(os.environ.get("TEST_WEBHOOK_DELAY", "0"))
    if delay:
        time.sleep(delay)


post_save.connect(_slow_webhook, sender="recipes.WebhookEvent", weak=False)
