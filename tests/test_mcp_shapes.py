"""``idempotent_tool`` written the other ways a project writes it: on a method, twice, the
other framework's decorator beneath a server's ``@tool``, above a server kept in a class or a
list. Each shape protects the tool (one run per key, the retry replayed) or is refused before
anything runs; never a tool that fails on every call, never one that answers a refusal as a
success. Effects are counted: ``RUNS`` (tool bodies entered) and ``Charge`` rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID, uuid4

import pytest

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")

import anyio
import fastmcp
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from fastmcp import FastMCP
from fastmcp.tools import FunctionTool
from mcp import Client
from mcp.server.mcpserver import MCPServer

from django_idempotency import fastmcp as fastmcp_adapter
from django_idempotency import mcp as mcp_adapter
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 30
ACCOUNT = "agent:shapes"
FRAMEWORKS = ["mcpserver", "fastmcp"]
#: Every entry into a tool body.
RUNS: list[str] = []


@pytest.fixture(autouse=True)
def _fresh_runs() -> Iterator[None]:
    RUNS.clear()
    yield
    RUNS.clear()


@pytest.fixture(params=FRAMEWORKS)
def framework(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def server_of(framework: str) -> Any:
    return FastMCP("shop") if framework == "fastmcp" else MCPServer("shop")


def adapter_of(framework: str) -> Any:
    return fastmcp_adapter if framework == "fastmcp" else mcp_adapter


def refund_effect(order_id: int, amount: int) -> dict[str, Any]:
    RUNS.append(f"refund:{order_id}")
    charge = Charge.objects.create(account="refund", amount=amount, currency="EUR")
    return {"refund": charge.pk, "order": order_id}


def call(server: Any, arguments: dict[str, Any], name: str = "refund") -> Any:
    """One call through the server's framework's own client, in-process: the result (with
    ``content``, ``structured_content``, ``is_error``, ``meta``)."""

    async def go() -> Any:
        with anyio.fail_after(WAIT):
            if isinstance(server, FastMCP):
                async with fastmcp.Client(server) as agent:
                    return await agent.call_tool(name, arguments, raise_on_error=False)
            async with Client(server) as agent:
                return await agent.call_tool(name, arguments)

    return anyio.run(go)


def listed_parameters(server: Any, name: str = "refund") -> set[str]:
    """The parameters the server lists for its tool ``name``."""

    async def go() -> Any:
        with anyio.fail_after(WAIT):
            if isinstance(server, FastMCP):
                async with fastmcp.Client(server) as agent:
                    return await agent.list_tools()
            async with Client(server) as agent:
                return (await agent.list_tools()).tools

    (tool,) = [tool for tool in anyio.run(go) if tool.name == name]
    return set(tool.input_schema["properties"])


def args(key: str, order_id: int = 1, amount: int = 5) -> dict[str, Any]:
    return {"order_id": order_id, "amount": amount, "idempotency_key": key}


def is_replay(result: Any) -> bool:
    return bool((result.meta or {}).get("idempotentReplayed"))


def code_of(result: Any) -> str | None:
    return (result.structured_content or {}).get("code") if result.is_error else None


def runs_once_and_replays(server: Any, name: str = "refund", **more: Any) -> None:
    """A key's first call runs, its retry is the replay, the same key with other arguments
    is refused as an error: one run, one row. ``more``: arguments of the tool's own."""
    key = new_key()
    first = call(server, {**args(key), **more}, name)
    assert first.is_error is not True, first
    assert not is_replay(first), first
    again = call(server, {**args(key), **more}, name)
    assert again.is_error is not True, again
    assert is_replay(again), again
    assert again.structured_content == first.structured_content
    other = call(server, {**args(key, amount=6), **more}, name)
    assert other.is_error is True, other
    assert code_of(other) == "idempotency_key_reused", other
    assert (len(RUNS), Charge.objects.count()) == (1, 1)


