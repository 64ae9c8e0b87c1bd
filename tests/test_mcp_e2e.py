"""The example's MCP servers under uvicorn, the SDK's ``MCPServer``
(``example_project/mcp_tools.py``) and FastMCP's (``example_project/fastmcp_tools.py``), each
called by its framework's own client over streamable HTTP, with bearer tokens (the ``via``
fixture): an answer lost on the way back and retried, a storm of identical calls, a server
SIGKILLed inside a tool under each recovery policy, and two accounts with one key. Every test
counts the refunds and mails in the example's database.

On PostgreSQL: the example gets a database of its own on the test run's server, migrated, with
two users (``demo`` and ``other``) and a token each.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("uvicorn")
pytest.importorskip("celery", reason="the example project sends its receipts with Celery")
pytest.importorskip(
    "example_project.payments", reason="the example project is not here (tox tests the wheel)"
)
pytest.importorskip("psycopg")

import psycopg
from django.db import connection

from example_project import mcp_agent
from tests.live import ROOT, starting_a_server

pytestmark = [
    pytest.mark.servers,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="the example's MCP server on a database of its own, with concurrent calls and "
        "killed processes: PostgreSQL (this run's server), not SQLite",
    ),
]

TOKENS = {"demo": "t-demo", "other": "t-other"}
WAIT = 60


def connect(database: str) -> Any:
    settings = connection.settings_dict
    return psycopg.connect(
        dbname=database,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        host=settings["HOST"] or "127.0.0.1",
        port=str(settings["PORT"] or 5432),
        autocommit=True,
    )


class ExampleDatabase:
    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.env = env

    def one(self, sql: str, params: Any = ()) -> Any:
        with connect(self.name) as db:
            row = db.execute(sql, params).fetchone()
        assert row is not None
        return row[0]

    def charge(self, username: str = "demo", amount: int = 2000) -> int:
        return int(
            self.one(
                "INSERT INTO payments_charge (user_id, amount, currency, description,"
                " provider_charge_id, created_at) VALUES ((SELECT id FROM auth_user WHERE"
                " username = %s), %s, 'EUR', '', %s, now()) RETURNING id",
                [username, amount, f"ch_{uuid.uuid4().hex}"],
            )
        )

    def refund(self, charge: int, amount: int = 100) -> int:
        return int(
            self.one(
                "INSERT INTO payments_refund (charge_id, amount, reason, created_at)"
                " VALUES (%s, %s, '', now()) RETURNING id",
                [charge, amount],
            )
        )

    def refunds(self, charge: int) -> int:
        return int(self.one("SELECT count(*) FROM payments_refund WHERE charge_id = %s", [charge]))

    def mails(self, refund_amount: int) -> int:
        return int(
            self.one(
                "SELECT count(*) FROM payments_sentmail WHERE subject = %s",
                [f"Your refund of {refund_amount}"],
            )
        )


@pytest.fixture(scope="module")
def example_db() -> Iterator[ExampleDatabase]:
    name = f"mcp_example_{os.getpid()}"
    settings = connection.settings_dict
    with connect("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "PYTHONPATH": str(ROOT),
        "EXAMPLE_DB": "postgres",
        "EXAMPLE_PGDATABASE": name,
        "PGUSER": settings["USER"],
        "PGPASSWORD": settings["PASSWORD"] or "",
        "PGHOST": settings["HOST"] or "127.0.0.1",
        "PGPORT": str(settings["PORT"] or 5432),
        "EXAMPLE_FAST_PASSWORDS": "1",
        "EXAMPLE_DEBUG": "0",
        "EXAMPLE_PROVIDER_LATENCY": "0",
        "EXAMPLE_MCP_TOKENS": ",".join(f"{token}={user}" for user, token in TOKENS.items()),
        "EXAMPLE_MCP_LEASE": "2",
    }
    manage = [sys.executable, str(ROOT / "manage.py")]
    try:
        subprocess.run([*manage, "migrate", "-v", "0"], env=env, cwd=ROOT, check=True, timeout=WAIT)
        for user in TOKENS:
            subprocess.run(
                [*manage, "ensure_demo_user", "--username", user, "--password", user, "-v", "0"],
                env=env,
                cwd=ROOT,
                check=True,
                timeout=WAIT,
            )
        yield ExampleDatabase(name, env)
    finally:
        with connect("postgres") as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def example_url(example_db: ExampleDatabase) -> Iterator[str]:
    starting_a_server("uvicorn (the example's ASGI app)")
    with mcp_agent.uvicorn_server(example_db.env) as url:
        yield url


@pytest.fixture(params=list(mcp_agent.SERVERS))
def via(request: pytest.FixtureRequest) -> str:
    """The framework that serves the tools, and whose client calls them."""
    return str(request.param)


def call(
    url: str, name: str, arguments: dict[str, Any], user: str = "demo", via: str = "MCPServer"
) -> Any:
    return mcp_agent.call_tool(url, TOKENS[user], name, arguments, via)


def own_amount(amount: int, via: str) -> int:
    """An amount of ``via``'s own: the mails of one test under each framework apart."""
    return amount + list(mcp_agent.SERVERS).index(via)


