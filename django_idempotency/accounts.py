"""Who a key belongs to: the server's own idea of the caller, never the client's."""

from __future__ import annotations

from typing import Any


def user_account(request: Any) -> str | None:
    """The default resolver: ``user:<pk>`` for an authenticated user, else ``None`` (refused)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return f"user:{user.pk}"