# -- a tool that is a method -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", ["method", "async method", "classmethod", "above classmethod", "above staticmethod"]
)
def test_a_tool_written_as_a_method_runs_once_and_replays(framework, shape):
    """A project keeps its tools on a class (a service holding a client) and registers the
    bound method, ``server.tool()(tools.refund)``. The protected method got the instance as
    an argument it did not take: every call failed, none was refused where it was written.
    Written above ``@staticmethod``, the decorator took the static method for a function of
    the class: the bound tool lost ``order_id`` from its schema, and its body ran on every
    call with the instance as its order. Above ``@classmethod`` it was refused."""
    protect = adapter_of(framework).idempotent_tool(account=ACCOUNT)

    class Tools:
        currency = "EUR"

        if shape == "method":

            @protect
            def refund(self, order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                assert self.currency == "EUR"
                return refund_effect(order_id, amount)

        elif shape == "async method":

            @protect
            async def refund(  # type: ignore[misc]
                self, order_id: int, amount: int, idempotency_key: str
            ) -> dict[str, Any]:
                assert self.currency == "EUR"
                return await sync_to_async(refund_effect)(order_id, amount)  # type: ignore[no-any-return]

        elif shape == "classmethod":

            @classmethod  # type: ignore[misc]
            @protect
            def refund(cls, order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                assert cls.currency == "EUR"
                return refund_effect(order_id, amount)

        elif shape == "above classmethod":

            @protect  # type: ignore[misc]
            @classmethod
            def refund(cls, order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                assert cls.currency == "EUR"
                return refund_effect(order_id, amount)

        else:

            @protect  # type: ignore[misc]
            @staticmethod
            def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
                assert isinstance(order_id, int)
                return refund_effect(order_id, amount)

    server = server_of(framework)
    server.tool()(Tools.refund if shape == "classmethod" else Tools().refund)
    runs_once_and_replays(server)
    # The instance is not an argument of the call: it is not in the fingerprint, and the
    # schema does not offer it.
    assert listed_parameters(server) == {"order_id", "amount", "idempotency_key"}
    assert list(IdempotencyRecord.objects.values_list("operation", flat=True)) == ["tool:refund"]


# -- the decorator twice ---------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["its own", "the other framework's"])
def test_the_decorator_put_twice_is_refused_where_it_is_written(framework, inner):
    """``@idempotent_tool()`` twice on one tool (a project's own decorator that adds it, over
    one written by hand). Under FastMCP the inner one found the outer one's claim and answered
    ``idempotency_key_in_use`` (``idempotency_key_reused`` with the SDK's beneath), which the
    outer one stored as the outcome: the tool never ran, and every retry within the TTL got
    that refusal replayed. Under ``MCPServer`` every call failed, or the shape was refused for
    an argument named ``idempotency_context`` the tool does not have."""
    protect = adapter_of(framework).idempotent_tool
    other = "fastmcp" if framework == "mcpserver" else "mcpserver"
    beneath = adapter_of(framework if inner == "its own" else other).idempotent_tool
    server = server_of(framework)
    with pytest.raises(ImproperlyConfigured, match="more than once"):

        @server.tool()
        @protect(account=ACCOUNT)
        @beneath(account=ACCOUNT)
        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            return refund_effect(order_id, amount)


# -- the other framework's decorator ---------------------------------------------------------------


@pytest.mark.parametrize("returns", [dict[str, Any], dict], ids=["dict[str, Any]", "dict"])
def test_fastmcps_decorator_beneath_an_mcpserver_tool_answers_as_the_contract_says(returns):
    """``django_idempotency.fastmcp.idempotent_tool`` beneath the SDK's ``@server.tool()`` (one
    import mixed up in a project serving both). It answered FastMCP's ``ToolResult``. For a
    tool with an output schema (``-> dict[str, Any]``) the SDK refused that answer after the
    tool ran and its record completed: the agent got an error for a refund that was made, and
    so did every retry. For one without (``-> dict``) the SDK sent it as a success whose text
    is that object's JSON: a refusal (a key reused, a call in flight) reached the agent with
    ``isError: false``, and a replay without its flag."""
    server = MCPServer("shop")

    def refund(order_id: int, amount: int, idempotency_key: str) -> Any:
        return refund_effect(order_id, amount)

    refund.__annotations__["return"] = returns
    server.tool()(fastmcp_adapter.idempotent_tool(account=ACCOUNT)(refund))
    runs_once_and_replays(server)


def test_the_sdks_decorator_beneath_a_fastmcp_tool_runs_nothing_and_says_which_to_use():
    """``django_idempotency.mcp.idempotent_tool`` beneath FastMCP's ``@server.tool``. The
    SDK's conversion of the result is not FastMCP's: for a ``-> dict`` tool FastMCP refused
    the answer (no structured content for its output schema) after the tool ran and its
    record completed, so the agent got an error for a refund that was made, and every retry
    the same error replayed. Refused before anything runs, naming the decorator to use."""
    server = FastMCP("shop")

    @server.tool
    @mcp_adapter.idempotent_tool(account=ACCOUNT)
    def refund(order_id: int, amount: int, idempotency_key: str) -> dict:  # type: ignore[type-arg]
        return refund_effect(order_id, amount)

    for _ in range(2):
        result = call(server, args(new_key()))
        assert result.is_error is True, result
        assert "django_idempotency.fastmcp" in result.content[0].text, result
    assert (len(RUNS), Charge.objects.count()) == (0, 0)
    assert not IdempotencyRecord.objects.exists()


# -- above a server kept in a class or a list ------------------------------------------------------


class Servers:
    """A project's servers, kept as the attributes of a class used as a namespace."""

    shop = MCPServer("shop")


#: A project's servers in a list.
SERVER_LIST = [MCPServer("shop")]


@pytest.fixture
def _servers_emptied() -> Iterator[None]:
    """The module's servers without the tool a test registered on them."""
    yield
    for server in (Servers.shop, SERVER_LIST[0]):
        server._tool_manager._tools.pop("refund", None)


# The order check looked into objects, modules and dicts one step away, not into a class or
# a list: the server registered the bare function, and the tool was served unprotected.


@pytest.mark.usefixtures("_servers_emptied")
def test_the_decorator_above_a_server_kept_in_a_class_is_refused():
    with pytest.raises(ImproperlyConfigured, match="beneath"):

        @mcp_adapter.idempotent_tool(account=ACCOUNT)
        @Servers.shop.tool()
        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            return refund_effect(order_id, amount)


@pytest.mark.usefixtures("_servers_emptied")
def test_the_decorator_above_a_server_kept_in_a_list_is_refused():
    with pytest.raises(ImproperlyConfigured, match="beneath"):

        @mcp_adapter.idempotent_tool(account=ACCOUNT)
        @SERVER_LIST[0].tool()
        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            return refund_effect(order_id, amount)


# -- above FastMCP's add_tool ----------------------------------------------------------------------


@pytest.mark.parametrize("added", ["the function", "its FunctionTool"])
def test_protecting_a_function_fastmcp_added_already_is_refused(added):
    """FastMCP's ``server.add_tool(refund)`` (or of ``FunctionTool.from_function(refund)``), as
    a project's registering helper does, and then ``idempotent_tool()`` on ``refund``: the
    server serves the bare function. FastMCP marks only what its ``@tool`` decorator
    registered, and the order check looked at that mark alone, so the shape was not refused
    (docs/mcp.md said that under FastMCP it always is)."""
    server = FastMCP("shop")

    def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    server.add_tool(refund if added == "the function" else FunctionTool.from_function(refund))
    protect = fastmcp_adapter.idempotent_tool(account=ACCOUNT)
    with pytest.raises(ImproperlyConfigured, match="beneath"):
        protect(refund)


# -- a tool taking **kwargs ------------------------------------------------------------------------


def test_an_sdk_tool_taking_keyword_arguments_is_protected():
    """The SDK serves a tool with ``**extra`` (the caller's ``extra`` object is passed by that
    name). Protected, it was refused where it was written, but by an internal error
    (``ValueError: wrong parameter order``) from the parameter the adapter adds after it."""
    server = MCPServer("shop")

    @server.tool()
    @mcp_adapter.idempotent_tool(account=ACCOUNT)
    def refund(order_id: int, amount: int, idempotency_key: str, **extra: Any) -> dict[str, Any]:
        return {**refund_effect(order_id, amount), "extra": extra}

    # The SDK lists ``extra`` as an object argument, required.
    runs_once_and_replays(server, extra={"note": "by phone"})


# -- a key argument of another type ----------------------------------------------------------------


@pytest.mark.parametrize("typed", ["UUID", "UUID | None"])
def test_a_key_argument_typed_uuid_protects_the_tool(framework, typed):
    """``idempotency_key: UUID`` is how a project asks agents for a fresh UUID per action
    (the schema says ``format: uuid``). The framework hands the tool a ``UUID``, and every
    call was refused as ``idempotency_key_invalid`` ("a key must be a string"): a tool that
    could never run, and nothing said so where it was written. The key is the UUID's text."""
    protect = adapter_of(framework).idempotent_tool(account=ACCOUNT)
    server = server_of(framework)

    if typed == "UUID":

        @server.tool()
        @protect
        def refund(order_id: int, amount: int, idempotency_key: UUID) -> dict[str, Any]:
            return refund_effect(order_id, amount)

    else:

        @server.tool()
        @protect
        def refund(  # type: ignore[misc]
            order_id: int, amount: int, idempotency_key: UUID | None = None
        ) -> dict[str, Any]:
            return refund_effect(order_id, amount)

    key = uuid4()
    first = call(server, args(str(key)))
    assert first.is_error is not True, first
    # The same UUID spelt in capitals is the same key.
    again = call(server, args(str(key).upper()))
    assert is_replay(again), again
    assert again.structured_content == first.structured_content
    assert (len(RUNS), Charge.objects.count()) == (1, 1)
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == [str(key)]


@pytest.mark.parametrize("annotation", [int, float, "int | None", list])
def test_a_key_argument_no_key_can_be_is_refused_where_it_is_written(framework, annotation):
    """A key argument typed ``int`` (or a list) was served, and every call was refused as
    ``idempotency_key_invalid`` ("a key must be a string, not int") after the framework
    validated it: a tool that could never run. It is refused where it is written."""
    protect = adapter_of(framework).idempotent_tool(account=ACCOUNT)

    def refund(order_id: int, amount: int, idempotency_key: Any) -> dict[str, Any]:
        return refund_effect(order_id, amount)

    refund.__annotations__["idempotency_key"] = annotation
    with pytest.raises(ImproperlyConfigured, match=r"idempotency_key.*str or UUID"):
        protect(refund)


# -- without its parentheses ----------------------------------------------------------------------


def test_the_decorator_without_its_parentheses_says_so_as_idempotent_task_does(framework):
    """``@idempotent_tool`` without ``()`` was refused by Python's own ``TypeError``
    ("takes 0 positional arguments but 1 was given"), where ``@idempotent_task`` without its
    parentheses says what to write (``ImproperlyConfigured``): one rule for every entry
    point."""
    with pytest.raises(ImproperlyConfigured, match=r"needs its parentheses"):

        @adapter_of(framework).idempotent_tool
        def refund(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
            return refund_effect(order_id, amount)