def is_replay(result: Any) -> bool:
    return bool((result.meta or {}).get("idempotentReplayed"))


def succeeded(result: Any) -> Any:
    assert not isinstance(result, BaseException), repr(result)
    assert result.is_error is not True, result
    return result


def code_of(result: Any) -> str | None:
    if isinstance(result, BaseException) or not result.is_error:
        return None
    return (result.structured_content or {}).get("code")


# -- (a) an answer lost on the way back --------------------------------------------------------


def test_a_lost_answer_retried_refunds_once_and_the_retry_gets_the_result(
    example_db, example_url, via
):
    charge = example_db.charge()
    key = str(uuid.uuid4())
    arguments = {"charge_id": charge, "amount": 500, "idempotency_key": key}
    host, port = example_url.removeprefix("http://").rsplit(":", 1)
    proxy = mcp_agent.LosingProxy((host, int(port)))
    try:
        proxy.armed.set()
        lost = call(proxy.url, "refund_charge", arguments, via=via)
    finally:
        proxy.close()
    assert proxy.lost.is_set()
    assert isinstance(lost, BaseException) or lost.is_error  # the agent never saw the refund
    assert example_db.refunds(charge) == 1  # but it was made
    again = succeeded(call(example_url, "refund_charge", arguments, via=via))
    assert is_replay(again)
    assert again.structured_content["charge"] == charge
    assert again.structured_content["left"] == 1500
    third = succeeded(call(example_url, "refund_charge", arguments, via=via))
    assert third.structured_content == again.structured_content
    assert third.content == again.content
    assert example_db.refunds(charge) == 1


def test_a_refused_token_runs_nothing(example_db, example_url, via):
    charge = example_db.charge()
    arguments = {"charge_id": charge, "amount": 1, "idempotency_key": str(uuid.uuid4())}
    result = mcp_agent.call_tool(example_url, "not-a-token", "refund_charge", arguments, via)
    assert isinstance(result, BaseException) or result.is_error
    assert example_db.refunds(charge) == 0


# -- (b) a storm of identical calls ------------------------------------------------------------


def test_a_storm_of_twenty_identical_calls_refunds_once(example_db, example_url, via):
    charge = example_db.charge()
    arguments = {"charge_id": charge, "amount": 700, "idempotency_key": str(uuid.uuid4())}
    start = threading.Barrier(20, timeout=WAIT)
    results: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        start.wait()
        result = call(example_url, "refund_charge", arguments, via=via)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT * 2)
    assert not any(thread.is_alive() for thread in threads)
    assert len(results) == 20
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
    firsts = [r for r in results if not r.is_error and not is_replay(r)]
    assert len(firsts) == 1, results
    (first,) = firsts
    for result in results:
        if result is first:
            continue
        if result.is_error:
            assert code_of(result) == "idempotency_key_in_use", result
            assert result.structured_content["retry_after"] >= 1
        else:
            assert is_replay(result)
            assert result.structured_content == first.structured_content
    assert example_db.refunds(charge) == 1


