"""``idempotent_tool`` of ``django_idempotency.mcp`` and of ``django_idempotency.fastmcp``:
agents' tool calls run once, with their effects counted, whichever framework serves the tool.

Every test talks to a server through its framework's own client, in-process (the SDK's
``Client(server)`` for an ``MCPServer``, FastMCP's ``Client(server)`` for a ``FastMCP``), so
what it sees is what an agent sees: tool results, their ``structuredContent``, ``isError`` and
``_meta``. Each behaviour is checked for a ``def`` tool and an ``async def`` tool, under each
framework (the ``kind`` fixture). The effects counted are ``RUNS`` (every entry into a tool
body), rows of ``tests.testapp.Charge`` (local writes, which commit or roll back with the
tool's record) and ``OUTSIDE`` (calls that reached "the outside world": a provider, a mail
server; nothing rolls them back).

A sync tool runs on one of the framework's worker threads, so on a database connection of its
own: the tests use a transactional database (``transaction=True``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

pytest.importorskip("mcp")
# FastMCP 4.2.3, which the fastmcp extra needs, runs on Python 3.11 and later.
pytest.importorskip("fastmcp")

import anyio
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings
from mcp import Client
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations

from django_idempotency import current, step
from django_idempotency import fastmcp as fastmcp_adapter
from django_idempotency import mcp as mcp_adapter
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.mcp import idempotent_tool
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import crash, expire_lease, record_for
from tests.helpers import (
    in_thread,
    new_key,
    packet,
    postgres_only,
    says_nothing_of_the_server,
    server_sessions,
    storm_while_held,
    watching_polls,
)
from tests.live import ROOT
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 30  # seconds: the bound on every wait in this module
ACCOUNT = "agent:tests"
KEY_DESCRIPTION = "the same value on every retry of this action"

#: Every entry into a tool body, by tag: what ran, whatever it committed.
RUNS: list[str] = []
#: Every call that reached the outside world (a provider, a mail server), by its key.
OUTSIDE: list[str] = []


@pytest.fixture(autouse=True)
def _fresh_counters() -> Iterator[None]:
    RUNS.clear()
    OUTSIDE.clear()
    yield
    RUNS.clear()
    OUTSIDE.clear()


import fastmcp  # noqa: E402
from fastmcp import FastMCP  # noqa: E402

#: A tool's kind: ``def`` (``sync``) or ``async def`` (``async``) under the SDK's
#: ``MCPServer``, and the same under FastMCP (``fastmcp-...``).
KINDS = ["sync", "async", "fastmcp-sync", "fastmcp-async"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def is_sync(kind: str) -> bool:
    return kind.rsplit("-", 1)[-1] == "sync"


def on_fastmcp(kind: str) -> bool:
    return kind.startswith("fastmcp-")


def new_server(kind: str) -> Any:
    """An empty server of the kind's framework."""
    return FastMCP("shop") if on_fastmcp(kind) else MCPServer("shop")


def protector(kind: str) -> Callable[..., Any]:
    """The kind's framework's ``idempotent_tool``."""
    return fastmcp_adapter.idempotent_tool if on_fastmcp(kind) else mcp_adapter.idempotent_tool


def registrar(server: Any, **options: Any) -> Callable[[Any], Any]:
    """The server's own tool registration, ``@server.tool(...)``."""
    return server.tool(**options)  # type: ignore[no-any-return]


def context_type(kind: str) -> type:
    return fastmcp.Context if on_fastmcp(kind) else Context


# -- the tools ---------------------------------------------------------------------------------


def refund_effect(order_id: int, amount: int) -> dict[str, Any]:
    """What the refund tools do: a local row, and a call that reached the provider."""
    RUNS.append(f"refund:{order_id}")
    OUTSIDE.append(f"refund:{order_id}")
    charge = Charge.objects.create(account="refund", amount=amount, currency="EUR")
    return {"refund": charge.pk, "order": order_id, "amount": amount}


Body = Callable[[int, int], Any]


def shop(
    kind: str,
    body: Body = refund_effect,
    *,
    hold: Callable[[], None] | None = None,
    key_argument: bool = True,
    annotations: ToolAnnotations | None = None,
    **options: Any,
) -> Any:
    """A server with one protected tool, ``refund``: ``def`` or ``async def`` (``kind``), with an
    ``idempotency_key`` argument or taking its key from ``_meta`` (``key_argument``). ``body``
    does the work (database writes included); ``hold`` (blocking) runs before it, off the event
    loop for an async tool. ``options`` go to ``idempotent_tool``; the account defaults to
    ``ACCOUNT``."""
    options.setdefault("account", ACCOUNT)
    server = new_server(kind)
    register = registrar(server, annotations=annotations)
    protect = protector(kind)(**options)

    if is_sync(kind) and key_argument:

        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            """Refund ``amount`` of an order."""
            if hold is not None:
                hold()
            return body(order_id, amount)  # type: ignore[no-any-return]

        register(protect(refund))
    elif is_sync(kind):

        def refund(order_id: int, amount: int) -> dict[str, Any]:  # type: ignore[misc]
            """Refund ``amount`` of an order."""
            if hold is not None:
                hold()
            return body(order_id, amount)  # type: ignore[no-any-return]

        register(protect(refund))
    elif key_argument:

        async def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:  # type: ignore[misc]
            """Refund ``amount`` of an order."""
            if hold is not None:
                await anyio.to_thread.run_sync(hold)
            return await sync_to_async(body)(order_id, amount)  # type: ignore[no-any-return]

        register(protect(refund))
    else:

        async def refund(order_id: int, amount: int) -> dict[str, Any]:  # type: ignore[misc]
            """Refund ``amount`` of an order."""
            if hold is not None:
                await anyio.to_thread.run_sync(hold)
            return await sync_to_async(body)(order_id, amount)  # type: ignore[no-any-return]

        register(protect(refund))
    return server


