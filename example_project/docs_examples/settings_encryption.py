"""The encryption keys shown in the documentation, as a project's settings.py sets them."""

from __future__ import annotations

# --8<-- [start:encryption]
import os

# Fernet keys from the environment, e.g. IDEMPOTENCY_ENCRYPTION_KEYS="<new>,<old>": the first
# seals every response stored from now on, each one opens what it sealed.
IDEMPOTENCY = {
    "ENCRYPTION_KEYS": [
        key for key in os.environ.get("IDEMPOTENCY_ENCRYPTION_KEYS", "").split(",") if key
    ],
}
# --8<-- [end:encryption]
