"""The refund tools of ``example_project/mcp_tools.py``, served by FastMCP instead of the SDK's
``MCPServer``: the same guarantee, one refund per idempotency key, whatever an agent retries,
under each recovery policy.

Mounted beside the API and the SDK's server under ASGI (``example_project/asgi.py``, at
``/fastmcp``). An agent authenticates with the same bearer tokens (``MCP_TOKENS``); FastMCP's
access token names the account, as the SDK's does, so a key belongs to the same account
whichever server takes the call.
"""

from __future__ import annotations

from django.contrib.auth.models import User
from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.server.auth import AccessToken, TokenVerifier
from fastmcp.server.dependencies import get_access_token

from django_idempotency.fastmcp import idempotent_tool
from example_project import mcp_tools
from example_project.mcp_tools import LEASE, RETRY_SAFE, RefundResult


class SettingsTokens(TokenVerifier):
    """Bearer tokens from the settings (``MCP_TOKENS``: token -> username), as the SDK's
    server of the example verifies them. A demo's: a real server verifies its authorization
    server's tokens (FastMCP's ``JWTVerifier``, introspection)."""

    async def verify_token(self, token: str) -> AccessToken | None:
        username = mcp_tools.setting("MCP_TOKENS").get(token)
        if username is None:
            return None
        return AccessToken(
            token=token,
            client_id="example-agent",
            scopes=["payments"],
            subject=username,
            claims={"iss": mcp_tools.setting("MCP_ISSUER")},
        )


shop = FastMCP(
    "example-payments-fastmcp",
    instructions=(
        "Refunds of the caller's charges. Every tool that changes something takes an "
        "idempotency_key: make a new one for each action, and send the same one again on "
        "every retry of that action."
    ),
    auth=SettingsTokens(required_scopes=["payments"]),
)


def customer() -> User:
    """The user the access token speaks for."""
    token = get_access_token()
    if token is None or not token.subject:
        raise ToolError("not authenticated")
    return User.objects.get(username=token.subject)


@shop.tool(annotations=RETRY_SAFE)
@idempotent_tool(lease=LEASE)
def refund_charge(
    charge_id: int, amount: int, idempotency_key: str, reason: str = ""
) -> RefundResult:
    """Refund `amount` (in cents) of one of your charges; its receipt is mailed afterwards.

    Make a new idempotency_key for each refund you mean, and send the same one again when you
    retry it (after a timeout, an error, a lost answer): the refund is made once and every
    retry gets its result.
    """
    return mcp_tools.refund_charge_of(customer(), charge_id, amount, reason)


@shop.tool(annotations=RETRY_SAFE)
@idempotent_tool(recovery="fail", lease=LEASE)
def mail_refund_receipt(refund_id: int, idempotency_key: str) -> int:
    """Mail the receipt of one of your refunds again; the mail's id.

    Send the same idempotency_key on every retry. If an earlier attempt may have mailed it
    already, you get the error idempotency_outcome_unknown instead of a second mail.
    """
    return mcp_tools.mail_refund_receipt_of(customer(), refund_id)


@shop.tool(annotations=RETRY_SAFE)
@idempotent_tool(recovery="resume", lease=LEASE)
def refund_and_mail(charge_id: int, amount: int, idempotency_key: str) -> dict[str, int]:
    """Refund `amount` (in cents) of one of your charges and mail the receipt at once.

    Send the same idempotency_key on every retry: a retry after a failure finishes what is
    left (the refund is never made twice, the mail never sent twice).
    """
    return mcp_tools.refund_and_mail_of(customer(), charge_id, amount)
