"""An agent's refund whose answer is lost on the way back, retried with the same key: one refund,
through the SDK's ``MCPServer`` and through FastMCP.

    python -m example_project.mcp_agent            # starts the example under uvicorn itself
    python -m example_project.mcp_agent --url http://127.0.0.1:8000   # or an ASGI server of it

The script runs the example project under uvicorn (``example_project.asgi``: the API, the
SDK's MCP server at ``/mcp`` and FastMCP's at ``/fastmcp``) on a free port, unless ``--url``
names one, and puts a small proxy in front of it that forwards the first ``tools/call`` and
swallows its answer: the refund is made, the agent never hears of it, as after a timeout or a
dropped connection. The agent, each framework's own client over streamable HTTP, does what an
agent should: it calls ``refund_charge`` again with the same ``idempotency_key``. The retry
gets the first call's result, marked ``_meta.idempotentReplayed``, and the charge has one
refund: once through each server.

It counts the refunds through the ORM: run it with the server's settings (the same
``EXAMPLE_DB``). Exit status 0 when the charge got one refund and the retry was the replay of
the refund the agent never heard of; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "demo-agent-token"
WAIT = 60  # seconds: the bound on every wait


# -- a proxy that loses answers ------------------------------------------------------------------


class LosingProxy:
    """A TCP proxy in front of ``upstream`` (host, port) that, while ``armed``, forwards the
    next HTTP request carrying a ``tools/call`` and swallows its answer: it reads the answer
    from the server (so the server finished the call) and closes the client's connection
    without a byte of it. Every other request and answer passes through."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.armed = threading.Event()
        self.lost = threading.Event()  # set once an answer was swallowed
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=WAIT)
        except OSError:
            client.close()
            return
        client.settimeout(WAIT)
        swallowing = threading.Event()

        def upstream_to_client() -> None:
            swallowed = b""
            with contextlib.suppress(OSError):
                while data := server.recv(65536):
                    if not swallowing.is_set():
                        client.sendall(data)
                        continue
                    swallowed += data
                    if b'"result"' in swallowed or b'"error"' in swallowed:
                        break  # the server answered: the client never sees it
            if swallowing.is_set():
                self.lost.set()
            for sock in (client, server):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

        answers = threading.Thread(target=upstream_to_client, daemon=True)
        answers.start()
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if b'"tools/call"' in data and self.armed.is_set():
                    self.armed.clear()
                    swallowing.set()
                server.sendall(data)
        answers.join(WAIT)


# -- the agent's side ----------------------------------------------------------------------------


#: The example's MCP servers: the framework, and where it is mounted.
SERVERS = {"MCPServer": "/mcp", "FastMCP": "/fastmcp"}


@contextlib.asynccontextmanager
async def client(url: str, token: str) -> AsyncIterator[Any]:
    """The SDK's client over streamable HTTP to the example's ``/mcp``, with a bearer token;
    its HTTP client closed at the end."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=WAIT) as http,
        Client(streamable_http_client(f"{url}/mcp", http_client=http)) as session,
    ):
        yield session


async def call_through(url: str, token: str, name: str, arguments: dict[str, Any], via: str) -> Any:
    """One tool call through ``via``'s own client: the SDK's to ``/mcp``, FastMCP's to
    ``/fastmcp`` (its result has the same fields: ``content``, ``structured_content``,
    ``is_error``, ``meta``)."""
    if via == "FastMCP":
        import fastmcp

        async with fastmcp.Client(f"{url}{SERVERS[via]}", auth=token, timeout=WAIT) as agent:
            return await agent.call_tool(name, arguments, raise_on_error=False)
    async with client(url, token) as session:
        return await session.call_tool(name, arguments)


def call_tool(
    url: str, token: str, name: str, arguments: dict[str, Any], via: str = "MCPServer"
) -> Any:
    """One tool call on a connection of its own, as an agent's retry after an error makes it:
    the result, or the exception that took its answer."""
    import anyio

    async def go() -> Any:
        with anyio.fail_after(WAIT):
            return await call_through(url, token, name, arguments, via)

    try:
        return anyio.run(go)
    except BaseException as error:  # the answer was lost: whatever the transport raised
        if isinstance(error, KeyboardInterrupt):
            raise
        return error


def retry_until_answered(
    url: str,
    token: str,
    name: str,
    arguments: dict[str, Any],
    *,
    attempts: int = 20,
    via: str = "MCPServer",
) -> Any:
    """Call until an answer comes that is not ``idempotency_key_in_use``, sleeping its
    ``retry_after`` between: what an agent's retry loop does. The last answer."""
    answer: Any = None
    for _ in range(attempts):
        answer = call_tool(url, token, name, arguments, via)
        if isinstance(answer, BaseException):
            time.sleep(0.5)
            continue
        refusal = answer.structured_content if answer.is_error else None
        if refusal and refusal.get("code") == "idempotency_key_in_use":
            time.sleep(min(int(refusal["retry_after"]), 10))
            continue
        return answer
    return answer