def call(
    server: Any,
    arguments: dict[str, Any],
    *,
    meta: dict[str, Any] | None = None,
    token: AccessToken | None = None,
    name: str = "refund",
) -> CallToolResult:
    """One tool call through the SDK's client, in a connection of its own, as an agent's retry
    would be. ``token``: the access token the call is authenticated with."""

    async def go() -> CallToolResult:
        with anyio.fail_after(WAIT):
            if isinstance(server, FastMCP):
                async with fastmcp.Client(server) as agent:
                    got = await agent.call_tool(name, arguments, meta=meta, raise_on_error=False)
                # FastMCP's client answers its own result type: the same fields.
                return CallToolResult(
                    content=got.content,
                    structured_content=got.structured_content,
                    is_error=got.is_error,
                    _meta=got.meta,  # type: ignore[call-arg]
                )
            async with Client(server) as client:
                return await client.call_tool(name, arguments, meta=meta)  # type: ignore[arg-type]

    if token is None:
        return anyio.run(go)
    # Set before the client connects: the in-process server's tasks start in this context,
    # as they start under the SDK's bearer middleware over HTTP.
    user = AuthenticatedUser(token)
    reset = auth_context_var.set(user)
    try:
        return anyio.run(go)
    finally:
        auth_context_var.reset(reset)


def died(server: Any, arguments: dict[str, Any], **options: Any) -> None:
    """A call whose process dies inside the tool (``crash()``): no answer reaches the agent, the
    claim stays held under its lease, as after a SIGKILL."""
    try:
        call(server, arguments, **options)
    except SimulatedCrash:
        return
    except BaseExceptionGroup as group:
        if group.subgroup(SimulatedCrash) is None:
            raise
        return
    raise AssertionError("the call answered: the process was expected to die inside the tool")


def args(key: str | None, order_id: int = 1, amount: int = 5) -> dict[str, Any]:
    arguments: dict[str, Any] = {"order_id": order_id, "amount": amount}
    if key is not None:
        arguments["idempotency_key"] = key
    return arguments


def refused(result: CallToolResult, code: str) -> dict[str, Any]:
    """The result is the refusal ``code``: an error result whose structured content says why."""
    assert result.is_error is True, result
    assert result.structured_content is not None, result
    body = dict(result.structured_content)
    assert body["code"] == code, result
    assert isinstance(body["detail"], str), result
    assert body["detail"], result
    return body


def replayed(first: CallToolResult, again: CallToolResult) -> None:
    """``again`` is ``first`` replayed: the same content, structured content and isError, and
    ``_meta`` says it is a replay. ``first`` is not marked a replay."""
    assert again.content == first.content
    assert again.structured_content == first.structured_content
    assert again.is_error == first.is_error
    assert again.meta is not None
    assert again.meta.get("idempotentReplayed") is True, again.meta
    assert not (first.meta or {}).get("idempotentReplayed"), first.meta


def ran_once(result: CallToolResult) -> None:
    assert result.is_error is not True, result
    assert not (result.meta or {}).get("idempotentReplayed"), result.meta


def effects() -> tuple[int, int, int]:
    """(bodies entered, local rows committed, calls that reached the provider)."""
    return len(RUNS), Charge.objects.count(), len(OUTSIDE)


# -- the first call and its retries ------------------------------------------------------------


def test_the_first_call_runs_and_a_retry_gets_the_same_result_marked_replayed(kind):
    server = shop(kind)
    key = new_key()
    first = call(server, args(key))
    ran_once(first)
    assert first.structured_content is not None
    assert first.structured_content["order"] == 1
    again = call(server, args(key))
    replayed(first, again)
    third = call(server, args(key))
    replayed(first, third)
    assert effects() == (1, 1, 1)
    record = record_for(key)
    assert record.status == RecordStatus.COMPLETED
    assert (record.account, record.operation) == (ACCOUNT, "tool:refund")


def test_the_key_comes_from_meta_when_the_tool_has_no_key_argument(kind):
    server = shop(kind, key_argument=False)
    key = new_key()
    first = call(server, args(None), meta={"idempotencyKey": key})
    ran_once(first)
    replayed(first, call(server, args(None), meta={"idempotencyKey": key}))
    assert effects() == (1, 1, 1)
    ran_once(call(server, args(None), meta={"idempotencyKey": new_key()}))
    assert effects() == (2, 2, 2)


def test_the_key_argument_wins_over_meta(kind):
    server = shop(kind)
    key = new_key()
    first = call(server, args(key), meta={"idempotencyKey": new_key()})
    ran_once(first)
    replayed(first, call(server, args(key), meta={"idempotencyKey": new_key()}))
    assert effects() == (1, 1, 1)


def test_another_key_is_another_action(kind):
    server = shop(kind)
    ran_once(call(server, args(new_key())))
    ran_once(call(server, args(new_key())))
    assert effects() == (2, 2, 2)


def test_arguments_in_another_order_are_the_same_call(kind):
    server = shop(kind)
    key = new_key()
    first = call(server, {"order_id": 3, "amount": 7, "idempotency_key": key})
    again = call(server, {"idempotency_key": key, "amount": 7, "order_id": 3})
    replayed(first, again)
    assert effects() == (1, 1, 1)


def test_an_error_result_the_tool_returned_is_stored_and_replayed(kind):
    def declined(order_id: int, amount: int) -> CallToolResult:
        refund_effect(order_id, amount)
        return CallToolResult(
            content=[TextContent(type="text", text="declined: over the limit")],
            structured_content={"declined": True},
            is_error=True,
        )

    server = shop(kind, declined)
    key = new_key()
    first = call(server, args(key))
    assert first.is_error is True
    assert first.content == [TextContent(type="text", text="declined: over the limit")]
    again = call(server, args(key))
    replayed(first, again)
    assert effects() == (1, 1, 1)


# -- refusals: nothing runs --------------------------------------------------------------------


@pytest.mark.usefixtures("capped")
def test_a_result_larger_than_the_database_takes_is_refused_and_rolled_back(kind):
    def huge(order_id: int, amount: int) -> dict[str, Any]:
        refund_effect(order_id, amount)
        return {"blob": "x" * (packet() + 1024 * 1024)}

    server = shop(kind, huge)
    body = refused(call(server, args(new_key())), "idempotency_response_not_storable")
    says_nothing_of_the_server(body)
    assert "max_allowed_packet" not in body["detail"]
    assert effects() == (1, 0, 1)  # ran, its row rolled back: the provider's call stays
    assert not IdempotencyRecord.objects.exists()  # released


def test_a_call_without_a_key_is_refused_and_nothing_runs(kind):
    server = shop(kind, key_argument=False)
    refused(call(server, args(None)), "idempotency_key_missing")
    refused(call(server, args(None), meta={"other": "x"}), "idempotency_key_missing")
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


