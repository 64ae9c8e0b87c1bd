"""Helpers for tests that talk to a real server over HTTP, each request on its own socket."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection

from django_idempotency.testing import Answer, send

ROOT = Path(__file__).resolve().parent.parent


DISCONNECTED = Answer(status=0, error="no answer")


# -- the `servers` marker --------------------------------------------------------------------
#
# A test that starts a server or a worker process carries the marker `servers` (pyproject.toml),
# so that `make test-quick` (-m "not servers") leaves it out. tests/conftest.py marks the tests
# that use a fixture of SERVER_FIXTURES there; the others are marked by hand. So that a mark is
# never forgotten, every helper that starts such a process calls `starting_a_server` first,
# which fails the running test when it is not marked.

#: Set by tests/conftest.py: whether this process is a pytest run (the scripts of tests/,
#: such as ``python -m tests.poolers``, start servers with no test around them), and the test
#: being run, its fixtures' setup and teardown included (None between tests).
under_pytest = False
running_test: pytest.Item | None = None


def starting_a_server(what: str) -> None:
    """Fail the running test unless it is marked ``servers``: ``what`` is about to start."""
    if not under_pytest:
        return
    item = running_test
    if item is not None and item.get_closest_marker("servers") is not None:
        return
    where = item.nodeid if item is not None else "no test (collection, or a hook)"
    pytest.fail(
        f"{what} is starting in {where}, which is not marked `servers`: mark the test (or its "
        "module's pytestmark) with @pytest.mark.servers, or add the fixture that starts it to "
        "SERVER_FIXTURES in tests/conftest.py",
        pytrace=False,
    )


def basic_auth(username: str, password: str = "password") -> dict[str, str]:
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def request(
    base_url: str,
    method: str,
    path: str,
    payload: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> Answer:
    """One HTTP request (``django_idempotency.testing.send``; a JSON body, ``{}`` by
    default); ``DISCONNECTED`` when the server dropped the connection or never answered."""
    answer = send(
        base_url,
        path,
        payload if payload is not None else {},
        headers={"Content-Type": "application/json", **(headers or {})},
        method=method,
        timeout=timeout,
    )
    return DISCONNECTED if answer.error else answer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def finished(process: subprocess.Popen[str], timeout: float = 60) -> str:
    """Wait for a process to end; its output. Killed (and the test failed) after ``timeout``."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=10)
        raise AssertionError(f"the process did not end within {timeout} s") from None
    assert process.returncode == 0, err
    return out


def migrate(database_env: dict[str, str], timeout: float) -> None:
    """``manage.py migrate`` of the test project, in a process, on the database that
    ``database_env`` names (``tests.settings``'s variables: a private server's)."""
    env = {
        **os.environ,
        **database_env,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
    }
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=timeout,
    )


def server_env(extra_env: dict[str, str] | None) -> dict[str, str]:
    settings = connection.settings_dict
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        # The server reaches the database as this run does: directly, or through a pooler.
        "TEST_DB": django_settings.TEST_DB if connection.vendor == "postgresql" else "mysql",
        "DB_NAME": settings["NAME"],
        "PGHOST": settings["HOST"] or "127.0.0.1",
        "PGPORT": str(settings["PORT"] or 5432),
        "PGUSER": settings["USER"],
        "PYTHONPATH": str(ROOT),
        **(extra_env or {}),
    }


@contextmanager
def gunicorn(
    workers: int = 2, extra_env: dict[str, str] | None = None, threads: int = 1
) -> Iterator[str]:
    """A real multi-process WSGI server on the test database; yields its base URL.
    ``threads``: requests each worker serves at once (gunicorn's gthread workers)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "tests.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(workers),
        "--timeout",
        "60",
        "--graceful-timeout",
        "2",
        "--log-level",
        "warning",
    ]
    if threads > 1:
        command += ["--worker-class", "gthread", "--threads", str(threads)]
    with _serve(command, port, extra_env) as url:
        yield url


@contextmanager
def uvicorn(extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A real ASGI server (uvicorn) on the test database; yields its base URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "tests.asgi:application",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    with _serve(command, port, extra_env) as url:
        yield url


@contextmanager
def _serve(command: list[str], port: int, extra_env: dict[str, str] | None) -> Iterator[str]:
    starting_a_server(command[2])
    process = subprocess.Popen(command, cwd=ROOT, env=server_env(extra_env), start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{command[2]} exited during start-up")
            # 200 only: a 500 here means the server reached the wrong database.
            if request(base_url, "GET", "/charges/", timeout=2).status == 200:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{command[2]} did not start within 30 s")
        yield base_url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
