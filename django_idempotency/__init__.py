"""Idempotency keys for Django: every retry of one operation gets the original outcome, and
the side effect runs at most once.

The framework-neutral API is importable from here: :func:`run_once`, :func:`current` and
the exceptions. (They are loaded on first use, so that importing the package needs no
configured Django.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

__all__ = [
    "IdempotencyContext",
    "IdempotencyError",
    "InProgress",
    "KeyReused",
    "OutcomeUnknown",
    "RecordUnreadable",
    "StoreUnavailable",
    "current",
    "run_once",
    "step",
]

if TYPE_CHECKING:
    from django_idempotency._core import IdempotencyContext, current, step
    from django_idempotency._once import run_once
    from django_idempotency.exceptions import (
        IdempotencyError,
        InProgress,
        KeyReused,
        OutcomeUnknown,
        RecordUnreadable,
        StoreUnavailable,
    )

_WHERE = {
    "IdempotencyContext": "_core",
    "current": "_core",
    "IdempotencyError": "exceptions",
    "InProgress": "exceptions",
    "KeyReused": "exceptions",
    "OutcomeUnknown": "exceptions",
    "RecordUnreadable": "exceptions",
    "StoreUnavailable": "exceptions",
    "run_once": "_once",
    "step": "_core",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'django_idempotency' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_idempotency.{module}"), name)