def test_a_tool_with_a_key_argument_called_without_it_runs_nothing(kind):
    server = shop(kind)
    result = call(server, args(None))
    assert result.is_error is True, result
    if result.structured_content is not None:  # refused by the wrapper, not the schema's check
        assert result.structured_content["code"] == "idempotency_key_missing"
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(
    "key",
    ["x" * 256, "two words", "line\nbreak", "nul\x00byte", "caf\u00e9"],
    ids=["too-long", "space", "newline", "nul", "non-ascii"],
)
def test_an_invalid_key_argument_is_refused_and_nothing_runs(kind, key):
    server = shop(kind)
    refused(call(server, args(key)), "idempotency_key_invalid")
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("key", ["x" * 256, "two words", 42, {"k": "v"}, ["k"]], ids=str)
def test_an_invalid_meta_key_is_refused_and_nothing_runs(kind, key):
    server = shop(kind, key_argument=False)
    refused(call(server, args(None), meta={"idempotencyKey": key}), "idempotency_key_invalid")
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


def test_a_key_reused_with_other_arguments_is_refused(kind):
    server = shop(kind)
    key = new_key()
    first = call(server, args(key, amount=5))
    ran_once(first)
    refused(call(server, args(key, amount=500)), "idempotency_key_reused")
    refused(call(server, args(key, order_id=2, amount=5)), "idempotency_key_reused")
    assert effects() == (1, 1, 1)
    replayed(first, call(server, args(key, amount=5)))  # the original is still there


def test_a_meta_key_reused_with_other_arguments_is_refused(kind):
    server = shop(kind, key_argument=False)
    key = new_key()
    ran_once(call(server, args(None, amount=5), meta={"idempotencyKey": key}))
    refused(
        call(server, args(None, amount=6), meta={"idempotencyKey": key}),
        "idempotency_key_reused",
    )
    assert effects() == (1, 1, 1)


def crashing(order_id: int, amount: int) -> Any:
    """The work is done, the provider reached, then the process dies before the answer."""
    refund_effect(order_id, amount)
    crash()


def test_a_call_while_another_attempt_holds_the_lease_is_refused_in_use(kind):
    server = shop(kind, crashing, lease=timedelta(seconds=60))
    key = new_key()
    died(server, args(key))  # its claim stays, its lease runs
    assert effects() == (1, 0, 1)  # the local write rolled back; the provider was reached
    body = refused(call(server, args(key)), "idempotency_key_in_use")
    assert isinstance(body["retry_after"], int)
    assert not isinstance(body["retry_after"], bool)
    assert 1 <= body["retry_after"] <= 60
    assert effects() == (1, 0, 1)
    # The lease runs out: under the default "retry" the next call runs it again.
    expire_lease(key)
    again = shop(kind)
    first = call(again, args(key))
    ran_once(first)
    assert effects() == (2, 1, 2)
    replayed(first, call(again, args(key)))
    assert effects() == (2, 1, 2)


def test_wait_is_bounded_when_the_original_never_answers(kind):
    server = shop(kind, crashing, lease=timedelta(seconds=60))
    key = new_key()
    died(server, args(key))
    waiting = shop(kind, lease=timedelta(seconds=60), wait=timedelta(seconds=1))
    started = time.monotonic()
    refused(call(waiting, args(key)), "idempotency_key_in_use")
    waited = time.monotonic() - started
    assert 0.8 <= waited < 10, waited
    assert effects() == (1, 0, 1)


def test_a_record_closed_by_the_fail_policy_is_refused_as_outcome_unknown(kind):
    server = shop(kind, crashing, recovery="fail")
    key = new_key()
    died(server, args(key))
    expire_lease(key)
    retry = shop(kind, recovery="fail")
    for _ in range(2):
        refused(call(retry, args(key)), "idempotency_outcome_unknown")
    assert effects() == (1, 0, 1)  # the provider was reached once; never again
    assert record_for(key).status == RecordStatus.FAILED


def test_an_unreadable_stored_outcome_is_refused_and_nothing_runs(kind):
    fernet = pytest.importorskip("cryptography.fernet")
    sealing, other = fernet.Fernet.generate_key().decode(), fernet.Fernet.generate_key().decode()
    server = shop(kind)
    key = new_key()
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [sealing]}):
        first = call(server, args(key))
    ran_once(first)
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [other]}):
        refused(call(server, args(key)), "idempotency_record_unreadable")
        refused(call(server, args(key)), "idempotency_record_unreadable")
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": []}):
        says_nothing_of_the_server(
            refused(call(server, args(key)), "idempotency_record_unreadable")
        )
    assert effects() == (1, 1, 1)
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [other, sealing]}):
        replayed(first, call(server, args(key)))
    assert effects() == (1, 1, 1)


def test_an_unreachable_store_is_refused_and_nothing_runs(kind, unreachable_store):
    server = shop(kind)
    body = refused(call(server, args(new_key())), "idempotency_store_unavailable")
    says_nothing_of_the_server(body)
    assert "not run" in body["detail"]
    assert len(RUNS) == 0


def tenant_from_the_database(context: Context | fastmcp.Context) -> str:
    """An account callable that reads the database: the caller's tenant."""
    return f"tenant:{Charge.objects.count()}"


def test_an_account_read_from_an_unreachable_store_is_refused_and_nothing_runs(
    kind, unreachable_store
):
    """Naming the caller read the database, which cannot be reached: the store's refusal,
    saying nothing ran (never the database's error text in a tool error)."""
    from django_idempotency import _problems

    server = shop(kind, account=tenant_from_the_database)
    body = refused(call(server, args(new_key())), "idempotency_store_unavailable")
    says_nothing_of_the_server(body)
    assert body["detail"] == _problems.NOT_RUN
    assert len(RUNS) == 0


# -- the account -------------------------------------------------------------------------------


def tenant(context: Context | fastmcp.Context) -> str:
    """An account callable: the tenant the host put in the call's ``_meta``."""
    assert isinstance(context, (Context, fastmcp.Context))
    assert context.request_context is not None
    meta = dict(context.request_context.meta or {})
    return f"tenant:{meta['tenant']}"


