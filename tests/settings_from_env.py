"""The test settings with ``IDEMPOTENCY`` taken from ``TEST_IDEMPOTENCY`` (a Python literal),
for running ``manage.py check`` as a process against a given value."""

from __future__ import annotations

import ast
import os

from tests.settings import *  # noqa: F403

IDEMPOTENCY = ast.literal_eval(os.environ["TEST_IDEMPOTENCY"])