# -- (c) the server killed inside a tool -------------------------------------------------------


def killed_inside(
    example_db: ExampleDatabase, kill: str, name: str, arguments: dict, via: str
) -> None:
    """Call ``name`` through ``via`` on a server that SIGKILLs itself at ``kill``: no answer
    comes back."""
    starting_a_server("uvicorn (the example's ASGI app, with a kill point)")
    env = {**example_db.env, "MCP_KILL": kill}
    with mcp_agent.uvicorn_server(env, app="tests.mcp_kill_asgi:application") as url:
        result = call(url, name, arguments, via=via)
    assert isinstance(result, BaseException), result


def test_retry_a_refund_killed_before_its_commit_runs_again_and_refunds_once(
    example_db, example_url, via
):
    charge = example_db.charge()
    arguments = {"charge_id": charge, "amount": 300, "idempotency_key": str(uuid.uuid4())}
    killed_inside(
        example_db, "after:example_project.mcp_tools.enqueue", "refund_charge", arguments, via
    )
    assert example_db.refunds(charge) == 0  # its refund rolled back with the process
    # Another server process takes the retry: "in use" until the lease runs out, then it runs.
    answer = succeeded(
        mcp_agent.retry_until_answered(
            example_url, TOKENS["demo"], "refund_charge", arguments, via=via
        )
    )
    assert not is_replay(answer)
    assert example_db.refunds(charge) == 1
    assert is_replay(succeeded(call(example_url, "refund_charge", arguments, via=via)))
    assert example_db.refunds(charge) == 1


def test_fail_a_mail_killed_after_it_left_is_never_sent_again(example_db, example_url, via):
    amount = own_amount(411, via)  # the mails are counted by their amount
    refund = example_db.refund(example_db.charge(), amount=amount)
    arguments = {"refund_id": refund, "idempotency_key": str(uuid.uuid4())}
    killed_inside(
        example_db,
        "after:example_project.payments.mailer.send",
        "mail_refund_receipt",
        arguments,
        via,
    )
    assert example_db.mails(amount) == 1  # the mail left before the process died
    for _ in range(2):
        answer = mcp_agent.retry_until_answered(
            example_url, TOKENS["demo"], "mail_refund_receipt", arguments, via=via
        )
        assert code_of(answer) == "idempotency_outcome_unknown", answer
    assert example_db.mails(amount) == 1


def test_resume_a_refund_in_steps_killed_between_them_finishes_without_repeating(
    example_db, example_url, via
):
    charge = example_db.charge()
    amount = own_amount(522, via)  # the mails are counted by their amount
    arguments = {"charge_id": charge, "amount": amount, "idempotency_key": str(uuid.uuid4())}
    killed_inside(
        example_db,
        "before:example_project.mcp_tools.mail_receipt",
        "refund_and_mail",
        arguments,
        via,
    )
    assert example_db.refunds(charge) == 1  # the refund step is recorded
    assert example_db.mails(amount) == 0
    answer = succeeded(
        mcp_agent.retry_until_answered(
            example_url, TOKENS["demo"], "refund_and_mail", arguments, via=via
        )
    )
    assert not is_replay(answer)
    assert example_db.refunds(charge) == 1  # skipped: recorded
    assert example_db.mails(amount) == 1
    again = succeeded(call(example_url, "refund_and_mail", arguments, via=via))
    assert is_replay(again)
    assert again.structured_content == answer.structured_content
    assert (example_db.refunds(charge), example_db.mails(amount)) == (1, 1)


# -- (d) two accounts, one key -----------------------------------------------------------------