def test_an_account_callable_gets_the_context_and_separates_accounts(kind):
    server = shop(kind, key_argument=False, account=tenant)
    key = new_key()
    first = call(server, args(None), meta={"idempotencyKey": key, "tenant": "a"})
    ran_once(first)
    ran_once(call(server, args(None), meta={"idempotencyKey": key, "tenant": "b"}))
    assert effects() == (2, 2, 2)
    replayed(first, call(server, args(None), meta={"idempotencyKey": key, "tenant": "a"}))
    assert effects() == (2, 2, 2)
    assert set(IdempotencyRecord.objects.values_list("account", flat=True)) == {
        "tenant:a",
        "tenant:b",
    }


@pytest.mark.parametrize("answer", ["", None], ids=["empty", "none"])
def test_an_account_callable_without_an_answer_refuses(kind, answer):
    # "" is what the docs' account example answers for a caller without an organisation:
    # refused with the HTTP side's code, never a generic error.
    server = shop(kind, account=lambda context: answer)
    body = refused(call(server, args(new_key())), "idempotency_account_missing")
    assert "authenticated caller" in body["detail"]
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


def test_an_account_callable_answering_no_string_refuses_and_logs_the_defect(kind, caplog):
    # The HTTP side's code for an account resolver's wrong answer: the project's defect, not
    # a caller without an account.
    server = shop(kind, account=lambda context: 42)
    with caplog.at_level(logging.ERROR, logger="django_idempotency"):
        body = refused(call(server, args(new_key())), "idempotency_account_invalid")
    assert "authenticated caller" not in body["detail"]
    assert "answered 'int'" in caplog.text
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


def token(client_id: str, subject: str | None = None, issuer: str | None = None) -> AccessToken:
    return AccessToken(
        token=new_key(),
        client_id=client_id,
        scopes=[],
        subject=subject,
        claims={"iss": issuer} if issuer is not None else None,
    )


def test_the_default_account_is_the_access_tokens_principal(kind):
    server = shop(kind, account=None)
    key = new_key()
    alice = token("agent-app", subject="alice", issuer="https://id.example.com")
    bob = token("agent-app", subject="bob", issuer="https://id.example.com")
    first = call(server, args(key), token=alice)
    ran_once(first)
    ran_once(call(server, args(key), token=bob))  # the same key, another principal
    assert effects() == (2, 2, 2)
    # A new token of the same principal (same issuer and subject) replays.
    again = call(server, args(key), token=token("other-app", "alice", "https://id.example.com"))
    replayed(first, again)
    assert effects() == (2, 2, 2)
    accounts = list(IdempotencyRecord.objects.values_list("account", flat=True))
    assert len(set(accounts)) == 2
    assert any("alice" in account for account in accounts)


def test_the_same_subject_of_another_issuer_is_another_account(kind):
    server = shop(kind, account=None)
    key = new_key()
    ran_once(call(server, args(key), token=token("app", "alice", "https://a.example.com")))
    ran_once(call(server, args(key), token=token("app", "alice", "https://b.example.com")))
    assert effects() == (2, 2, 2)


def test_a_token_without_a_subject_is_its_client_ids_and_cannot_pose_as_a_subject(kind):
    server = shop(kind, account=None)
    key = new_key()
    first = call(server, args(key), token=token("alice"))
    ran_once(first)
    replayed(first, call(server, args(key), token=token("alice")))
    # A client whose id spells a user's subject never gets that user's outcome, nor gives its.
    ran_once(call(server, args(key), token=token("someone", subject="alice")))
    assert effects() == (2, 2, 2)


def test_without_an_account_the_call_is_refused_and_nothing_runs(kind):
    server = shop(kind, account=None)
    result = call(server, args(new_key()))  # no access token: nobody authenticated
    assert result.is_error is True, result
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


# -- exceptions, rollback, operation, current() ------------------------------------------------


def test_an_exception_rolls_the_tools_writes_back_and_releases_the_claim(kind):
    def fails(order_id: int, amount: int) -> Any:
        RUNS.append("fails")
        Charge.objects.create(account="refund", amount=amount, currency="EUR")
        raise LookupError("the provider said no")

    server = shop(kind, fails)
    key = new_key()
    result = call(server, args(key))
    assert result.is_error is True
    assert not (result.meta or {}).get("idempotentReplayed")
    assert Charge.objects.count() == 0  # rolled back with the claim
    assert not IdempotencyRecord.objects.filter(key=key).exists()  # released
    again = call(server, args(key))  # the next call runs again
    assert again.is_error is True
    assert RUNS == ["fails", "fails"]
    fixed = shop(kind)
    ran_once(call(fixed, args(key)))
    assert effects() == (3, 1, 1)


def test_the_tools_writes_commit_with_its_record(kind):
    server = shop(kind)
    key = new_key()
    ran_once(call(server, args(key)))
    record = record_for(key)
    assert record.status == RecordStatus.COMPLETED
    assert Charge.objects.count() == 1


def test_current_names_the_running_tool_call_and_operation_can_be_set(kind):
    seen: list[tuple[str, str, str, str, bool]] = []

    def look(order_id: int, amount: int) -> dict[str, Any]:
        context = current()
        assert context is not None
        seen.append(
            (
                context.key,
                context.operation,
                context.account,
                context.downstream_key("psp"),
                context.replayed,
            )
        )
        return refund_effect(order_id, amount)

    key = new_key()
    ran_once(call(shop(kind, look), args(key)))
    ran_once(call(shop(kind, look, operation="refunds.create"), args(key)))
    assert [(k, op, account) for k, op, account, _, _ in seen] == [
        (key, "tool:refund", ACCOUNT),
        (key, "refunds.create", ACCOUNT),
    ]
    assert seen[0][3] != seen[1][3]  # another operation, another downstream key
    assert not seen[0][4]
    assert effects() == (2, 2, 2)


def test_required_false_runs_a_call_without_a_key_unprotected_and_protects_one_with_it(kind):
    server = shop(kind, key_argument=False, required=False)
    ran_once(call(server, args(None)))
    ran_once(call(server, args(None)))
    assert effects() == (2, 2, 2)
    assert not IdempotencyRecord.objects.exists()
    key = new_key()
    first = call(server, args(None), meta={"idempotencyKey": key})
    replayed(first, call(server, args(None), meta={"idempotencyKey": key}))
    assert effects() == (3, 3, 3)
    refused(
        call(server, args(None), meta={"idempotencyKey": "two words"}), "idempotency_key_invalid"
    )
    assert effects() == (3, 3, 3)


