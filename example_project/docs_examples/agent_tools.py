"""Agents' tool calls shown in the documentation (docs/mcp.md): an MCP server whose tools run
once per key, whatever an agent retries. ``tests/test_mcp.py`` calls them through the SDK's
client and counts what reached the provider."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


class Provider:
    """A stand-in for a payment provider that takes idempotency keys, and a mail service that
    takes none: it keeps every call."""

    def __init__(self) -> None:
        self.refunds: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.mails: list[int] = []

    def refund(self, order_id: int, amount: int | None, *, key: str) -> dict[str, Any]:
        self.calls.append(key)
        made = {"id": f"re_{len(self.refunds) + 1}", "order": order_id, "amount": amount}
        return self.refunds.setdefault(key, made)

    def mail(self, order_id: int) -> int:
        self.mails.append(order_id)
        return len(self.mails)


provider = Provider()


# --8<-- [start:refund-tool]
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

from django_idempotency import current
from django_idempotency.mcp import idempotent_tool

shop = MCPServer("shop")


@shop.tool(annotations=ToolAnnotations(idempotent_hint=True))
@idempotent_tool(recovery="fail")
def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
    """Refund `amount` (in cents) of an order.

    Make a new idempotency_key for each refund you mean, and send the same one again on
    every retry of it: after a timeout, an error, an answer that never came.
    """
    operation = current()
    assert operation is not None
    return provider.refund(order_id, amount, key=operation.downstream_key("psp"))
    # --8<-- [end:refund-tool]


# --8<-- [start:host-key]
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.mcpserver import Context


def organisation(context: Context) -> str:
    """The account: the organisation of the token's holder, so that all its agents share
    their keys. No organisation: no account, and the call is refused."""
    token = get_access_token()
    claims = (token.claims or {}) if token is not None else {}
    return f"org:{claims['org']}" if claims.get("org") else ""


@shop.tool(annotations=ToolAnnotations(idempotent_hint=True))
@idempotent_tool(account=organisation, wait=timedelta(seconds=20))
def send_invoice(invoice_id: int) -> int:
    """Mail an invoice to its customer."""
    return provider.mail(invoice_id)
    # --8<-- [end:host-key]


# --8<-- [start:steps-tool]
from django_idempotency import step


@shop.tool(annotations=ToolAnnotations(idempotent_hint=True))
@idempotent_tool(recovery="resume")
def cancel_order(order_id: int, idempotency_key: str) -> dict[str, Any]:
    """Cancel an order: refund it in full, then mail the customer.

    Send the same idempotency_key on every retry: a retry finishes what is left.
    """
    operation = current()
    assert operation is not None
    money = step("refund", provider.refund, order_id, None, key=operation.downstream_key("psp"))
    mail = step("mail", provider.mail, order_id)  # a mail service takes no key
    return {"refund": money["id"], "mail": mail}
    # --8<-- [end:steps-tool]


# The same refund tool served by FastMCP (docs/mcp.md, "FastMCP"): the decorator of
# django_idempotency.fastmcp, beneath FastMCP's @tool.

# --8<-- [start:fastmcp-tool]
from fastmcp import FastMCP

from django_idempotency.fastmcp import idempotent_tool as idempotent_fastmcp_tool

fast_shop = FastMCP("shop")


@fast_shop.tool(annotations=ToolAnnotations(idempotent_hint=True))
@idempotent_fastmcp_tool(recovery="fail")
def refund_order(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
    """Refund `amount` (in cents) of an order.

    Make a new idempotency_key for each refund you mean, and send the same one again on
    every retry of it: after a timeout, an error, an answer that never came.
    """
    operation = current()
    assert operation is not None
    return provider.refund(order_id, amount, key=operation.downstream_key("psp"))
    # --8<-- [end:fastmcp-tool]
