"""``django_idempotency.testing`` used the way a project's own tests get it wrong, or in a
project whose settings differ from the defaults: every helper still checks what it says, and
its failure says what differs (never a crash of the helper, never a misleading reason)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.http import StreamingHttpResponse
from django.test import AsyncClient, Client, override_settings

from django_idempotency.testing import (
    Answer,
    FakeProvider,
    assert_idempotent,
    assert_replay,
    crash_after,
    crash_before,
    new_key,
    pause_after,
    send,
    settle,
)
from tests.testapp import provider as testapp_provider
from tests.testapp.models import Charge

CHARGE = {"amount": 100, "currency": "EUR"}


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> FakeProvider:
    fake = FakeProvider(key_argument=0, answer=lambda n: n)
    monkeypatch.setattr(testapp_provider, "charge", fake)
    return fake


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


# -- the key header of the project's settings --------------------------------------------------


@pytest.mark.django_db
@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
def test_assert_idempotent_sends_the_key_in_the_header_of_the_settings(user, provider):
    check = assert_idempotent(logged_in(user), "/charges/", CHARGE, changed={**CHARGE, "amount": 5})
    assert (check.first.status_code, check.refused and check.refused.status_code) == (201, 422)
    assert (len(provider.calls), Charge.objects.count()) == (1, 1)


# -- a first attempt this package refused: the view never ran -----------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "code"),
    [("a b", "idempotency_key_invalid"), ("x" * 256, "idempotency_key_invalid")],
)
def test_a_first_attempt_refused_says_the_view_never_ran(user, provider, key, code):
    with pytest.raises(AssertionError, match=f"refused.*{code}.*never ran") as failure:
        assert_idempotent(logged_in(user), "/charges/", CHARGE, changed=None, key=key)
    assert "ran again" not in str(failure.value)
    assert provider.calls == []


@pytest.mark.django_db
def test_a_key_the_endpoint_does_not_read_says_so(user, provider):
    # The tenant view's account comes from X-Tenant: without it the caller has no account.
    with pytest.raises(AssertionError, match=r"idempotency_account_missing.*never ran"):
        assert_idempotent(logged_in(user), "/charges/tenant/", CHARGE, changed=None)
    assert provider.calls == []


# -- a streamed response -------------------------------------------------------------------------


def test_an_answer_leaves_a_streamed_response_readable():
    response = StreamingHttpResponse(iter([b"ab", b"cd"]), content_type="text/plain")
    assert Answer.of(response).body == b"abcd"
    assert Answer.of(response).body == b"abcd"
    assert b"".join(response.streaming_content) == b"abcd"


@pytest.mark.django_db
def test_a_streamed_first_answer_is_named_as_such(user):
    with pytest.raises(AssertionError, match=r"not_storable.*a 5xx is never stored") as failure:
        assert_idempotent(logged_in(user), "/outcome/", {"stream": True}, changed=None)
    assert "ran again" not in str(failure.value)


# -- an async client ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_async_client_is_refused_clearly(user):
    client = AsyncClient()
    client.force_login(user)
    with pytest.raises(TypeError, match="AsyncClient"):
        assert_idempotent(client, "/charges/", CHARGE, changed=None)
    assert Charge.objects.count() == 0


def test_an_unawaited_response_is_refused_clearly():
    async def request() -> Any:
        return None

    pending = request()
    with pytest.raises(TypeError, match="await"):
        assert_replay(pending, pending)
    assert pending.cr_frame is None  # closed: no "never awaited" warning later


# -- crashes and pauses at an async call --------------------------------------------------------

PAID: list[str] = []


async def async_charge(key: str) -> str:
    await asyncio.sleep(0)
    PAID.append(key)
    return key


async def async_view(key: str) -> str:
    return await async_charge(key)


def test_crash_after_an_async_call_crashes_after_it_ran():
    PAID.clear()
    with crash_after(f"{__name__}.async_charge") as point:
        asyncio.run(async_view("k"))
    assert point.crashed
    assert PAID == ["k"]  # the call happened, then the process died


def test_crash_before_an_async_call_never_runs_it():
    PAID.clear()
    with crash_before(f"{__name__}.async_charge"):
        asyncio.run(async_view("k"))
    assert PAID == []


def test_pause_after_an_async_call_holds_it_after_it_ran():
    PAID.clear()

    async def scenario() -> str:
        with pause_after(f"{__name__}.async_charge") as paused:
            task = asyncio.ensure_future(async_view("k"))
            await asyncio.to_thread(paused.wait, 5)
            assert PAID == ["k"]  # held after the call, not before it
            assert not task.done()
            paused.resume()
            return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) == "k"


# -- helpers that could not fail -----------------------------------------------------------------


@pytest.mark.django_db
def test_one_caller_is_no_isolation_check(user):
    from django_idempotency.testing import assert_accounts_isolated

    with pytest.raises(ValueError, match="at least 2"):
        assert_accounts_isolated([logged_in(user)], "/charges/", CHARGE)
    assert Charge.objects.count() == 0


def test_new_key_is_fresh():
    assert new_key() != new_key()


# -- how long the live helpers wait ----------------------------------------------------------


@contextmanager
def always_in_use() -> Iterator[str]:
    """A server that answers every request ``409``, as to a duplicate in flight."""

    class InUse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(409)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), InUse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("timeout", [0, -1, -0.5])
def test_send_refuses_a_timeout_that_is_not_positive(timeout):
    """Before, ``timeout=0`` raised ``BlockingIOError`` from inside http.client and a
    negative one ``ValueError: Timeout value out of range``."""
    with (
        always_in_use() as url,
        pytest.raises(ValueError, match=r"timeout must be more than 0 seconds"),
    ):
        send(url, "/", {}, timeout=timeout)


def test_settle_whose_last_pause_ran_past_its_deadline_fails_with_its_own_message(monkeypatch):
    """A pause that overruns (a loaded machine) ends past the deadline: ``settle`` fails
    the test with the last answer, never with the timeout of a request still to send.
    Before, the next request got a negative timeout and raised ``ValueError``."""
    from django_idempotency.testing import live

    sleep = time.sleep
    monkeypatch.setattr(live.time, "sleep", lambda seconds: sleep(seconds + 0.15))
    with (
        always_in_use() as url,
        pytest.raises(AssertionError, match=r"still no outcome after 0.3 s: .*409"),
    ):
        settle(url, "/", {}, timeout=0.3, pause=0.05)


# -- names stored by their hash ----------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("account", "operation"),
    [
        ("tenant:" + "x" * 300, "reports.build"),
        ("team: night shift ", "reports.build"),
        ("user:1", "POST /" + "very-long/" * 30),
    ],
    ids=["account over 255 characters", "account ending in a space", "long operation"],
)
def test_record_for_finds_a_record_whose_names_are_stored_by_their_hash(account, operation):
    """Before, ``record_for`` compared ``account`` and ``operation`` with the columns as
    they are, and failed the test with "no idempotency record" for a name stored by its
    hash; ``expire_lease`` and ``expire_ttl`` (which find it the same way) failed too."""
    from django_idempotency import run_once
    from django_idempotency.testing import expire_ttl, record_for

    run_once(lambda: 1, account=account, operation=operation, key="hashed-1")
    run_once(lambda: 2, account="user:2", operation="reports.build", key="hashed-1")
    found = record_for("hashed-1", account=account, operation=operation)
    assert found.status == "completed"
    assert expire_ttl("hashed-1", account=account, operation=operation).pk == found.pk