# -- steps under recovery="resume" -------------------------------------------------------------

CRASH_AFTER_MAIL = threading.Event()


def in_steps(order_id: int, amount: int) -> dict[str, Any]:
    """A refund and its mail, each a step; the process may die after the mail."""
    RUNS.append("body")
    context = current()
    assert context is not None
    refund = step("refund", refund_effect, order_id, amount)
    mail = step("mail", mail_effect, context.downstream_key("mail"))
    if CRASH_AFTER_MAIL.is_set():
        crash()
    return {"refund": refund["refund"], "mail": mail}


def mail_effect(key: str) -> int:
    OUTSIDE.append(f"mail:{key}")
    return len(OUTSIDE)


def test_steps_resume_after_a_crash_and_no_effect_repeats(kind):
    server = shop(kind, in_steps, recovery="resume", lease=timedelta(seconds=60))
    key = new_key()
    CRASH_AFTER_MAIL.set()
    try:
        died(server, args(key))
    finally:
        CRASH_AFTER_MAIL.clear()
    # Both steps are recorded: a refund row committed with its step, and one mail.
    assert Charge.objects.count() == 1
    assert len([call for call in OUTSIDE if call.startswith("mail:")]) == 1
    refused(call(server, args(key)), "idempotency_key_in_use")  # its lease still runs
    expire_lease(key)
    first = call(server, args(key))
    ran_once(first)
    replayed(first, call(server, args(key)))
    assert RUNS.count("body") == 2
    assert RUNS.count("refund:1") == 1  # the refund step was not run again
    assert Charge.objects.count() == 1
    assert len(OUTSIDE) == 2  # one refund, one mail, with one key
    assert len(set(OUTSIDE)) == 2
    assert first.structured_content is not None
    assert first.structured_content["refund"] == Charge.objects.get().pk


def test_a_step_that_raises_keeps_the_recorded_steps_and_the_next_call_resumes(kind):
    failures = [LookupError("mail server down")]

    def flaky_mail(key: str) -> int:
        if failures:
            raise failures.pop()
        return mail_effect(key)

    def body(order_id: int, amount: int) -> dict[str, Any]:
        context = current()
        assert context is not None
        refund = step("refund", refund_effect, order_id, amount)
        step("mail", flaky_mail, context.downstream_key("mail"))
        return {"refund": refund["refund"]}

    server = shop(kind, body, recovery="resume")
    key = new_key()
    assert call(server, args(key)).is_error is True
    assert effects() == (1, 1, 1)
    ran_once(call(server, args(key)))  # resumes at once: the lease was given back
    assert effects() == (1, 1, 2)


# -- the schema and the listing ----------------------------------------------------------------


def list_tools(server: Any) -> list[Any]:
    async def go() -> list[Any]:
        with anyio.fail_after(WAIT):
            if isinstance(server, FastMCP):
                async with fastmcp.Client(server) as agent:
                    return list(await agent.list_tools())
            async with Client(server) as client:
                return list((await client.list_tools()).tools)

    return anyio.run(go)


def test_the_schema_keeps_the_parameters_and_describes_the_key(kind):
    (tool,) = list_tools(shop(kind, annotations=ToolAnnotations(idempotent_hint=True)))
    schema = tool.input_schema
    assert set(schema["properties"]) == {"order_id", "amount", "idempotency_key"}
    assert schema["properties"]["order_id"]["type"] == "integer"
    assert {"order_id", "amount"} <= set(schema.get("required", []))
    description = schema["properties"]["idempotency_key"].get("description", "")
    assert KEY_DESCRIPTION in description.lower(), schema
    assert tool.name == "refund"
    assert tool.description
    assert "Refund" in tool.description
    assert tool.annotations is not None
    assert tool.annotations.idempotent_hint is True


def test_a_tool_keyed_by_meta_lists_only_its_own_parameters(kind):
    (tool,) = list_tools(shop(kind, key_argument=False))
    assert set(tool.input_schema["properties"]) == {"order_id", "amount"}


def test_a_tool_taking_the_context_still_gets_it(kind):
    server = new_server(kind)
    register = registrar(server)
    protect = protector(kind)(account=ACCOUNT)
    expected = context_type(kind)
    if is_sync(kind):

        def note(text: str, idempotency_key: str, ctx: Context) -> str:
            assert isinstance(ctx, expected)
            RUNS.append(text)
            return f"noted {text}"

    else:

        async def note(text: str, idempotency_key: str, ctx: Context) -> str:  # type: ignore[misc]
            assert isinstance(ctx, expected)
            RUNS.append(text)
            return f"noted {text}"

    # Each framework finds the context argument by its annotation: its own Context class.
    note.__annotations__["ctx"] = expected
    register(protect(note))

    (tool,) = list_tools(server)
    assert set(tool.input_schema["properties"]) == {"text", "idempotency_key"}
    key = new_key()
    first = call(server, {"text": "hi", "idempotency_key": key}, name="note")
    ran_once(first)
    assert first.content == [TextContent(type="text", text="noted hi")]
    replayed(first, call(server, {"text": "hi", "idempotency_key": key}, name="note"))
    assert RUNS == ["hi"]


def test_arguments_are_checked_before_the_decorator_is_used():
    with pytest.raises((TypeError, ValueError, ImproperlyConfigured)):
        idempotent_tool(recovery="Fail")
    with pytest.raises((TypeError, ValueError, ImproperlyConfigured)):
        idempotent_tool(ttl=timedelta(0))
    with pytest.raises((TypeError, ValueError, ImproperlyConfigured)):
        idempotent_tool(lease=True)  # type: ignore[arg-type]


# -- concurrency: PostgreSQL -------------------------------------------------------------------


def held_original(kind: str, **options: Any) -> tuple[MCPServer, threading.Event, threading.Event]:
    """A server whose tool blocks after it started until ``leave`` is set."""
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        assert leave.wait(WAIT)

    return shop(kind, hold=hold, lease=timedelta(seconds=60), **options), entered, leave


