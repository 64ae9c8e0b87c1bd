"""Protected tools served over streamable HTTP by a real server (uvicorn, in a thread of this
process), each called by its framework's own client: the SDK's ``Client`` over
``streamable_http_client`` for an ``MCPServer``, ``fastmcp.Client`` for a ``FastMCP``. Bearer
tokens authenticate the agents, so the account is the token's principal as in production.

What the in-process tests (``test_mcp``) show, over the wire: the same codes, the same
replay, the same account scoping, for a ``def`` and an ``async def`` tool; hostile keys in
``_meta``; two calls with one key at once; an agent that goes away mid-call; a tool that
raises. Effects are counted: ``RUNS`` (tool bodies entered) and ``Charge`` rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")
pytest.importorskip("uvicorn")

import anyio
import fastmcp
import httpx2
import uvicorn
from asgiref.sync import sync_to_async
from fastmcp import FastMCP
from fastmcp.server.auth import AccessToken as FastMCPToken
from fastmcp.server.auth import TokenVerifier
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer

from django_idempotency import fastmcp as fastmcp_adapter
from django_idempotency import mcp as mcp_adapter
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key, postgres_only, says_nothing_of_the_server, watching_polls
from tests.live import starting_a_server
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.servers]

WAIT = 30
ISSUER = "https://id.example"
#: Bearer token -> the subject it authenticates.
TOKENS = {"t-alice": "alice", "t-bob": "bob"}
#: Every entry into a tool body, by tool.
RUNS: list[str] = []
#: Held by the ``slow_*`` tools until set: a call in flight.
ENTERED, LEAVE = threading.Event(), threading.Event()


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    RUNS.clear()
    ENTERED.clear()
    LEAVE.clear()
    yield
    LEAVE.set()  # never leave a tool held for the next test
    RUNS.clear()


# -- the servers ------------------------------------------------------------------------------


class SdkTokens:
    async def verify_token(self, token: str) -> AccessToken | None:
        subject = TOKENS.get(token)
        if subject is None:
            return None
        return AccessToken(
            token=token, client_id="agent", scopes=[], subject=subject, claims={"iss": ISSUER}
        )


class FastMCPTokens(TokenVerifier):
    async def verify_token(self, token: str) -> FastMCPToken | None:
        subject = TOKENS.get(token)
        if subject is None:
            return None
        return FastMCPToken(
            token=token,
            client_id="agent",
            scopes=[],
            subject=subject,
            claims={"iss": ISSUER, "sub": subject},
        )


def refund_effect(tool: str, amount: int) -> dict[str, Any]:
    RUNS.append(tool)
    charge = Charge.objects.create(account=tool, amount=amount, currency="EUR")
    return {"refund": charge.pk, "amount": amount}


def held() -> None:
    ENTERED.set()
    assert LEAVE.wait(WAIT)


def add_tools(server: Any, protect: Any) -> Any:
    """The tools every test calls, on ``server``, protected by ``protect``."""
    register = server.tool

    @register()
    @protect()
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return refund_effect("refund", amount)

    @register()
    @protect()
    async def async_refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return await sync_to_async(refund_effect)("async_refund", amount)  # type: ignore[no-any-return]

    @register()
    @protect()
    def hosted_refund(order_id: int, amount: int) -> dict[str, Any]:
        """Keyed by the host's ``_meta["idempotencyKey"]``."""
        return refund_effect("hosted_refund", amount)

    @register()
    @protect()
    def slow_refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        held()
        return refund_effect("slow_refund", amount)

    @register()
    @protect()
    async def slow_async_refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        await anyio.to_thread.run_sync(held)
        return await sync_to_async(refund_effect)("slow_async_refund", amount)  # type: ignore[no-any-return]

    @register()
    @protect(wait=timedelta(seconds=WAIT))
    def patient_refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        """A duplicate in flight waits for the original's outcome."""
        held()
        return refund_effect("patient_refund", amount)

    @register()
    @protect(wait=timedelta(seconds=WAIT))
    async def patient_async_refund(
        order_id: int, amount: int, idempotency_key: str
    ) -> dict[str, Any]:
        await anyio.to_thread.run_sync(held)
        return await sync_to_async(refund_effect)("patient_async_refund", amount)  # type: ignore[no-any-return]

    @register()
    @protect()
    def declined_refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        refund_effect("declined_refund", amount)
        raise ValueError("declined by the provider")

    return server