# -- the example under uvicorn -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def uvicorn_server(
    env: dict[str, str], port: int | None = None, app: str = "example_project.asgi:application"
) -> Iterator[str]:
    """``app`` (the example's ASGI app) under uvicorn on ``port`` (a free one by default), in a
    process group of its own; its URL once it answers. Stopped at the end if still alive."""
    import httpx2

    port = port or free_port()
    env = {"FASTMCP_LOG_LEVEL": "WARNING", **env}  # FastMCP's start-up lines, not the demo's
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            app,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT
        while True:
            if process.poll() is not None:
                raise RuntimeError("uvicorn exited during start-up")
            try:
                httpx2.get(f"{url}/admin/login/", timeout=2)
                break
            except httpx2.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"uvicorn did not start within {WAIT} s") from None
                time.sleep(0.2)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


# -- the demo ------------------------------------------------------------------------------------


def demo(url: str) -> int:
    """The lost answer and its retry through each of the example's servers: 0 when each
    charge got one refund and each retry was its replay."""
    import django

    django.setup()
    failed = [via for via in SERVERS if lost_and_retried(url, via) != 0]
    return 1 if failed else 0


def lost_and_retried(url: str, via: str) -> int:
    from django.contrib.auth.models import User

    from example_project.payments.models import Charge, Refund

    user = User.objects.get(username="demo")
    charge = Charge.objects.create(
        user=user, amount=2000, currency="EUR", provider_charge_id=f"ch_demo_{uuid.uuid4().hex}"
    )
    host, port = url.removeprefix("http://").rsplit(":", 1)
    proxy = LosingProxy((host, int(port)))
    key = str(uuid.uuid4())
    arguments = {"charge_id": charge.pk, "amount": 500, "idempotency_key": key}
    print(f"==> {via} ({SERVERS[via]}): an agent refunds 500 of charge {charge.pk}")
    print(f"    (idempotency_key {key}).")
    proxy.armed.set()
    lost = call_tool(proxy.url, TOKEN, "refund_charge", arguments, via)
    proxy.close()
    if not proxy.lost.is_set():
        print(f"the proxy lost no answer: {lost!r}", file=sys.stderr)
        return 1
    print(f"    The answer was lost on the way back ({type(lost).__name__}).")
    print("==> The agent retries with the same idempotency_key.")
    again = retry_until_answered(url, TOKEN, "refund_charge", arguments, via=via)
    if isinstance(again, BaseException) or again.is_error:
        print(f"the retry failed: {again!r}", file=sys.stderr)
        return 1
    replayed = bool((again.meta or {}).get("idempotentReplayed"))
    print(f"    Result: {again.structured_content} (idempotentReplayed: {replayed})")
    refunds = list(Refund.objects.filter(charge=charge).values_list("pk", "amount"))
    print(f"==> Refunds of charge {charge.pk}: {len(refunds)} {refunds}")
    ok = len(refunds) == 1 and replayed and again.structured_content["refund"] == refunds[0][0]
    print("One refund, and the retry got its result." if ok else "NOT what was expected.")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running ASGI server of the example (default: start one)")
    options = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    if options.url:
        return demo(options.url.rstrip("/"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with uvicorn_server(env) as url:
        return demo(url)


if __name__ == "__main__":
    sys.exit(main())
