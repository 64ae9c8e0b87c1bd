"""Who a key belongs to: the server's own idea of the caller, never the client's."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def user_account(request: Any) -> str | None:
    """The default resolver: the account of ``request.user`` when it is authenticated (see
    :func:`principal_account`), else ``None`` (refused)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return principal_account(user)


def principal_account(principal: Any) -> str | None:
    """``user:<pk>`` for a user (an instance of ``AUTH_USER_MODEL``, of a proxy or a subclass
    of it) or an object that stands for one without a model of its own (a token's user). An
    instance of another model (a service account that an authentication class sets as the
    user) is named by its model, ``<app_label>.<model_name>:<pk>``: it never shares the
    account of the user whose primary key it has. ``None`` for one without a primary key (an
    unsaved user built from a token's claims): ``user:None`` would be every such caller's."""
    if getattr(principal, "pk", None) is None:
        return None
    label = getattr(getattr(type(principal), "_meta", None), "label_lower", None)
    if (
        isinstance(label, str)
        and label != settings.AUTH_USER_MODEL.lower()
        and not _is_a_user(principal)
    ):
        return f"{label}:{principal.pk}"
    return f"user:{principal.pk}"


def _is_a_user(principal: Any) -> bool:
    from django.contrib.auth import get_user_model

    try:
        return isinstance(principal, get_user_model())
    except ImproperlyConfigured:  # django.contrib.auth not installed
        return False