@postgres_only
def test_a_duplicate_in_flight_is_refused_at_once_and_the_original_completes(kind):
    server, entered, leave = held_original(kind)
    key = new_key()
    results: list[CallToolResult] = []
    original = threading.Thread(target=in_thread(lambda: results.append(call(server, args(key)))))
    original.start()
    try:
        assert entered.wait(WAIT)
        started = time.monotonic()
        body = refused(call(shop(kind), args(key)), "idempotency_key_in_use")
        assert time.monotonic() - started < 10  # not a wait on the original's locks
        assert body["retry_after"] >= 1
    finally:
        leave.set()
        original.join(WAIT)
    assert not original.is_alive()
    (first,) = results
    ran_once(first)
    replayed(first, call(shop(kind), args(key)))
    assert effects() == (1, 1, 1)


@postgres_only
def test_wait_lets_a_duplicate_in_flight_get_the_originals_outcome(kind):
    server, entered, leave = held_original(kind)
    key = new_key()
    results: dict[str, CallToolResult] = {}

    def duplicate() -> None:
        results["duplicate"] = call(shop(kind, wait=timedelta(seconds=WAIT)), args(key))

    original = threading.Thread(
        target=in_thread(lambda: results.__setitem__("original", call(server, args(key))))
    )
    original.start()
    waiting = threading.Thread(target=in_thread(duplicate))
    try:
        assert entered.wait(WAIT)
        with watching_polls() as polls:
            waiting.start()
            polls.wait(timeout=WAIT)  # the duplicate waits for the original now
        assert waiting.is_alive()
    finally:
        leave.set()
        original.join(WAIT)
        if waiting.ident is not None:
            waiting.join(WAIT)
    assert not original.is_alive()
    assert not waiting.is_alive()
    ran_once(results["original"])
    replayed(results["original"], results["duplicate"])
    assert effects() == (1, 1, 1)


def connections_in_use() -> int:
    """The test database's connections in use by this process's threads: checked out of
    Django's pool where it has one, else the server's client backends (this read's own left
    out)."""
    if connection.settings_dict["OPTIONS"].get("pool"):
        stats = connection.pool.get_stats()
        return int(stats["pool_size"]) - int(stats["pool_available"])
    return server_sessions()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="counts PostgreSQL's connections")
@pytest.mark.parametrize("account", ["named", "looked up"])
def test_a_duplicate_that_waits_holds_no_connection_while_it_waits(kind, account):
    server, entered, leave = held_original(kind)
    key = new_key()
    results: dict[str, CallToolResult] = {}

    def looked_up(context: Any) -> str:
        """An account callable that reads the database (the token's subject's user), as the
        docs' example does: the call's thread opens a connection before its claim."""
        Charge.objects.filter(account="nobody").exists()
        return ACCOUNT

    def duplicate() -> None:
        options: dict[str, Any] = {"account": looked_up} if account == "looked up" else {}
        waiting_shop = shop(kind, wait=timedelta(seconds=WAIT), **options)
        results["duplicate"] = call(waiting_shop, args(key))

    original = threading.Thread(
        target=in_thread(lambda: results.__setitem__("original", call(server, args(key))))
    )
    original.start()
    waiting = threading.Thread(target=in_thread(duplicate))
    try:
        assert entered.wait(WAIT)
        before = connections_in_use()  # the original's, inside its transaction
        with watching_polls() as polls:
            waiting.start()
            polls.wait(timeout=WAIT)  # the duplicate waits for the original now
        during = []
        for _ in range(10):
            time.sleep(0.1)
            during.append(connections_in_use())
        assert waiting.is_alive()
    finally:
        leave.set()
        original.join(WAIT)
        if waiting.ident is not None:
            waiting.join(WAIT)
    # Between its reads (a few milliseconds each) the duplicate holds no connection: a
    # burst of duplicates that wait cannot take every connection of the pool or the server.
    assert min(during) == before, (before, during)
    ran_once(results["original"])
    replayed(results["original"], results["duplicate"])
    assert effects() == (1, 1, 1)


@postgres_only
def test_a_storm_of_identical_calls_runs_once(kind):
    server, entered, leave = held_original(kind)
    key = new_key()
    results: list[CallToolResult] = storm_while_held(
        lambda: call(server, args(key)), 8, entered, leave, WAIT
    )
    (first,) = [
        r for r in results if not r.is_error and not (r.meta or {}).get("idempotentReplayed")
    ]
    for result in results:
        if result is first:
            continue
        if result.is_error:
            refused(result, "idempotency_key_in_use")
        else:
            replayed(first, result)  # arrived after the original had completed
    assert effects() == (1, 1, 1)


# -- the documentation's tools (example_project/docs_examples/agent_tools.py) --------------------


@pytest.fixture
def docs_tools() -> Iterator[Any]:
    pytest.importorskip(
        "example_project.docs_examples", reason="the example project is not here (tox: wheel)"
    )
    from example_project.docs_examples import agent_tools

    agent_tools.provider.__init__()  # type: ignore[misc]
    yield agent_tools
    agent_tools.provider.__init__()  # type: ignore[misc]


def test_the_docs_refund_tool_refunds_once_per_key_and_is_listed_safe_to_retry(docs_tools):
    provider = docs_tools.provider
    alice = token("agent-app", subject="alice", issuer="https://id.example.com")
    key = new_key()
    arguments = {"order_id": 7, "amount": 250, "idempotency_key": key}
    first = call(docs_tools.shop, arguments, token=alice, name="refund")
    ran_once(first)
    replayed(first, call(docs_tools.shop, arguments, token=alice, name="refund"))
    assert len(provider.calls) == 1
    refused(
        call(docs_tools.shop, {**arguments, "amount": 1}, token=alice, name="refund"),
        "idempotency_key_reused",
    )
    result = call(docs_tools.shop, arguments, name="refund")  # no token: no account
    assert result.is_error is True
    assert len(provider.calls) == 1
    tools = {tool.name: tool for tool in list_tools(docs_tools.shop)}
    assert set(tools) == {"refund", "send_invoice", "cancel_order"}
    for tool in tools.values():
        assert tool.annotations.idempotent_hint is True
    key_schema = tools["refund"].input_schema["properties"]["idempotency_key"]
    assert KEY_DESCRIPTION in key_schema["description"].lower()
    assert "idempotency_key" not in tools["send_invoice"].input_schema["properties"]


