"""The threads that run the engine for ``async def`` tools and tasks: one per attempt at a
time, reused from one attempt to the next while their event loop runs, with the connections
``CONN_MAX_AGE`` lets them keep (as a server's threads keep theirs from one request to the
next), so that an agent's calls one after another pay no new database connection each; and
ended, their connections closed, with the loop or when left idle.

Effects counted: the rows each tool or task writes, and the connections opened (Django's
``connection_created``) or left open on the server (``pg_stat_activity``).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections, transaction
from django.db.backends.signals import connection_created

from django_idempotency import _threads
from django_idempotency.models import IdempotencyRecord
from django_idempotency.tasks import idempotent_task
from tests.helpers import postgres_only, server_sessions
from tests.testapp.models import ProviderCall

pytest.importorskip("mcp")

from mcp import Client
from mcp.server.mcpserver import MCPServer

from django_idempotency.mcp import idempotent_tool

pytestmark = pytest.mark.django_db(transaction=True)

postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql" or bool(connection.settings_dict["OPTIONS"].get("pool")),
    reason="counts PostgreSQL's sessions (which Django's pool keeps open)",
)

WAIT = 30  # seconds: a bound on every wait


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Persistent connections (``CONN_MAX_AGE`` of ten minutes) for the threads the test
    starts: the tests' settings keep Django's default, a connection per request."""
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 600)


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """The aliases of the connections opened while the test runs, in any thread but the
    test's own."""
    seen: list[str] = []
    lock = threading.Lock()

    def counted(sender: Any, connection: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            with lock:
                seen.append(connection.alias)

    connection_created.connect(counted, weak=False)
    try:
        yield seen
    finally:
        connection_created.disconnect(counted)


def shop() -> MCPServer:
    server = MCPServer("threads")

    @server.tool()
    @idempotent_tool(account="acct", operation="threads.refund")
    async def refund(order_id: int, idempotency_key: str) -> dict[str, int]:
        await asyncio.sleep(0)  # the body awaits on the loop, between its ORM calls
        row = await sync_to_async(ProviderCall.objects.create)(key=f"refund:{uuid.uuid4()}")
        return {"order": order_id, "row": row.pk}

    return server


def calls(server: MCPServer, keys: list[str], opened: list[str] | None = None) -> list[Any]:
    """Every key's call, one after another, by one agent on one event loop. ``opened``: the
    connections opened so far, emptied once the first call has ended (a new thread's first
    connection on MariaDB is preceded by Django's short one that reads the server's version)."""

    async def go() -> list[Any]:
        answers = []
        with anyio.fail_after(WAIT):
            async with Client(server) as client:
                for key in keys:
                    arguments = {"order_id": 1, "idempotency_key": key}
                    answers.append(await client.call_tool("refund", arguments))
                    if opened is not None and len(answers) == 1:
                        assert opened, "the first call opened no connection"
                        opened.clear()
        return answers

    return anyio.run(go)


def sessions_back_to(before: int) -> bool:
    """Whether the server's sessions come back to ``before`` within 5 s: a closed session's
    backend leaves ``pg_stat_activity`` a moment after its client, later on a loaded machine."""
    deadline = time.monotonic() + 5
    while (left := server_sessions()) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    return left == before


@pytest.mark.usefixtures("kept")
def test_an_agents_async_tool_calls_one_after_another_open_one_connection(opened):
    keys = [f"k{number}" for number in range(5)]
    results = calls(shop(), keys + keys, opened)  # five first calls, then five retries
    assert [result.is_error for result in results] == [False] * 10
    assert [r.structured_content for r in results[5:]] == [
        r.structured_content for r in results[:5]
    ]
    assert ProviderCall.objects.filter(key__startswith="refund:").count() == 5
    assert IdempotencyRecord.objects.filter(status="completed").count() == 5
    # The engine's thread kept the connection its first call opened.
    assert opened == [], opened


@pytest.mark.usefixtures("kept")
def test_async_task_calls_on_one_loop_open_one_connection(opened):
    @idempotent_task(key=lambda tag: f"threads-task:{tag}")
    async def ship(tag: str) -> str:
        await sync_to_async(ProviderCall.objects.create)(key=f"ship:{tag}")
        return tag

    async def go() -> list[str]:
        done = [await ship("a")]
        assert opened, "the first delivery opened no connection"
        opened.clear()
        return done + [await ship(tag) for tag in ["b", "c", "a", "b", "c"]]

    assert asyncio.run(asyncio.wait_for(go(), WAIT)) == ["a", "b", "c", "a", "b", "c"]
    assert ProviderCall.objects.filter(key__startswith="ship:").count() == 3
    assert opened == [], opened


@postgres_only  # SQLite's in-memory test database is never closed
def test_on_djangos_default_each_call_closes_its_connection(opened):
    """``CONN_MAX_AGE = 0``: each call's connection is closed at its end, as a request's."""
    results = calls(shop(), ["z1", "z2", "z1"], opened)
    assert [result.is_error for result in results] == [False] * 3
    assert opened == ["default"] * 2, opened
    assert ProviderCall.objects.filter(key__startswith="refund:").count() == 2


@postgresql
@pytest.mark.usefixtures("kept")
def test_the_engines_connections_close_when_the_loop_ends():
    connections.close_all()
    before = server_sessions()
    results = calls(shop(), ["x1", "x2", "x1"])
    assert [result.is_error for result in results] == [False] * 3
    # Nothing of the calls is left on the server once the loop has ended: a test database
    # can be dropped, a server shut down. (A closed session's backend takes a moment to
    # leave pg_stat_activity: bounded.)
    assert sessions_back_to(before)
    assert ProviderCall.objects.filter(key__startswith="refund:").count() == 2


@postgresql
@pytest.mark.usefixtures("kept")
def test_an_engine_thread_left_idle_ends_and_closes_its_connection(monkeypatch):
    monkeypatch.setattr(_threads, "IDLE_SECONDS", 0.2)
    connections.close_all()
    before = server_sessions()
    server = shop()

    async def go() -> tuple[int, int]:
        async with Client(server) as client:
            result = await client.call_tool("refund", {"order_id": 1, "idempotency_key": "i1"})
            assert not result.is_error, result
            during = await sync_to_async(server_sessions, thread_sensitive=False)()
            ended = during
            deadline = time.monotonic() + WAIT
            while ended != before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                ended = await sync_to_async(server_sessions, thread_sensitive=False)()
            return during, ended

    during, ended = anyio.run(go)
    assert during == before + 1  # kept for the next call
    assert ended == before  # closed once idle, the loop still running
    assert ProviderCall.objects.filter(key__startswith="refund:").count() == 1


@postgresql
@pytest.mark.usefixtures("kept")
def test_a_connection_the_server_ended_between_two_calls_is_replaced():
    """The server ends the engine thread's connection between two calls (a restart, an
    administrator): the next call refuses as the store being unavailable, with nothing run,
    and the call after it runs on a new connection."""
    server = shop()
    with connection.cursor() as cursor:
        mine = cursor.connection.info.backend_pid  # the test's own session stays

    async def go() -> list[Any]:
        async with Client(server) as client:
            answers = [await client.call_tool("refund", {"order_id": 1, "idempotency_key": "d1"})]
            await sync_to_async(terminate_the_others, thread_sensitive=False)(mine)
            for key in ["d2", "d2"]:
                answers.append(
                    await client.call_tool("refund", {"order_id": 1, "idempotency_key": key})
                )
            return answers

    first, refused, then = anyio.run(go)
    assert not first.is_error, first
    if refused.is_error:
        assert refused.structured_content["code"] == "idempotency_store_unavailable", refused
        assert not then.is_error, then
    else:  # the lost connection was found before the claim and replaced
        assert then.structured_content == refused.structured_content
    assert ProviderCall.objects.filter(key__startswith="refund:").count() == 2


def terminate_the_others(mine: int) -> None:
    """End every session on the test database but the test's own (``mine``) and this
    read's: the engine thread's among them."""
    import psycopg

    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as raw:
        raw.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND pid <> %s AND backend_type = 'client backend'",
            [mine],
        )


