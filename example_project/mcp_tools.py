"""The payments API for agents: an MCP server whose tools refund a charge and mail its receipt,
each run once per idempotency key, whatever an agent retries.

Mounted beside the API under ASGI (``example_project/asgi.py``, at ``/mcp``). An agent
authenticates with a bearer token (``MCP_TOKENS`` in the settings: token -> username); the
token's subject is the account every key belongs to, and the user whose charges it may refund.

- ``refund_charge`` (``recovery="retry"``): the refund row and its receipt in the outbox are
  local writes, committed with the idempotency record, so a crash leaves nothing behind and a
  retry may simply run it again.
- ``mail_refund_receipt`` (``recovery="fail"``): a mail service takes no key. A process that
  dies after the mail left leaves the outcome unknown: the retry is refused
  (``idempotency_outcome_unknown``) rather than mail twice.
- ``refund_and_mail`` (``recovery="resume"``): the refund and the mail as steps; a retry after a
  crash resumes after the last recorded step.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Sum
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict on 3.12+ only

from django_idempotency import step
from django_idempotency.mcp import idempotent_tool
from django_idempotency.outbox import enqueue
from example_project.payments import mailer
from example_project.payments.models import Charge, Refund
from example_project.payments.tasks import send_receipt

#: The lease of a tool call: a retry after a crash waits this long at most. Short in the demo
#: (``EXAMPLE_MCP_LEASE``), so that a retry after a crash resumes within seconds.
LEASE = timedelta(seconds=getattr(settings, "MCP_TOOL_LEASE", 5))


def setting(name: str) -> Any:
    """One of the MCP settings of example_project/settings.py."""
    return getattr(settings, name)


class SettingsTokenVerifier:
    """Bearer tokens from the settings (``MCP_TOKENS``: token -> username). A demo's: a real
    server verifies its authorization server's tokens (JWTs, introspection)."""

    async def verify_token(self, token: str) -> AccessToken | None:
        username = setting("MCP_TOKENS").get(token)
        if username is None:
            return None
        return AccessToken(
            token=token,
            client_id="example-agent",
            scopes=["payments"],
            subject=username,
            claims={"iss": setting("MCP_ISSUER")},
            resource=setting("MCP_RESOURCE_URL"),  # issued for this server, and no other
        )


shop = MCPServer(
    "example-payments",
    instructions=(
        "Refunds of the caller's charges. Every tool that changes something takes an "
        "idempotency_key: make a new one for each action, and send the same one again on "
        "every retry of that action."
    ),
    token_verifier=SettingsTokenVerifier(),
    auth=AuthSettings(
        issuer_url=setting("MCP_ISSUER"),
        resource_server_url=setting("MCP_RESOURCE_URL"),
        required_scopes=["payments"],
        validate_token_resource=True,
    ),
)

#: What every tool of this server tells its clients: a retry with the same key is safe.
RETRY_SAFE = ToolAnnotations(idempotent_hint=True, destructive_hint=False, open_world_hint=True)


class RefundResult(TypedDict):
    refund: int
    charge: int
    amount: int
    left: int


def customer() -> User:
    """The user the access token speaks for."""
    token = get_access_token()
    if token is None or not token.subject:
        raise ToolError("not authenticated")
    return User.objects.get(username=token.subject)


def create_refund(user_id: int, charge_id: int, amount: int, reason: str) -> RefundResult:
    """A refund of one of the user's charges, never more than is left of it."""
    with transaction.atomic():
        # Locking the charge serialises refunds of it made with different keys.
        charge = Charge.objects.select_for_update().filter(user_id=user_id, pk=charge_id).first()
        if charge is None:
            raise ToolError(f"You have no charge {charge_id}.")
        refunded = Refund.objects.filter(charge=charge).aggregate(total=Sum("amount"))["total"]
        left = charge.amount - (refunded or 0)
        if not 0 < amount <= left:
            raise ToolError(f"Only {left} is left to refund on charge {charge_id}.")
        refund = Refund.objects.create(charge=charge, amount=amount, reason=reason)
    return {"refund": refund.pk, "charge": charge.pk, "amount": amount, "left": left - amount}


# What each tool does, for the user the access token speaks for: the same whichever framework
# serves the tool (example_project/fastmcp_tools.py serves them through FastMCP).


def refund_charge_of(user: User, charge_id: int, amount: int, reason: str) -> RefundResult:
    refund = create_refund(user.pk, charge_id, amount, reason)
    # Written to the outbox with the refund, in the tool's transaction: the receipt exists
    # exactly when the refund committed (manage.py relay_outbox sends it).
    enqueue(send_receipt, refund["charge"])
    return refund


def mail_refund_receipt_of(user: User, refund_id: int) -> int:
    refund = Refund.objects.filter(charge__user=user, pk=refund_id).first()
    if refund is None:
        raise ToolError(f"You have no refund {refund_id}.")
    details = {"amount": refund.amount, "charge": refund.charge_id}
    return mail_receipt(user.email or "customer@example.com", details)


def refund_and_mail_of(user: User, charge_id: int, amount: int) -> dict[str, int]:
    refund = step("refund", create_refund, user.pk, charge_id, amount, "")
    mail = step("receipt", mail_receipt, user.email or "customer@example.com", refund)
    return {"refund": refund["refund"], "receipt": mail}


def mail_receipt(recipient: str, refund: dict[str, Any]) -> int:
    """The refund's receipt, through a mail service that takes no idempotency key."""
    return mailer.send(
        recipient,
        f"Your refund of {refund['amount']}",
        f"We refunded {refund['amount']} (minor units) on charge {refund['charge']}.",
    )


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
    return refund_charge_of(customer(), charge_id, amount, reason)


@shop.tool(annotations=RETRY_SAFE)
@idempotent_tool(recovery="fail", lease=LEASE)
def mail_refund_receipt(refund_id: int, idempotency_key: str) -> int:
    """Mail the receipt of one of your refunds again; the mail's id.

    Send the same idempotency_key on every retry. If an earlier attempt may have mailed it
    already, you get the error idempotency_outcome_unknown instead of a second mail.
    """
    return mail_refund_receipt_of(customer(), refund_id)


@shop.tool(annotations=RETRY_SAFE)
@idempotent_tool(recovery="resume", lease=LEASE)
def refund_and_mail(charge_id: int, amount: int, idempotency_key: str) -> dict[str, int]:
    """Refund `amount` (in cents) of one of your charges and mail the receipt at once.

    Send the same idempotency_key on every retry: a retry after a failure finishes what is
    left (the refund is never made twice, the mail never sent twice).
    """
    return refund_and_mail_of(customer(), charge_id, amount)
