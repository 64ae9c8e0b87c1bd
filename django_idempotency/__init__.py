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
    "InvalidKey",
    "KeyReused",
    "OnceResult",
    "OutcomeTooLarge",
    "OutcomeUnknown",
    "RecordUnreadable",
    "StoreUnavailable",
    "TaskAlreadyQueued",
    "context_of",
    "current",
    "run_once",
    "run_once_result",
    "step",
]

if TYPE_CHECKING:
    from django_idempotency._context import IdempotencyContext, context_of, current
    from django_idempotency._once import OnceResult, run_once, run_once_result
    from django_idempotency._steps import step
    from django_idempotency.exceptions import (
        IdempotencyError,
        InProgress,
        KeyReused,
        OutcomeTooLarge,
        OutcomeUnknown,
        RecordUnreadable,
        StoreUnavailable,
        TaskAlreadyQueued,
    )
    from django_idempotency.keys import InvalidKey

_WHERE = {
    "IdempotencyContext": "_context",
    "context_of": "_context",
    "current": "_context",
    "OnceResult": "_once",
    "run_once_result": "_once",
    "IdempotencyError": "exceptions",
    "InProgress": "exceptions",
    "InvalidKey": "keys",
    "KeyReused": "exceptions",
    "OutcomeTooLarge": "exceptions",
    "OutcomeUnknown": "exceptions",
    "RecordUnreadable": "exceptions",
    "StoreUnavailable": "exceptions",
    "TaskAlreadyQueued": "exceptions",
    "run_once": "_once",
    "step": "_steps",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'django_idempotency' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_idempotency.{module}"), name)
