"""Agents' tool calls: ``@idempotent_tool()`` for FastMCP (4.x).

The same decorator, arguments and behaviour as :mod:`django_idempotency.mcp`'s, beneath
FastMCP's ``@server.tool``::

    from fastmcp import FastMCP
    from django_idempotency.fastmcp import idempotent_tool

    shop = FastMCP("shop")

    @shop.tool
    @idempotent_tool(recovery="fail")
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict:
        ...

FastMCP's side of the adapter contract (``_tools.Framework``): the call's ``Context`` is
FastMCP's current one (``get_context()``), so the tool's signature gains nothing; the
default account is the principal of FastMCP's access token; the tool's return value becomes
the ``ToolResult`` FastMCP would have made of it, stored as the MCP ``CallToolResult`` it
sends; a refusal is a ``ToolResult`` with ``is_error`` and a ``structured_content`` of
``{"code", "detail"}``, whose codes are the HTTP side's. Needs the ``fastmcp`` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from fastmcp import FastMCP
from fastmcp.decorators import get_fastmcp_meta
from fastmcp.server.context import Context
from fastmcp.server.dependencies import get_access_token, get_context
from fastmcp.server.sessions import UserSession
from fastmcp.tools.base import ToolResult
from fastmcp.tools.function_tool import FunctionTool
from fastmcp.utilities.types import find_kwarg_by_type
from mcp_types import CallToolResult
from uncalled_for import get_dependency_parameters  # FastMCP's own dependency engine

from django_idempotency import _tools, _validation
from django_idempotency._options import Recovery, ToolOptions
from django_idempotency._tools import KEY_ARGUMENT, KEY_DESCRIPTION, META_KEY, REPLAYED_META

__all__ = [
    "KEY_ARGUMENT",
    "KEY_DESCRIPTION",
    "META_KEY",
    "REPLAYED_META",
    "ToolOptions",
    "idempotent_tool",
    "principal_account",
]

F = TypeVar("F", bound=Callable[..., Any])


def principal_account(context: Any = None) -> str | None:
    """The default account: the principal of FastMCP's access token for the call, named
    as ``django_idempotency.mcp.principal_account`` names the SDK's (the same token
    is the same account whichever framework serves the tool), or ``None``."""
    return _tools.principal_of(get_access_token())


@_tools.keyword_options_only
def idempotent_tool(
    misplaced: object = _tools.NOTHING,
    /,
    *,
    account: str | Callable[[Any], str | None] | None = None,
    operation: str | None = None,
    ttl: timedelta | int | None = None,
    lease: timedelta | int | None = None,
    recovery: Recovery | None = None,
    wait: timedelta | int | None = None,
    required: bool = True,
) -> Callable[[F], F]:
    """Run a FastMCP tool at most once per ``(account, operation, key)``; replay its result.

    Put it beneath ``@server.tool``, with parentheses. The options, the key (the tool's
    ``idempotency_key`` argument, else the call's ``_meta["idempotencyKey"]``), the
    refusals and the replay are those of ``django_idempotency.mcp.idempotent_tool``;
    a callable ``account`` takes FastMCP's ``Context``. A wrong option raises
    ``ImproperlyConfigured`` here, when the tool is decorated.
    """
    return _tools.protector(
        _FastMCP(),
        {
            "account": account,
            "operation": operation,
            "ttl": ttl,
            "lease": lease,
            "recovery": recovery,
            "wait": wait,
            "required": required,
        },
        _validation.caller(),
        frozenset(ToolOptions.__optional_keys__),
        misplaced,
    )


class _FastMCP(_tools.Framework[ToolResult]):
    name = "FastMCP"

    def refuse_registered(self, func: Callable[..., Any], where: str, own: bool = True) -> None:
        # FastMCP's @server.tool marks the function it registers and returns it: beneath
        # it, this decorator would be handed a function the server calls unprotected.
        if get_fastmcp_meta(func) is not None:
            raise _tools.misplaced(where, "FastMCP's @server.tool", func, "@server.tool")
        # Its add_tool (of the function, or of a FunctionTool made of it) leaves no mark:
        # a server in sight shows it.
        for server in _tools.servers_in_sight(func, FastMCP):
            # FastMCP keeps a server's own tools in its local provider (no public list is
            # sync).
            components = getattr(getattr(server, "_local_provider", None), "_components", {})
            if any(getattr(tool, "fn", None) is func for tool in list(components.values())):
                raise _tools.misplaced(
                    where, f"add_tool of FastMCP {server.name!r}", func, "@server.tool"
                )

    def split(self, arguments: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        try:
            return get_context(), arguments
        except RuntimeError:  # called outside a FastMCP request
            return None, arguments

    def injected(self, func: Callable[..., Any]) -> frozenset[str]:
        # What FastMCP fills before it calls the tool (its ``without_injected_parameters``
        # leaves the same out of the tool's schema): its Context, its UserSession, and the
        # parameters of ``Depends()`` and the other dependencies.
        found = {find_kwarg_by_type(func, Context), find_kwarg_by_type(func, UserSession)}
        return frozenset({*get_dependency_parameters(func), *(n for n in found if n)})

    def meta(self, context: Any) -> Mapping[str, Any] | None:
        request = getattr(context, "request_context", None)
        return getattr(request, "meta", None) or None

    def principal(self, context: Any) -> str | None:
        return principal_account(context)

    def bind(self, tool: Callable[..., Any]) -> None:
        self.tool = tool

    def registration(self) -> Any:
        """What FastMCP's ``@server.tool(...)`` recorded on the protected tool (its name,
        its output schema), once it is registered; ``None`` before."""
        return get_fastmcp_meta(getattr(self, "tool", None))

    def tool_name(self, context: Any) -> str | None:
        registered = self.registration()
        return getattr(registered, "name", None) or None

    def converter(self, func: Callable[..., Any]) -> Callable[[Any, Any], ToolResult]:
        # The tool as FastMCP makes it of the function, with the output schema its
        # registration gave, for its conversion alone: the stored result is the one FastMCP
        # answers a first call with (its output schema's wrapping of a non-object return
        # included, or none where the registration said output_schema=None). Made at the
        # first call: the registration comes after this decorator.
        made: list[Callable[[Any], ToolResult]] = []

        def convert(context: Any, value: Any) -> ToolResult:
            if not made:
                schema = getattr(self.registration(), "output_schema", ...)
                tool = (
                    FunctionTool.from_function(func)
                    if schema is ...  # FastMCP's NotSet: derived from the return type
                    else FunctionTool.from_function(func, output_schema=schema)
                )
                made.append(tool.convert_result)
            return made[0](value)

        return convert

    def sent(self, result: ToolResult) -> CallToolResult:
        return CallToolResult.model_validate(
            {
                "content": result.content,
                "structuredContent": result.structured_content,
                "isError": result.is_error,
                "_meta": result.meta,
            }
        )

    def received(self, result: CallToolResult) -> ToolResult:
        return ToolResult.from_mcp_result(result)

    def answer(self, context: Any, result: ToolResult) -> Any:
        # Outside a FastMCP request (a direct call, or the tool registered on another MCP
        # server, such as the SDK's MCPServer) the answer is MCP's own CallToolResult: any
        # MCP server sends it as it is (a refusal an error, a replay with its flag), and a
        # direct caller reads the same fields as a ToolResult's.
        return result if context is not None else self.sent(result)


#: This module's framework, for the order check of the other frameworks' adapters.
FRAMEWORK = _FastMCP