def sdk_server() -> MCPServer:
    server = MCPServer(
        "shop",
        token_verifier=SdkTokens(),
        auth=AuthSettings(
            issuer_url=ISSUER,
            resource_server_url="http://127.0.0.1/mcp",
            validate_token_resource=False,
        ),
    )
    add_tools(server, mcp_adapter.idempotent_tool)
    return server


def fastmcp_server() -> FastMCP:
    return add_tools(FastMCP("shop", auth=FastMCPTokens()), fastmcp_adapter.idempotent_tool)  # type: ignore[no-any-return]


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` under uvicorn on a free port, in a thread; its base URL."""
    starting_a_server("uvicorn (an MCP server's app, in a thread)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped before it started"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(WAIT)


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """Each framework's server, stateless as behind a load balancer."""
    with (
        serving(sdk_server().streamable_http_app(stateless_http=True)) as sdk,
        serving(fastmcp_server().http_app(path="/mcp", stateless_http=True)) as fast,
    ):
        yield {"mcpserver": sdk, "fastmcp": fast}


@pytest.fixture(params=["mcpserver", "fastmcp"])
def framework(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(urls: dict[str, str], framework: str) -> Served:
    return Served(framework, urls[framework])


@dataclasses.dataclass(frozen=True)
class Served:
    """Where a framework's server answers: the framework says which client calls it."""

    framework: str
    url: str


# -- the agent's side ---------------------------------------------------------------------------


async def call_over_http(
    served: Served,
    name: str,
    arguments: dict[str, Any],
    *,
    token: str = "t-alice",
    meta: dict[str, Any] | None = None,
) -> Any:
    """One tool call through the framework's own client (the SDK's for ``/mcp`` of an
    ``MCPServer``, FastMCP's for a ``FastMCP``), on a connection of its own."""
    if served.framework == "fastmcp":
        async with fastmcp.Client(served.url, auth=token, timeout=WAIT) as agent:
            return await agent.call_tool(name, arguments, meta=meta, raise_on_error=False)
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=WAIT) as http,
        Client(streamable_http_client(served.url, http_client=http)) as agent,
    ):
        return await agent.call_tool(name, arguments, meta=meta)


def call(url: Served, name: str, arguments: dict[str, Any], **options: Any) -> Any:
    async def go() -> Any:
        with anyio.fail_after(WAIT):
            return await call_over_http(url, name, arguments, **options)

    return anyio.run(go)


def args(key: str | None, amount: int = 5) -> dict[str, Any]:
    arguments: dict[str, Any] = {"order_id": 1, "amount": amount}
    if key is not None:
        arguments["idempotency_key"] = key
    return arguments


def is_replay(result: Any) -> bool:
    return bool((result.meta or {}).get("idempotentReplayed"))


def refusal(result: Any, code: str) -> dict[str, Any]:
    assert result.is_error is True, result
    body = dict(result.structured_content or {})
    assert body.get("code") == code, result
    says_nothing_of_the_server(body)
    return body


def effects(tool: str) -> tuple[int, int]:
    """(bodies of ``tool`` entered, its rows committed)."""
    return RUNS.count(tool), Charge.objects.filter(account=tool).count()


# -- the same codes, the same replay, the same account -------------------------------------------


@pytest.mark.parametrize("tool", ["refund", "async_refund"])
def test_a_retry_replays_another_account_runs_its_own_and_other_arguments_are_refused(url, tool):
    key = new_key()
    first = call(url, tool, args(key))
    assert first.is_error is not True, first
    assert not is_replay(first)
    again = call(url, tool, args(key))
    assert is_replay(again), again
    assert (again.content, again.structured_content) == (first.content, first.structured_content)
    # The same key from another token is another account's action.
    bob = call(url, tool, args(key), token="t-bob")
    assert bob.is_error is not True, bob
    assert not is_replay(bob), bob
    assert bob.structured_content != first.structured_content
    refusal(call(url, tool, args(key, amount=6)), "idempotency_key_reused")
    assert effects(tool) == (2, 2)
    assert sorted(IdempotencyRecord.objects.values_list("account", flat=True)) == [
        f'mcp:sub:["{ISSUER}", "alice"]',
        f'mcp:sub:["{ISSUER}", "bob"]',
    ]


def test_the_hosts_meta_key_replays_and_hostile_ones_are_refused_leaving_nothing(url):
    for hostile in ["", "k" * 10_000, "a\x00b", " padded ", 5, True, ["a"], {"a": 1}]:
        body = refusal(
            call(url, "hosted_refund", args(None), meta={"idempotencyKey": hostile}),
            "idempotency_key_invalid",
        )
        assert len(body["detail"]) < 200, body  # the key is not echoed back
    refusal(call(url, "hosted_refund", args(None), meta={"other": "x"}), "idempotency_key_missing")
    assert effects("hosted_refund") == (0, 0)
    assert not IdempotencyRecord.objects.exists()
    key = new_key()
    first = call(url, "hosted_refund", args(None), meta={"idempotencyKey": key})
    assert first.is_error is not True, first
    assert is_replay(call(url, "hosted_refund", args(None), meta={"idempotencyKey": key}))
    assert effects("hosted_refund") == (1, 1)


def test_a_tool_that_raises_runs_again_on_the_retry_and_keeps_no_record(url):
    """An exception releases the claim (``docs/mcp.md``): its writes roll back, the retry
    runs the tool again."""
    key = new_key()
    for _ in range(2):
        result = call(url, "declined_refund", args(key))
        assert result.is_error is True, result
        assert not is_replay(result)
    assert effects("declined_refund") == (2, 0)
    assert not IdempotencyRecord.objects.exists()


# -- calls in flight ----------------------------------------------------------------------------


def in_the_background(url: Served, name: str, arguments: dict[str, Any]) -> tuple[Any, list[Any]]:
    """A call made in a thread; the thread, and the list its answer goes to."""
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(call(url, name, arguments)))
    thread.start()
    return thread, answers


@postgres_only
@pytest.mark.parametrize("tool", ["slow_refund", "slow_async_refund"])
def test_two_calls_with_one_key_at_once_run_once(url, tool):
    key = new_key()
    thread, answers = in_the_background(url, tool, args(key))
    assert ENTERED.wait(WAIT)
    body = refusal(call(url, tool, args(key)), "idempotency_key_in_use")
    assert isinstance(body["retry_after"], int), body
    assert body["retry_after"] >= 1, body
    LEAVE.set()
    thread.join(WAIT)
    (first,) = answers
    assert first.is_error is not True, first
    assert is_replay(call(url, tool, args(key)))
    assert effects(tool) == (1, 1)


@postgres_only
@pytest.mark.parametrize("tool", ["patient_refund", "patient_async_refund"])
def test_a_duplicate_that_waits_gets_the_originals_outcome_over_the_wire(url, tool):
    key = new_key()
    original, answers = in_the_background(url, tool, args(key))
    assert ENTERED.wait(WAIT)
    with watching_polls() as polls:
        duplicate, waited = in_the_background(url, tool, args(key))
        polls.wait(timeout=WAIT)  # the duplicate waits for the original, on the server
    LEAVE.set()
    original.join(WAIT)
    duplicate.join(WAIT)
    (first,), (again,) = answers, waited
    assert first.is_error is not True, first
    assert not is_replay(first)
    assert is_replay(again), again
    assert (again.content, again.structured_content) == (first.content, first.structured_content)
    assert effects(tool) == (1, 1)


@postgres_only
@pytest.mark.parametrize("tool", ["slow_refund", "slow_async_refund"])
def test_an_agent_that_goes_away_mid_call_leaves_the_attempt_running_then_replayed(url, tool):
    """The agent's HTTP connection closes while the tool runs: the attempt is not released
    (a retry meanwhile is refused as in use), it completes, and the retry gets its outcome."""
    key = new_key()

    async def go_away() -> None:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(call_over_http, url, tool, args(key))
                await anyio.to_thread.run_sync(ENTERED.wait, WAIT)
                group.cancel_scope.cancel()

    anyio.run(go_away)
    assert IdempotencyRecord.objects.get(key=key).status == RecordStatus.IN_PROGRESS
    refusal(call(url, tool, args(key)), "idempotency_key_in_use")
    LEAVE.set()
    deadline = time.monotonic() + WAIT
    while IdempotencyRecord.objects.get(key=key).status != RecordStatus.COMPLETED:
        assert time.monotonic() < deadline, "the attempt never completed"
        time.sleep(0.05)
    again = call(url, tool, args(key))
    assert again.is_error is not True, again
    assert is_replay(again), again
    assert effects(tool) == (1, 1)
