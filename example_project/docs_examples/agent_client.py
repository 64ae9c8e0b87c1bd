"""An agent's side of a protected tool, shown in the documentation (docs/mcp.md): one key per
action, made before the first call, and sent again on every retry, with each framework's own
client over streamable HTTP. ``tests/test_mcp_e2e.py`` runs both against the example project
through a proxy that loses the first answer, and counts the refunds."""

from __future__ import annotations

from typing import Any

# --8<-- [start:sdk-client]
import uuid

import anyio
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client


async def refund_with_the_sdk(url: str, token: str, charge_id: int, amount: int) -> Any:
    """Refund once, however often the answer is lost: the same key on every attempt."""
    key = str(uuid.uuid4())  # one action, one key: made once, before the first call
    arguments = {"charge_id": charge_id, "amount": amount, "idempotency_key": key}
    headers = {"Authorization": f"Bearer {token}"}
    for _ in range(5):
        try:
            async with (
                httpx2.AsyncClient(headers=headers, timeout=30) as http,
                Client(streamable_http_client(url, http_client=http)) as agent,
            ):
                result = await agent.call_tool("refund_charge", arguments)
        except Exception:  # the answer never came: a timeout, a dropped connection
            await anyio.sleep(1)
            continue
        refused = result.structured_content if result.is_error else None
        if refused and refused["code"] == "idempotency_key_in_use":
            await anyio.sleep(refused["retry_after"])  # the first attempt still runs
            continue
        return result  # the refund, or its replay: result.meta["idempotentReplayed"]
    raise TimeoutError("no answer after 5 attempts")
    # --8<-- [end:sdk-client]


# --8<-- [start:fastmcp-client]
import fastmcp


async def refund_with_fastmcp(url: str, token: str, charge_id: int, amount: int) -> Any:
    """The same with FastMCP's client."""
    key = str(uuid.uuid4())
    arguments = {"charge_id": charge_id, "amount": amount, "idempotency_key": key}
    for _ in range(5):
        try:
            async with fastmcp.Client(url, auth=token, timeout=30) as agent:
                result = await agent.call_tool("refund_charge", arguments, raise_on_error=False)
        except Exception:  # the answer never came
            await anyio.sleep(1)
            continue
        refused = result.structured_content if result.is_error else None
        if refused and refused["code"] == "idempotency_key_in_use":
            await anyio.sleep(refused["retry_after"])
            continue
        return result
    raise TimeoutError("no answer after 5 attempts")
    # --8<-- [end:fastmcp-client]
