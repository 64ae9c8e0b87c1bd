"""The example's ASGI app (``example_project.asgi``) with a kill point, for
``tests/test_mcp_e2e.py``: ``MCP_KILL="after:<dotted.path>"`` (or ``before:``) makes the server
process SIGKILL itself right after (before) that callable runs, inside a tool call, as a crash
or an out-of-memory kill would. Without ``MCP_KILL`` it is the example's app unchanged."""

from __future__ import annotations

import functools
import os
import pkgutil
import signal
from typing import Any

from example_project.asgi import application

__all__ = ["application"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install(spec: str) -> None:
    when, _, target = spec.partition(":")
    if when not in ("before", "after") or not target:
        raise RuntimeError(
            f"MCP_KILL must be before:<dotted.path> or after:<dotted.path>: {spec!r}"
        )
    owner_name, _, name = target.rpartition(".")
    owner = pkgutil.resolve_name(owner_name)
    original = getattr(owner, name)

    @functools.wraps(original)
    def killing(*args: Any, **kwargs: Any) -> Any:
        if when == "before":
            _die()
        result = original(*args, **kwargs)
        _die()
        return result

    setattr(owner, name, killing)


if os.environ.get("MCP_KILL"):
    _install(os.environ["MCP_KILL"])
