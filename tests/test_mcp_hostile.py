"""Attacks on ``idempotent_tool`` of both frameworks, beyond ``test_mcp``: tools written the
ways users write them (injected parameters, registered names, optional keys, odd return
values), registration options, mounted servers. Effects are counted as in ``test_mcp``:
``RUNS`` (tool bodies entered), ``Charge`` rows, ``OUTSIDE`` (provider calls)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import types
from datetime import timedelta
from typing import Annotated, Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")

import anyio
import fastmcp
import pydantic
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from fastmcp import FastMCP
from fastmcp.dependencies import Depends
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import Resolve
from mcp.types import CallToolResult, InputRequiredResult, TextContent

from django_idempotency import fastmcp as fastmcp_adapter
from django_idempotency import mcp as mcp_adapter
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key, postgres_only, storm_while_held
from tests.test_mcp import (
    ACCOUNT,
    OUTSIDE,
    RUNS,
    WAIT,
    _fresh_counters,  # noqa: F401  (the counters start empty in every test)
    args,
    call,
    effects,
    ran_once,
    refund_effect,
    refused,
    replayed,
)
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

FRAMEWORKS = ["mcpserver", "fastmcp"]


@pytest.fixture(params=FRAMEWORKS)
def framework(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def server_of(framework: str, name: str = "shop") -> Any:
    return FastMCP(name) if framework == "fastmcp" else MCPServer(name)


def protect(framework: str, **options: Any) -> Any:
    options.setdefault("account", ACCOUNT)
    adapter = fastmcp_adapter if framework == "fastmcp" else mcp_adapter
    return adapter.idempotent_tool(**options)


# -- injected parameters are not arguments of the call -------------------------------------------

#: How many times the dependency was resolved: once per call.
RESOLVED = itertools.count()


class Session:
    """What a dependency typically gives a tool: a fresh object per call (a client, a
    session), with no JSON form and an identity of its own."""

    def __init__(self) -> None:
        self.number = next(RESOLVED)


def session() -> Session:
    return Session()


#: The dependency, as FastMCP's users declare one.
PSP = Depends(session)


def test_a_tool_with_an_injected_dependency_replays_its_retry(framework):
    """FastMCP fills a ``Depends(fn)`` parameter, the SDK's ``MCPServer`` one annotated
    ``Resolve(fn)`` (a client, a session, an elicitation's answer), before the tool runs.
    Neither is an argument of the call. The SDK's was fingerprinted: a fresh object on every
    call, so every retry was refused as ``idempotency_key_reused``."""
    server = server_of(framework)

    if framework == "fastmcp":

        def refund(
            order_id: int, amount: int, idempotency_key: str, psp: Session = PSP
        ) -> dict[str, Any]:
            assert isinstance(psp, Session)
            return refund_effect(order_id, amount)

    else:

        def refund(  # type: ignore[misc]
            order_id: int,
            amount: int,
            idempotency_key: str,
            psp: Annotated[Session, Resolve(session)],
        ) -> dict[str, Any]:
            assert isinstance(psp, Session)
            return refund_effect(order_id, amount)

    server.tool()(protect(framework)(refund))
    key = new_key()
    first = call(server, args(key))
    ran_once(first)
    again = call(server, args(key))
    # The retry carries the same arguments: the dependency's fresh object is not one of them.
    replayed(first, again)
    refused(call(server, args(key, amount=6)), "idempotency_key_reused")
    assert effects() == (1, 1, 1)


def test_a_fastmcp_tool_with_an_injected_context_and_a_dependency_replays_its_retry():
    server = FastMCP("shop")

    @server.tool
    @protect("fastmcp")
    async def refund(
        order_id: int,
        amount: int,
        idempotency_key: str,
        ctx: fastmcp.Context,
        psp: Session = PSP,
    ) -> dict[str, Any]:
        assert isinstance(ctx, fastmcp.Context)
        from asgiref.sync import sync_to_async

        return await sync_to_async(refund_effect)(order_id, amount)  # type: ignore[no-any-return]

    key = new_key()
    first = call(server, args(key))
    ran_once(first)
    replayed(first, call(server, args(key)))
    assert effects() == (1, 1, 1)


@pytest.mark.parametrize("key", ["argument", "none, run unprotected"])
def test_a_tool_that_asks_for_input_first_runs_once_when_answered_and_replays(framework, key):
    """A tool of MCP's multi-round flow (protocol 2026-07-28) answers its first round with
    an ``InputRequiredResult``, and the client calls again with the answers: only that round
    acts. Protected under the SDK, the first round's answer was refused as a result that
    "cannot be stored and replayed": every call ended in "Error executing tool", a tool that
    could never act. Under FastMCP the question was stored as the call's outcome, sent as
    its content, and replayed to the round that answered: the refund never ran. A round
    that asks is not the call's outcome: nothing is kept for it, and the round that answers
    runs under the key."""
    server = server_of(framework)

    def refund(
        order_id: int, amount: int, ctx: Any, idempotency_key: str | None = None
    ) -> CallToolResult | InputRequiredResult:
        RUNS.append("round")
        if ctx.request_state is None:  # the first round: ask
            return InputRequiredResult(request_state="confirm")
        done = refund_effect(order_id, amount)
        return CallToolResult(
            content=[TextContent(type="text", text="done")], structured_content=done
        )

    refund.__annotations__["ctx"] = fastmcp.Context if framework == "fastmcp" else Context
    server.tool()(protect(framework, required=False)(refund))

    arguments = args(new_key()) if key == "argument" else args(None)
    first = call(server, arguments)
    assert first.is_error is not True, first
    assert not (first.meta or {}).get("idempotentReplayed"), first
    assert RUNS.count("round") == 2  # asked, then answered
    if key == "argument":
        replayed(first, call(server, arguments))
        assert RUNS.count("round") == 2  # the retry asked nothing and ran nothing
        assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert (Charge.objects.count(), len(OUTSIDE)) == (1, 1)


# -- one function name, two tools -----------------------------------------------------------------


def test_two_tools_registered_under_their_own_names_are_two_operations(framework):
    """The default operation is ``tool:<registered name>``. A tool factory (one function per
    currency, registered under ``name=``): each tool is another action, so one key sent to
    each runs each once; the USD call never replays the EUR refund."""
    server = server_of(framework)

    for currency in ("eur", "usd"):

        def make(currency: str) -> Any:
            def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                RUNS.append(f"refund:{currency}")
                OUTSIDE.append(f"refund:{currency}")
                Charge.objects.create(account="refund", amount=amount, currency=currency.upper())
                return {"currency": currency, "amount": amount}

            return refund

        server.tool(name=f"refund_{currency}")(protect(framework)(make(currency)))

    key = new_key()
    eur = call(server, args(key), name="refund_eur")
    ran_once(eur)
    usd = call(server, args(key), name="refund_usd")
    # The USD refund is another tool: it runs, and answers in USD, not the EUR refund's result.
    ran_once(usd)
    assert usd.structured_content is not None
    assert usd.structured_content["currency"] == "usd", usd
    assert effects() == (2, 2, 2)
    assert set(Charge.objects.values_list("currency", flat=True)) == {"EUR", "USD"}


# -- one decorator kept and put on several tools ------------------------------------------------

#: The annotation of a tool's own context parameter, set per framework before the tool is made
#: (annotations are strings in this module, resolved from its globals).
ToolContext: Any = None


def test_one_decorator_on_two_named_tools_keeps_them_two_operations(framework):
    """``once = idempotent_tool(...)`` written once and put on several tools, as a project
    keeps one set of options: each tool is still its own operation, under the name it is
    registered by. One key sent to each runs each once; the cancel never answers with the
    refund's stored result."""
    server = server_of(framework)
    once = protect(framework)

    @server.tool(name="refund_order")
    @once
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return {"done": "refund", **refund_effect(order_id, amount)}

    @server.tool(name="cancel_order")
    @once
    def cancel(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return {"done": "cancel", **refund_effect(order_id, amount)}

    key = new_key()
    ran_once(call(server, args(key), name="refund_order"))
    cancelled = call(server, args(key), name="cancel_order")
    ran_once(cancelled)
    assert cancelled.structured_content is not None
    assert cancelled.structured_content["done"] == "cancel", cancelled
    assert effects() == (2, 2, 2)
    assert set(IdempotencyRecord.objects.values_list("operation", flat=True)) == {
        "tool:refund_order",
        "tool:cancel_order",
    }


def test_one_decorator_on_a_tool_with_a_context_and_one_without_gives_each_its_own(framework):
    """The same kept decorator on a tool that takes the call's ``Context`` and on one that does
    not: the first still gets its context, its key from ``_meta`` and its account callable
    the context, whichever tool was decorated last."""
    global ToolContext
    ToolContext = fastmcp.Context if framework == "fastmcp" else mcp_context_type()
    server = server_of(framework)
    given: list[str] = []

    def account(context: Any) -> str | None:
        given.append(type(context).__name__)
        return ACCOUNT if context is not None else None

    once = protect(framework, account=account)

    @server.tool()
    @once
    def refund(order_id: int, amount: int, ctx: ToolContext) -> dict[str, Any]:
        assert isinstance(ctx, ToolContext)
        return refund_effect(order_id, amount)

    @server.tool()
    @once
    def cancel(order_id: int, amount: int) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    key = new_key()
    first = call(server, args(None), meta={"idempotencyKey": key})
    ran_once(first)
    replayed(first, call(server, args(None), meta={"idempotencyKey": key}))
    assert effects() == (1, 1, 1)
    assert given == ["Context", "Context"]


def mcp_context_type() -> type:
    from mcp.server.mcpserver import Context

    return Context


# -- the key argument's type and default ----------------------------------------------------------


def test_an_optional_key_argument_falls_back_to_meta_and_refuses_without_either(framework):
    server = server_of(framework)

    @server.tool()
    @protect(framework)
    def refund(order_id: int, amount: int, idempotency_key: str | None = None) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    refused(call(server, args(None)), "idempotency_key_missing")
    assert effects() == (0, 0, 0)
    key = new_key()
    first = call(server, args(None), meta={"idempotencyKey": key})
    ran_once(first)
    replayed(first, call(server, args(key)))  # the same key, from the argument this time
    assert effects() == (1, 1, 1)


@pytest.mark.parametrize("key", [True, 1.5, 0, ""], ids=repr)
def test_meta_keys_of_other_types_are_refused_with_a_code(framework, key):
    server = server_of(framework)

    @server.tool()
    @protect(framework)
    def refund(order_id: int, amount: int) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    refused(call(server, args(None), meta={"idempotencyKey": key}), "idempotency_key_invalid")
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


def test_an_account_callable_that_raises_runs_nothing(framework):
    server = server_of(framework)

    def broken(context: Any) -> str:
        raise KeyError("tenant")

    @server.tool()
    @protect(framework, account=broken)
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    result = call(server, args(new_key()))
    assert result.is_error is True
    assert effects() == (0, 0, 0)
    assert not IdempotencyRecord.objects.exists()


# -- what FastMCP tools return ---------------------------------------------------------------------


@dataclasses.dataclass
class Receipt:
    refund: int
    amount: int


class ReceiptModel(pydantic.BaseModel):
    refund: int
    amount: int


def _receipt(order_id: int, amount: int) -> int:
    refund_effect(order_id, amount)
    return order_id * 1000 + amount  # the same answer for the same call


RETURNS: dict[str, Any] = {
    "none": (None, lambda o, a: (_receipt(o, a), None)[1]),
    "int": (int, _receipt),
    "str": (str, lambda o, a: f"refund {_receipt(o, a)}"),
    "bytes": (bytes, lambda o, a: f"refund {_receipt(o, a)}".encode()),
    "list": (list[int], lambda o, a: [_receipt(o, a)]),
    "dataclass": (Receipt, lambda o, a: Receipt(_receipt(o, a), a)),
    "model": (ReceiptModel, lambda o, a: ReceiptModel(refund=_receipt(o, a), amount=a)),
    "image": (
        fastmcp.utilities.types.Image,
        lambda o, a: (_receipt(o, a), fastmcp.utilities.types.Image(data=b"\x89PNG", format="png"))[
            1
        ],
    ),
    "toolresult": (
        fastmcp.tools.ToolResult,
        lambda o, a: fastmcp.tools.ToolResult(
            content=f"refund {_receipt(o, a)}", structured_content={"amount": a}, meta={"x": 1}
        ),
    ),
}


@pytest.mark.parametrize("returns", list(RETURNS))
def test_a_fastmcp_tool_answers_the_first_call_as_unprotected_and_replays_it(returns):
    answers_as_unprotected(returns, {})


@pytest.mark.parametrize("returns", ["int", "str", "list"])
def test_a_fastmcp_tool_registered_without_output_schema_answers_as_unprotected(returns):
    """FastMCP's ``@server.tool(output_schema=None)``: the adapter converts the return value
    as that registration does (no ``structuredContent`` wrapping), first call and replay."""
    answers_as_unprotected(returns, {"output_schema": None})


def answers_as_unprotected(
    returns: str, registration: dict[str, Any], framework: str = "fastmcp"
) -> None:
    annotation, body = RETURNS[returns]
    server = FastMCP if framework == "fastmcp" else MCPServer
    plain, guarded = server("plain"), server("guarded")

    def tool(unprotected: bool = False) -> Any:
        def refund(order_id: int, amount: int, idempotency_key: str) -> Any:
            try:
                return body(order_id, amount)
            finally:
                if unprotected:
                    # The protected tool closes its worker thread's connection after the
                    # call; nothing does for the bare one, whose connection would outlive
                    # the test.
                    connection.close()

        refund.__annotations__["return"] = annotation
        return refund

    plain.tool(**registration)(tool(unprotected=True))
    guarded.tool(**registration)(protect(framework)(tool()))
    unprotected = call(plain, args("unused"))
    key = new_key()
    first = call(guarded, args(key))
    ran_once(first)
    # The protected tool's first answer is the one the framework gives the unprotected tool.
    assert first.content == unprotected.content
    assert first.structured_content == unprotected.structured_content
    assert first.is_error == unprotected.is_error
    replayed(first, call(guarded, args(key)))
    assert effects() == (2, 2, 2)  # the unprotected call, then the protected one once


@pytest.mark.parametrize("returns", ["int", "list"])
def test_an_sdk_tool_registered_without_structured_output_answers_as_unprotected(returns):
    """The SDK's ``@server.tool(structured_output=False)``: the unprotected tool answers its
    content alone; the protected one, converted as if registered with the default, added a
    ``structuredContent`` the tool's listing does not announce."""
    answers_as_unprotected(returns, {"structured_output": False}, "mcpserver")


# -- FastMCP's registration options ----------------------------------------------------------------


def test_a_fastmcp_sync_tool_registered_to_run_on_the_event_loop_runs_once():
    """``@server.tool(run_in_thread=False)`` calls the sync tool on the event loop, where
    Django refuses the engine's queries (it answered a generic ``SynchronousOnlyOperation``
    error): the call runs on a thread of its own, once, and its retry replays it."""
    server = FastMCP("shop")

    @server.tool(run_in_thread=False)
    @protect("fastmcp")
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    key = new_key()
    first = call(server, args(key))
    ran_once(first)
    replayed(first, call(server, args(key)))
    assert effects() == (1, 1, 1)


def test_a_fastmcp_async_tool_past_its_timeout_completes_and_its_retry_replays():
    """FastMCP's ``timeout=`` answers the agent an error and cancels the tool's task: the
    attempt goes on to its end (as for a client that went away), and the retry, on the same
    living server, gets its outcome: one refund."""
    server = FastMCP("shop")

    @server.tool(timeout=0.5)
    @protect("fastmcp")
    async def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        from asgiref.sync import sync_to_async

        await anyio.sleep(1.5)
        return await sync_to_async(refund_effect)(order_id, amount)  # type: ignore[no-any-return]

    key = new_key()

    async def agent() -> tuple[Any, Any]:
        with anyio.fail_after(WAIT):
            async with fastmcp.Client(server) as client:
                first = await client.call_tool("refund", args(key), raise_on_error=False)
            await anyio.sleep(3)  # the server (this event loop) lives on; the tool ends
            async with fastmcp.Client(server) as client:
                again = await client.call_tool("refund", args(key), raise_on_error=False)
            return first, again

    first, again = anyio.run(agent)
    assert first.is_error is True  # timed out, from the agent's side
    assert again.is_error is not True, again
    assert (again.meta or {}).get("idempotentReplayed") is True, again
    assert effects() == (1, 1, 1)
    assert IdempotencyRecord.objects.get(key=key).status == RecordStatus.COMPLETED


def test_a_tool_returning_none_answers_its_client(framework):
    # The annotation as a module without ``from __future__ import annotations`` holds it.
    cancel_annotation: Any = None
    """An action tool that answers nothing (``-> None``: a mail sent, an order cancelled): the
    agent's client gets a result, first and on the retry; the tool ran once."""
    server = server_of(framework)

    def cancel(order_id: int, idempotency_key: str) -> None:
        refund_effect(order_id, 0)

    cancel.__annotations__["return"] = cancel_annotation
    server.tool()(protect(framework)(cancel))

    key = new_key()
    first = call(server, {"order_id": 1, "idempotency_key": key}, name="cancel")
    ran_once(first)
    replayed(first, call(server, {"order_id": 1, "idempotency_key": key}, name="cancel"))
    assert effects() == (1, 1, 1)


def _bodies(shape: str, effect: Any = refund_effect) -> Any:
    """A refund tool's function of ``shape``, whose body is entered only when its answer is
    read to its end: a generator, an async generator, or a plain ``def`` (a project's
    decorator made with ``functools.wraps``) that hands back its async body's coroutine. The
    answer leaves the refund's row id out: two runs answer alike."""
    if shape == "generator":

        def refund(order_id: int, idempotency_key: str) -> Any:
            effect(order_id, 5)
            yield {"order": order_id}

        return refund
    if shape == "async generator":

        async def refund(order_id: int, idempotency_key: str) -> Any:  # type: ignore[misc]
            await sync_to_async(effect)(order_id, 5)
            yield {"order": order_id}

        return refund

    async def refund(order_id: int, idempotency_key: str) -> Any:  # type: ignore[misc,no-redef]
        await sync_to_async(effect)(order_id, 5)
        return {"order": order_id}

    @functools.wraps(refund)
    def logged(*args: Any, **kwargs: Any) -> Any:
        return refund(*args, **kwargs)

    return logged


@pytest.mark.parametrize("shape", ["generator", "async generator", "coroutine"])
def test_a_tool_whose_answer_is_a_generator_or_a_coroutine_runs_once_and_replays(framework, shape):
    """FastMCP awaits what a tool's function hands back and reads a generator to its end: the
    body runs there. Protected, the body runs once, inside the record's transaction, and the
    agent gets the answer the unprotected tool gives under FastMCP, first and on the retry;
    never a record completed by a body that never ran."""
    unprotected = FastMCP("plain")  # its body writes nothing: FastMCP's threads keep no rows
    unprotected.tool()(_bodies(shape, effect=lambda order_id, amount: None))
    expected = call(unprotected, {"order_id": 1, "idempotency_key": new_key()})
    assert not expected.is_error, expected

    server = server_of(framework)
    server.tool()(protect(framework)(_bodies(shape)))
    key = new_key()
    first = call(server, {"order_id": 1, "idempotency_key": key})
    ran_once(first)
    assert effects() == (1, 1, 1)  # the body ran, and its row committed with the record
    if framework == "fastmcp":
        assert first.content == expected.content
        assert first.structured_content == expected.structured_content
    else:  # the SDK answers the same items its own way
        text = first.content[0].text  # type: ignore[union-attr]
        assert '"order": 1' in text, first
    replayed(first, call(server, {"order_id": 1, "idempotency_key": key}))
    assert effects() == (1, 1, 1)
    assert IdempotencyRecord.objects.get(key=key).status == RecordStatus.COMPLETED


def test_one_key_through_both_frameworks_refund_tools_is_one_refund():
    """The same refund tool served through ``MCPServer`` and through FastMCP (as the example
    project does) is one operation: one token, one key, one refund, and the other framework's
    client reads the stored result."""
    sdk, fast = MCPServer("shop"), FastMCP("shop")
    for server, framework in ((sdk, "mcpserver"), (fast, "fastmcp")):

        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            return refund_effect(order_id, amount)

        server.tool()(protect(framework)(refund))
    for first_server, other in ((sdk, fast), (fast, sdk)):
        RUNS.clear()
        OUTSIDE.clear()
        Charge.objects.all().delete()
        key = new_key()
        first = call(first_server, args(key))
        ran_once(first)
        again = call(other, args(key))
        assert again.structured_content == first.structured_content
        assert (again.meta or {}).get("idempotentReplayed") is True
        assert effects() == (1, 1, 1)


# -- mounted servers -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["mount", "mount-prefixed"])
def test_a_protected_tool_of_a_mounted_fastmcp_runs_once(how):
    child, parent = FastMCP("child"), FastMCP("parent")

    @child.tool
    @protect("fastmcp")
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    name = "refund"
    if how == "mount":
        parent.mount(child)
    else:
        parent.mount(child, namespace="child")
        name = "child_refund"
    key = new_key()
    first = call(parent, args(key), name=name)
    ran_once(first)
    replayed(first, call(parent, args(key), name=name))
    replayed(first, call(child, args(key)))  # the child served on its own: one action
    assert effects() == (1, 1, 1)


def test_the_decorator_above_a_mounted_fastmcps_tool_is_refused():
    child = FastMCP("child")
    with pytest.raises(ImproperlyConfigured):

        @protect("fastmcp")
        @child.tool
        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            return refund_effect(order_id, amount)


#: A project's module of servers, reached as ``servers.shop`` (``from . import servers``).
servers = types.ModuleType("servers")
servers.shop = MCPServer("shop")  # type: ignore[attr-defined]
#: A project's registry of servers by name.
SERVERS = {"shop": MCPServer("shop")}


@pytest.mark.parametrize("where", ["module attribute", "dict item"])
def test_the_decorator_above_a_server_of_another_module_or_a_dict_is_refused(where):
    try:
        if where == "module attribute":

            @mcp_adapter.idempotent_tool(account=ACCOUNT)
            @servers.shop.tool()  # type: ignore[attr-defined]
            def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                return refund_effect(order_id, amount)

        else:

            @mcp_adapter.idempotent_tool(account=ACCOUNT)
            @SERVERS["shop"].tool()
            def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                return refund_effect(order_id, amount)

    except ImproperlyConfigured:
        return  # refused where it is written: nothing served unprotected
    # Not refused: the server serves the bare function, and a retry runs again.
    server = servers.shop if where == "module attribute" else SERVERS["shop"]  # type: ignore[attr-defined]
    key = new_key()
    call(server, args(key))
    call(server, args(key))
    assert effects() == (1, 1, 1), "the decorator above the server's looked protected and was not"


@postgres_only
def test_a_storm_on_a_tool_with_injected_parameters_runs_once_and_every_call_gets_its_result():
    """Eight agents' identical calls at once, on a FastMCP tool taking its Context and a
    dependency, with ``wait=``: one refund, and every call answered with its result."""
    server = FastMCP("shop")
    entered, leave = threading.Event(), threading.Event()

    @server.tool
    @protect("fastmcp", wait=timedelta(seconds=WAIT))
    def refund(
        order_id: int,
        amount: int,
        idempotency_key: str,
        ctx: fastmcp.Context,
        psp: Session = PSP,
    ) -> dict[str, Any]:
        entered.set()
        assert leave.wait(WAIT)
        return refund_effect(order_id, amount)

    key = new_key()
    results = storm_while_held(lambda: call(server, args(key)), 8, entered, leave, WAIT)
    (first,) = [r for r in results if not (r.meta or {}).get("idempotentReplayed")]
    ran_once(first)
    for result in results:
        if result is not first:
            replayed(first, result)
    assert effects() == (1, 1, 1)


def test_an_async_tool_whose_agent_goes_away_mid_call_completes_and_its_retry_replays(framework):
    """The agent's connection closes while the ``async def`` tool runs: the attempt goes on to
    its end on the living server, and the retry gets its outcome: one refund."""
    server = server_of(framework)
    entered = anyio.Event()

    @server.tool()
    @protect(framework)
    async def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        from asgiref.sync import sync_to_async

        entered.set()
        await anyio.sleep(1)
        return await sync_to_async(refund_effect)(order_id, amount)  # type: ignore[no-any-return]

    key = new_key()

    async def once(scope: anyio.CancelScope | None = None) -> Any:
        if framework == "fastmcp":
            async with fastmcp.Client(server) as client:
                return await client.call_tool("refund", args(key), raise_on_error=False)
        from mcp import Client

        async with Client(server) as client:
            return await client.call_tool("refund", args(key))

    async def agent() -> Any:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                group.start_soon(once)
                await entered.wait()
                group.cancel_scope.cancel()  # the agent goes away
            await anyio.sleep(2.5)  # the server (this event loop) lives on
            return await once()

    again = anyio.run(agent)
    assert again.is_error is not True, again
    assert (again.meta or {}).get("idempotentReplayed") is True, again
    assert effects() == (1, 1, 1)


@postgres_only
def test_async_tools_that_await_threads_never_wait_for_the_loops_threads(framework):
    """More ``async def`` tools at once than the event loop's default executor has threads,
    each awaiting work in a thread (``asyncio.to_thread``, as async code does for a blocking
    client): every call runs and answers. The engine's thread of a call is never one of the
    threads its body waits for."""
    import asyncio
    import concurrent.futures
    import time

    server = server_of(framework)
    threads = 4  # the loop's default executor (min(32, CPUs + 4) threads by default)

    @server.tool()
    @protect(framework)
    async def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        await asyncio.to_thread(time.sleep, 0.2)  # a blocking client, off the loop
        return await sync_to_async(refund_effect)(order_id, amount)  # type: ignore[no-any-return]

    calls = threads + 2
    keys = [new_key() for _ in range(calls)]

    async def agents() -> list[Any]:
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(threads)
        )
        results: list[Any] = []

        async def agent(number: int) -> None:
            arguments = args(keys[number], order_id=number)
            if framework == "fastmcp":
                async with fastmcp.Client(server) as client:
                    results.append(
                        await client.call_tool("refund", arguments, raise_on_error=False)
                    )
                return
            from mcp import Client

            async with Client(server) as client:
                results.append(await client.call_tool("refund", arguments))

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as group:
                for number in range(calls):
                    group.start_soon(agent, number)
        return results

    results = anyio.run(agents)
    assert len(results) == calls
    for result in results:
        ran_once(result)
    assert effects() == (calls, calls, calls)
    assert IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count() == calls