def ship_task() -> Any:
    @idempotent_task(key=lambda tag: f"threads-loop:{tag}")
    async def ship(tag: str) -> str:
        await sync_to_async(ProviderCall.objects.create)(key=f"ship:{tag}")
        return tag

    return ship


@pytest.mark.usefixtures("kept")
def test_an_event_loop_that_ended_is_not_kept_in_memory():
    """Each ``asyncio.run`` (as ``async_to_sync`` and Django's ``ImmediateBackend`` make one
    per call) ends with its event loop freed: nothing of the engine's threads holds it."""
    ship = ship_task()
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def go(tag: str) -> str:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return str(await asyncio.wait_for(ship(tag), WAIT))

    assert [asyncio.run(go(tag)) for tag in ["a", "b", "c"]] == ["a", "b", "c"]
    gc.collect()
    assert [loop() for loop in loops] == [None] * 3
    assert ProviderCall.objects.filter(key__startswith="ship:").count() == 3


@postgresql
@pytest.mark.usefixtures("kept")
def test_a_loop_closed_without_shutting_down_its_generators_leaves_no_session():
    """``loop.run_until_complete(...)`` then ``loop.close()`` (no ``shutdown_asyncgens``):
    the engine's threads end soon after the loop closes, their connections closed, so a
    test suite's database can be dropped at once (PostgreSQL waits 5 s for other sessions)
    and the loop is freed."""
    ship = ship_task()
    connections.close_all()
    before = server_sessions()
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(asyncio.wait_for(ship("a"), WAIT)) == "a"
    finally:
        loop.close()
    assert sessions_back_to(before)
    closed = weakref.ref(loop)
    del loop
    assert asyncio.run(asyncio.wait_for(ship("b"), WAIT)) == "b"  # another loop's call
    gc.collect()
    assert closed() is None
    assert ProviderCall.objects.filter(key__startswith="ship:").count() == 2