def test_two_accounts_with_one_key_get_two_refunds(example_db, example_url, via):
    key = str(uuid.uuid4())
    mine, theirs = example_db.charge("demo"), example_db.charge("other")
    first = succeeded(
        call(
            example_url,
            "refund_charge",
            {"charge_id": mine, "amount": 5, "idempotency_key": key},
            via=via,
        )
    )
    second = succeeded(
        call(
            example_url,
            "refund_charge",
            {"charge_id": theirs, "amount": 5, "idempotency_key": key},
            user="other",
            via=via,
        )
    )
    assert not is_replay(first)
    assert not is_replay(second)
    assert (example_db.refunds(mine), example_db.refunds(theirs)) == (1, 1)
    # Neither can touch the other's charge, whatever key it sends.
    stolen = call(
        example_url,
        "refund_charge",
        {"charge_id": theirs, "amount": 5, "idempotency_key": str(uuid.uuid4())},
        via=via,
    )
    assert not isinstance(stolen, BaseException)
    assert stolen.is_error
    assert example_db.refunds(theirs) == 1


def test_the_tools_are_listed_as_safe_to_retry(example_url, via):
    import anyio
    import fastmcp

    async def listed() -> list[Any]:
        with anyio.fail_after(WAIT):
            if via == "FastMCP":
                url = f"{example_url}{mcp_agent.SERVERS[via]}"
                async with fastmcp.Client(url, auth=TOKENS["demo"]) as agent:
                    return list(await agent.list_tools())
            async with mcp_agent.client(example_url, TOKENS["demo"]) as session:
                return list((await session.list_tools()).tools)

    tools = {tool.name: tool for tool in anyio.run(listed)}
    assert set(tools) == {"refund_charge", "mail_refund_receipt", "refund_and_mail"}
    for tool in tools.values():
        assert tool.annotations.idempotent_hint is True
        assert "idempotency_key" in tool.input_schema["properties"]
        assert "idempotency_key" in tool.input_schema.get("required", [])


# -- (e) the docs' agent clients, and a server on its own --------------------------------------


def test_the_docs_agent_client_retries_a_lost_answer_with_its_key(example_db, example_url, via):
    """docs/mcp.md's client code, through a proxy that loses the first answer: one refund,
    and the retry is its replay."""
    import anyio

    from example_project.docs_examples import agent_client

    refund = (
        agent_client.refund_with_fastmcp if via == "FastMCP" else agent_client.refund_with_the_sdk
    )
    charge = example_db.charge()
    host, port = example_url.removeprefix("http://").rsplit(":", 1)
    proxy = mcp_agent.LosingProxy((host, int(port)))
    try:
        proxy.armed.set()
        url = f"{proxy.url}{mcp_agent.SERVERS[via]}"
        result = anyio.run(refund, url, TOKENS["demo"], charge, 250)
    finally:
        proxy.close()
    assert proxy.lost.is_set()  # the first answer was lost
    assert not result.is_error, result
    assert is_replay(result)  # the retry got the refund the agent never heard of
    assert example_db.refunds(charge) == 1


def test_fastmcp_tools_served_on_their_own_refund_once(example_db):
    """docs/mcp.md's stand-alone FastMCP server (example_project/docs_examples/agent_server.py),
    without the Django site around it."""
    import anyio

    from example_project.docs_examples import agent_client

    starting_a_server("the example's FastMCP tools on their own")
    port = mcp_agent.free_port()
    env = {**example_db.env, "MCP_PORT": str(port), "FASTMCP_LOG_LEVEL": "WARNING"}
    process = subprocess.Popen(
        [sys.executable, "-m", "example_project.docs_examples.agent_server"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + WAIT
        while True:  # until it listens
            assert process.poll() is None, "the server exited during start-up"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"the server did not listen within {WAIT} s"
                time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/mcp"
        charge = example_db.charge()
        result = anyio.run(agent_client.refund_with_fastmcp, url, TOKENS["demo"], charge, 125)
        assert not result.is_error, result
        assert not is_replay(result)
        assert example_db.refunds(charge) == 1
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=WAIT)
