"""The ★ sentences of the design that no other test pins, checked as a user would: imported
from where the design says, called as it spells them, through the public surface only."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

# -- ★ Agents' tool calls ------------------------------------------------------------------------

#: ``idempotent_tool(*, account=None, operation=None, ttl=None, lease=None, recovery=None,
#: wait=None, required=True)``, as the design spells it, for every framework.
TOOL_OPTIONS = {
    "account": None,
    "operation": None,
    "ttl": None,
    "lease": None,
    "recovery": None,
    "wait": None,
    "required": True,
}


@pytest.mark.parametrize("module", ["mcp", "fastmcp"])
def test_idempotent_tool_takes_the_designs_keyword_options_with_their_defaults(module: str) -> None:
    pytest.importorskip(module)
    from importlib import import_module

    idempotent_tool = import_module(f"django_idempotency.{module}").idempotent_tool
    parameters = inspect.signature(idempotent_tool).parameters
    keywords = {
        name: parameter.default
        for name, parameter in parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert keywords == TOOL_OPTIONS
    assert not [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    # Every default spelled out is the default: the decorator takes them all.
    idempotent_tool(**TOOL_OPTIONS)
