"""Agents' tool calls: ``@idempotent_tool()`` for the official MCP Python SDK.

An agent that retries a tool call after a timeout repeats a real-world action, and the
model mints a new tool-call id every turn, so the id cannot be the key. The key comes from
the tool's own ``idempotency_key`` argument (which the model is told to reuse on a retry)
or from the host, in the call's ``_meta["idempotencyKey"]``; the engine then gives the
tool what it gives a protected view: one run per ``(account, operation, key)``, the stored
result replayed to every retry, leases with fencing, recovery policies and steps.

::

    from mcp.server.mcpserver import MCPServer
    from django_idempotency.mcp import idempotent_tool

    shop = MCPServer("shop")

    @shop.tool()
    @idempotent_tool(recovery="fail")
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict:
        ...

The SDK's side of the adapter contract (``_tools.Framework``): the call's ``Context``
reaches the adapter as an argument the SDK fills (the tool's own, or one the adapter adds),
the tool's result is stored as the ``CallToolResult`` the SDK would have sent, and a refusal
is a tool result with ``isError`` and a ``structuredContent`` of ``{"code", "detail"}``
carrying the HTTP side's problem codes. Needs the ``mcp`` extra.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import find_resolved_parameters
from mcp.server.mcpserver.utilities.context_injection import find_context_parameter
from mcp.server.mcpserver.utilities.func_metadata import func_metadata
from mcp_types import CallToolResult

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

# The name under which the adapter receives the call's Context when the tool asks for none.
_CONTEXT_ARGUMENT = "idempotency_context"


def principal_account(context: Any = None) -> str | None:
    """The default account: the authenticated MCP principal of the call, or ``None``.

    The access token's subject, qualified by its issuer (``iss`` claim) where it has one,
    is ``mcp:sub:["<issuer>","<subject>"]``; a token without a subject names its OAuth
    client, ``mcp:client:<client_id>``. Without an access token there is no account.
    """
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
    """Run an MCP tool at most once per ``(account, operation, key)``; replay its result.

    Put it beneath ``@server.tool()``, with parentheses. The tool keeps its signature and
    input schema; a ``def`` tool and an ``async def`` tool are both served.

    - ``account``: a string, or ``Context -> str | None``; by default the access token's
      principal (``principal_account``). No account (``None`` or ``""``): the call is
      refused as ``idempotency_account_missing``.
    - ``operation``: default ``tool:<function name>``.
    - ``ttl``, ``lease``, ``recovery``: as for ``run_once`` (the settings by default). The
      lease must outlive the slowest call.
    - ``wait``: how long a duplicate of a call in flight waits for its outcome (bounded,
      holding no lock or connection) rather than being refused as in use.
    - ``required``: without a key the call is refused (``True``, the default) or runs
      unprotected (``False``).

    A wrong option raises ``ImproperlyConfigured`` here, when the tool is decorated.
    """
    return _tools.protector(
        _SDK(),
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


class _SDK(_tools.Framework[CallToolResult]):
    """The official SDK's ``MCPServer``."""

    name = "MCPServer"

    def __init__(self) -> None:
        self.tool = "the tool"
        self.context_argument = _CONTEXT_ARGUMENT
        self.own_context: str | None = None

    def refuse_registered(self, func: Callable[..., Any], where: str, own: bool = True) -> None:
        """``@idempotent_tool`` above ``@server.tool()`` protects nothing: the server has
        the bare function already. Refused where a server in sight shows it: one of the
        decorating module's, or of the scope the decorator is applied in, or one step away
        from either (see ``_tools.servers_in_sight``)."""
        for server in _tools.servers_in_sight(func, MCPServer):
            # The SDK keeps a server's tools in its tool manager (no public list is sync).
            tools = getattr(getattr(server, "_tool_manager", None), "list_tools", None)
            if callable(tools) and any(tool.fn is func for tool in tools()):
                raise _tools.misplaced(where, f"@{server.name}.tool()", func, "@server.tool()")
        if own and _CONTEXT_ARGUMENT in inspect.signature(func).parameters:
            raise ImproperlyConfigured(
                f"@idempotent_tool at {where}: {func.__name__} has an argument named "
                f"{_CONTEXT_ARGUMENT!r}, the name the adapter passes the call's Context by; "
                "rename it"
            )

    def signature(
        self, func: Callable[..., Any], signature: inspect.Signature
    ) -> inspect.Signature:
        self.tool = func.__name__
        self.own_context = find_context_parameter(func)
        self.context_argument = self.own_context or _CONTEXT_ARGUMENT
        if self.own_context is not None:
            return signature
        added = inspect.Parameter(
            _CONTEXT_ARGUMENT, inspect.Parameter.KEYWORD_ONLY, annotation=Context, default=None
        )
        parameters = list(signature.parameters.values())
        # Before a **kwargs parameter, which comes last.
        variadic = bool(parameters) and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD
        at = len(parameters) - variadic
        return signature.replace(parameters=[*parameters[:at], added, *parameters[at:]])

    def split(self, arguments: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        context = arguments.get(self.context_argument)
        if context is None and _in_a_fastmcp_call():
            # FastMCP serves this tool (it gives no MCPServer Context): its conversion of the
            # result is not the SDK's, and FastMCP would refuse the stored answer after the
            # tool ran. Nothing runs.
            raise ImproperlyConfigured(
                f"{self.tool}: protected by django_idempotency.mcp.idempotent_tool, which "
                "is for the SDK's MCPServer, and served by FastMCP: protect it with "
                "django_idempotency.fastmcp.idempotent_tool"
            )
        if self.own_context is None:
            arguments = {n: v for n, v in arguments.items() if n != _CONTEXT_ARGUMENT}
        return context, arguments

    def injected(self, func: Callable[..., Any]) -> frozenset[str]:
        # The tool's Context, and the parameters its resolvers fill (``Resolve(fn)``, the
        # SDK's dependencies: a client, a session, an elicitation's answer).
        context = {self.own_context} if self.own_context else set()
        return frozenset({*context, *find_resolved_parameters(func)})

    def tool_name(self, context: Any) -> str | None:
        # The SDK records no registration on the function: the call names its tool.
        if not isinstance(context, Context):
            return None
        try:
            params = context.request_context.params
        except ValueError:  # a Context outside a request
            return None
        name = params.get("name") if isinstance(params, Mapping) else None
        return name if isinstance(name, str) and name else None

    def meta(self, context: Any) -> Mapping[str, Any] | None:
        if not isinstance(context, Context):
            return None
        try:
            meta = context.request_context.meta
        except ValueError:  # a Context outside a request
            return None
        return meta or None

    def principal(self, context: Any) -> str | None:
        return principal_account(context)

    def converter(self, func: Callable[..., Any]) -> Callable[[Any, Any], CallToolResult]:
        # How the SDK turns the tool's return value into a result, computed as the SDK
        # does, so that the stored result is the one a first call answers: by the tool the
        # call reached, as its registration made it (@server.tool(structured_output=False)
        # sends no structured content), else as the default registration would.
        default = func_metadata(func, skip_names=[self.context_argument]).convert_result
        name = func.__name__

        def result(context: Any, value: Any) -> CallToolResult:
            registered = self.registered(context)
            convert = registered.fn_metadata.convert_result if registered else default
            converted = convert(value)
            if not isinstance(converted, CallToolResult):
                raise TypeError(
                    f"tool {name} answered {type(converted).__name__}, which cannot be "
                    "stored and replayed"
                )
            return converted

        return result

    def registered(self, context: Any) -> Any:
        """The SDK's ``Tool`` the call reached (its server's, by the name the call gave), or
        ``None`` outside a request."""
        name = self.tool_name(context)
        if name is None:
            return None
        server: Any = context.mcp_server
        # The SDK keeps a server's tools in its tool manager (no public lookup is sync).
        manager = getattr(server, "_tool_manager", None)
        return manager.get_tool(name) if manager is not None else None

    def sent(self, result: CallToolResult) -> CallToolResult:
        return result

    def received(self, result: CallToolResult) -> CallToolResult:
        return result


def _in_a_fastmcp_call() -> bool:
    """Whether this runs inside a call that FastMCP serves (its current context is set).
    FastMCP is not imported for this: where it is not loaded, it serves nothing."""
    dependencies = sys.modules.get("fastmcp.server.dependencies")
    if dependencies is None:
        return False
    try:
        dependencies.get_context()
    except RuntimeError:  # no FastMCP request
        return False
    return True


#: This module's framework, for the order check of the other frameworks' adapters.
FRAMEWORK = _SDK