@postgresql
@pytest.mark.usefixtures("kept")
def test_a_loop_left_open_once_run_until_complete_returned_leaves_no_session():
    """``loop.run_until_complete(...)`` on a loop never closed (a test's
    ``asyncio.get_event_loop()``, a script): nothing runs on the loop once the call returns,
    and its engine threads end soon after, closing their connections, so a test suite ending
    then can drop its database; the loop's next call makes a new one."""
    ship = ship_task()
    connections.close_all()
    before = server_sessions()
    loop = asyncio.new_event_loop()
    try:
        for tag in ["a", "b"]:
            assert loop.run_until_complete(asyncio.wait_for(ship(tag), WAIT)) == tag
            assert sessions_back_to(before)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    assert ProviderCall.objects.filter(key__startswith="ship:").count() == 2


@postgresql
@pytest.mark.parametrize("age", [0, 600])
def test_a_call_given_up_on_a_loop_then_closed_ends_as_a_crash(monkeypatch, age):
    """The caller gives up on a call (a timeout) and the loop is closed with the body still
    awaiting on it (``loop.run_until_complete(asyncio.wait_for(...))`` then
    ``loop.close()``): the body can never run again. Its attempt ends as a crash would end
    it (the body's work rolled back, the claim kept for its lease) rather than waiting for
    it for good, in an open transaction holding the record's row, which no test database
    could then be flushed or dropped past."""
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", age)

    @idempotent_task(key=lambda tag: f"threads-given-up:{tag}")
    async def slow(tag: str) -> str:
        await sync_to_async(ProviderCall.objects.create)(key=f"slow:{tag}")
        await asyncio.sleep(WAIT)  # on the loop, which closes meanwhile
        return tag

    connections.close_all()
    before = server_sessions()
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(asyncio.TimeoutError):
            loop.run_until_complete(asyncio.wait_for(slow("a"), 0.5))
    finally:
        loop.close()
    assert sessions_back_to(before)
    assert not ProviderCall.objects.filter(key__startswith="slow:").exists()
    record = IdempotencyRecord.objects.select_for_update(nowait=True)
    with transaction.atomic():
        assert [r.status for r in record] == ["in_progress"]