def test_the_docs_fastmcp_refund_tool_refunds_once_per_key(docs_tools):
    provider = docs_tools.provider
    alice = token("agent-app", subject="alice", issuer="https://id.example.com")
    arguments = {"order_id": 7, "amount": 250, "idempotency_key": new_key()}
    first = call(docs_tools.fast_shop, arguments, token=alice, name="refund_order")
    ran_once(first)
    replayed(first, call(docs_tools.fast_shop, arguments, token=alice, name="refund_order"))
    assert len(provider.calls) == 1
    refused(
        call(docs_tools.fast_shop, {**arguments, "amount": 1}, token=alice, name="refund_order"),
        "idempotency_key_reused",
    )
    refused(
        call(docs_tools.fast_shop, arguments, name="refund_order"),  # no token: no account
        "idempotency_account_missing",
    )
    assert len(provider.calls) == 1
    (tool,) = list_tools(docs_tools.fast_shop)
    assert tool.annotations.idempotent_hint is True
    key_schema = tool.input_schema["properties"]["idempotency_key"]
    assert KEY_DESCRIPTION in key_schema["description"].lower()


def test_one_token_is_one_account_whichever_framework_serves_the_tool(docs_tools):
    alice = token("agent-app", subject="alice", issuer="https://id.example.com")
    key = new_key()
    call(
        docs_tools.shop,
        {"order_id": 1, "amount": 2, "idempotency_key": key},
        token=alice,
        name="refund",
    )
    call(
        docs_tools.fast_shop,
        {"order_id": 1, "amount": 2, "idempotency_key": key},
        token=alice,
        name="refund_order",
    )
    assert set(IdempotencyRecord.objects.values_list("account", flat=True)) == {
        'mcp:sub:["https://id.example.com", "alice"]'
    }


def test_the_docs_invoice_tool_is_keyed_by_the_host_and_shared_by_an_organisation(docs_tools):
    provider = docs_tools.provider
    key = new_key()
    meta = {"idempotencyKey": key}
    ada = token("app", subject="ada", issuer="https://id.example.com")
    ada.claims = {"iss": "https://id.example.com", "org": "acme"}
    bob = token("app", subject="bob", issuer="https://id.example.com")
    bob.claims = {"iss": "https://id.example.com", "org": "acme"}
    eve = token("app", subject="eve", issuer="https://id.example.com")
    eve.claims = {"iss": "https://id.example.com", "org": "initech"}
    first = call(docs_tools.shop, {"invoice_id": 3}, meta=meta, token=ada, name="send_invoice")
    ran_once(first)
    # Another agent of the same organisation retries with the host's key: the same invoice.
    replayed(
        first, call(docs_tools.shop, {"invoice_id": 3}, meta=meta, token=bob, name="send_invoice")
    )
    assert provider.mails == [3]
    ran_once(call(docs_tools.shop, {"invoice_id": 3}, meta=meta, token=eve, name="send_invoice"))
    assert provider.mails == [3, 3]
    nobody = token("app", subject="mallory")  # no organisation
    refusal = call(docs_tools.shop, {"invoice_id": 3}, meta=meta, token=nobody, name="send_invoice")
    assert refusal.is_error is True
    refused(
        call(docs_tools.shop, {"invoice_id": 3}, token=ada, name="send_invoice"),
        "idempotency_key_missing",
    )
    assert provider.mails == [3, 3]


def test_the_docs_cancel_tool_resumes_after_a_crash_without_a_second_refund(
    docs_tools, monkeypatch
):
    provider = docs_tools.provider
    alice = token("agent-app", subject="alice", issuer="https://id.example.com")
    arguments = {"order_id": 9, "idempotency_key": new_key()}
    with monkeypatch.context() as patched:
        patched.setattr(provider, "mail", lambda order_id: crash())  # dies before the mail
        died(docs_tools.shop, arguments, token=alice, name="cancel_order")
    assert (len(provider.calls), provider.mails) == (1, [])
    expire_lease(arguments["idempotency_key"])
    first = call(docs_tools.shop, arguments, token=alice, name="cancel_order")
    ran_once(first)
    replayed(first, call(docs_tools.shop, arguments, token=alice, name="cancel_order"))
    assert (len(provider.calls), provider.mails) == (1, [9])  # the refund step was not run again


# -- found by a hostile review ------------------------------------------------------------------


def test_the_decorator_above_server_tool_is_refused_when_it_is_applied():
    # The server registered the bare function: two calls with one key would run twice.
    server = MCPServer("shop")
    with pytest.raises(ImproperlyConfigured, match=r"beneath @server\.tool"):

        @idempotent_tool(account="tenant:a")
        @server.tool()
        def refund(order_id: int, idempotency_key: str) -> dict[str, Any]:
            raise AssertionError("never called")

    assert Charge.objects.count() == 0


class Registry:
    """A project's holder of its server: the server is one attribute away."""

    def __init__(self) -> None:
        self.server = MCPServer("shop")


REGISTRY = Registry()


def test_the_decorator_above_a_server_reached_through_an_attribute_is_refused():
    local = Registry()
    for registry in (REGISTRY, local):
        with pytest.raises(ImproperlyConfigured, match=r"beneath @server\.tool"):

            @idempotent_tool(account="tenant:a")
            @registry.server.tool()
            def refund(order_id: int, idempotency_key: str) -> dict[str, Any]:
                raise AssertionError("never called")


def test_the_decorator_above_fastmcps_tool_is_refused_when_it_is_applied():
    server = FastMCP("shop")
    holder = Registry()
    holder.server = server  # type: ignore[assignment]
    for register in (server.tool, server.tool(), holder.server.tool(name="refund")):
        with pytest.raises(ImproperlyConfigured, match=r"beneath @server\.tool"):

            @fastmcp_adapter.idempotent_tool(account="tenant:a")
            @register
            def refund(order_id: int, idempotency_key: str) -> dict[str, Any]:
                raise AssertionError("never called")


def test_the_other_frameworks_decorator_above_a_servers_tool_is_refused_when_it_is_applied():
    """The wrong adapter, and above: the server holds the bare function all the same, and a
    retry would refund twice. Refused where it is written, naming the adapter to use."""
    fast, sdk = FastMCP("shop"), MCPServer("shop")
    with pytest.raises(ImproperlyConfigured, match=r"beneath @server\.tool.*fastmcp"):

        @idempotent_tool(account="tenant:a")
        @fast.tool
        def refund(order_id: int, idempotency_key: str) -> dict[str, Any]:
            raise AssertionError("never called")

    with pytest.raises(ImproperlyConfigured, match=r"beneath @server\.tool.*mcp\.idempotent"):

        @fastmcp_adapter.idempotent_tool(account="tenant:a")
        @sdk.tool()
        def cancel(order_id: int, idempotency_key: str) -> dict[str, Any]:
            raise AssertionError("never called")

    # Beneath, each framework's adapter under its own server is left as it was.
    for server, adapter in ((FastMCP("shop"), fastmcp_adapter), (MCPServer("shop"), mcp_adapter)):
        ran_once(call(shop_with(server, adapter), args(new_key())))
    assert effects() == (2, 2, 2)


def shop_with(server: Any, adapter: Any) -> Any:
    @server.tool()
    @adapter.idempotent_tool(account=ACCOUNT)
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    return server


@pytest.mark.parametrize("bare", ["bare", "a class"])
def test_the_decorator_without_its_parentheses_or_on_a_class_is_refused(kind, bare):
    def refund(order_id: int, idempotency_key: str) -> dict[str, Any]:
        raise AssertionError("never called")

    decorate = (
        (lambda: protector(kind)(refund))
        if bare == "bare"
        else (lambda: protector(kind)(account="tenant:a")(Registry))
    )
    with pytest.raises((ImproperlyConfigured, TypeError)):
        decorate()


def test_an_argument_named_as_the_adapters_context_is_refused():
    def tool(n: int, idempotency_context: str, idempotency_key: str) -> dict[str, int]:
        return {"n": n}

    with pytest.raises(ImproperlyConfigured, match="idempotency_context"):
        idempotent_tool(account="tenant:a")(tool)


SET_FINGERPRINT = (
    "import django, json; django.setup(); from django_idempotency._tools import canonical; "
    "print(json.dumps(canonical({'tags': {'alpha', 'beta', 'gamma', 'delta', 'eps', 'zeta'}})))"
)


def test_a_set_argument_fingerprints_alike_in_every_process():
    # A set's own order follows the hash seed: a retry reaching another server process
    # must not be refused as a reused key.
    import os
    import subprocess

    seen = {
        subprocess.run(
            [sys.executable, "-c", SET_FINGERPRINT],
            env={
                **os.environ,
                "PYTHONHASHSEED": str(seed),
                "DJANGO_SETTINGS_MODULE": "tests.settings",
                "PYTHONPATH": str(ROOT),
            },
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(6)
    }
    assert seen == {'{"tags": ["alpha", "beta", "delta", "eps", "gamma", "zeta"]}\n'}


def paying(kind: str, annotation: Any, runs: list[Any]) -> Any:
    """A server with one protected sync tool ``pay(amount: <annotation>, idempotency_key)``."""
    server = new_server(kind)

    def pay(amount: Any, idempotency_key: str) -> dict[str, bool]:
        runs.append(amount)
        return {"ok": True}

    pay.__annotations__["amount"] = annotation
    registrar(server)(protector(kind)(account="tenant:a")(pay))
    return server


@pytest.mark.parametrize("kind", ["sync", "fastmcp-sync"])
def test_a_whole_float_and_its_integer_are_the_same_call(kind):
    runs: list[float] = []
    server = paying(kind, int | float, runs)
    key = new_key()
    first = call(server, {"amount": 1, "idempotency_key": key}, name="pay")
    again = call(server, {"amount": 1.0, "idempotency_key": key}, name="pay")
    replayed(first, again)
    assert runs == [1]


@pytest.mark.parametrize("kind", ["sync", "fastmcp-sync"])
@pytest.mark.parametrize(
    ("sent", "again"),
    [(1, 1.0), ("1", "1.0"), ("1.5", "1.50"), ("2.50", 2.5), ("1E+1", 10)],
    ids=str,
)
def test_every_spelling_of_one_decimal_amount_is_the_same_call(kind, sent, again):
    # The docs say 1 and 1.0 are one call: so are "1" and "1.0" for a Decimal argument.
    runs: list[Decimal] = []
    server = paying(kind, Decimal, runs)
    key = new_key()
    first = call(server, {"amount": sent, "idempotency_key": key}, name="pay")
    ran_once(first)
    replayed(first, call(server, {"amount": again, "idempotency_key": key}, name="pay"))
    assert len(runs) == 1


@pytest.mark.parametrize("kind", ["sync", "fastmcp-sync"])
def test_two_decimal_amounts_are_two_calls(kind):
    runs: list[Decimal] = []
    server = paying(kind, Decimal, runs)
    key = new_key()
    ran_once(call(server, {"amount": "1.5", "idempotency_key": key}, name="pay"))
    refused(
        call(server, {"amount": "1.51", "idempotency_key": key}, name="pay"),
        "idempotency_key_reused",
    )
    assert len(runs) == 1


def test_a_call_that_outlives_its_lease_is_logged(kind, caplog):
    # With wait=, a duplicate whose original outlives its lease takes the lease over and runs
    # the tool again: the product says so where it sees it, at the end of the long call.
    def slow(order_id: int, amount: int) -> dict[str, Any]:
        time.sleep(1.2)
        return refund_effect(order_id, amount)

    server = shop(kind, slow, lease=timedelta(seconds=1))
    with caplog.at_level(logging.WARNING, logger="django_idempotency"):
        ran_once(call(server, args(new_key())))
    assert "longer than its lease (1.0 s)" in caplog.text
    assert "@idempotent_tool(lease=...)" in caplog.text


def test_an_infinite_float_runs_once_and_is_replayed():
    runs: list[float] = []
    server = MCPServer("shop")

    @server.tool()
    @idempotent_tool(account="tenant:a")
    def pay(amount: float, idempotency_key: str) -> dict[str, bool]:
        runs.append(amount)
        return {"ok": True}

    key = new_key()
    first = call(server, {"amount": "inf", "idempotency_key": key}, name="pay")
    again = call(server, {"amount": "inf", "idempotency_key": key}, name="pay")
    replayed(first, again)
    assert runs == [float("inf")]
