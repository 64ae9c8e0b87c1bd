"""``django_idempotency.testing``: each helper passes on a protected endpoint and fails on an
unprotected one, through every adapter, in pytest's ``db`` and in Django's ``TestCase``.

The provider is the toolkit's own ``FakeProvider`` in place of the test app's: it counts
calls and effects in memory, like a remote system that a rollback cannot touch, so these
tests run inside the test's transaction (what ``TestCase`` users get).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from typing import Any
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.http import StreamingHttpResponse
from django.test import AsyncClient, Client, TestCase, override_settings
from django.utils import timezone

from django_idempotency import run_once
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import (
    Answer,
    FakeProvider,
    assert_accounts_isolated,
    assert_idempotent,
    assert_problem,
    assert_replay,
    assert_single_execution,
    crash,
    crash_after,
    crash_before,
    expect_crash,
    expire_lease,
    expire_ttl,
    login_headers,
    new_key,
    pause_after,
    record_for,
    redeliver,
    send,
    settle,
    storm,
)
from tests.factories import UserFactory
from tests.helpers import needs_drf, needs_ninja, postgres_only
from tests.testapp import provider as testapp_provider
from tests.testapp.models import Charge

CHARGE = {"amount": 100, "currency": "EUR"}
PROVIDER = "tests.testapp.provider.charge"
# Its unprotected views (the URLconf imports DRF and ninja).
AUDIT_URLS = "tests.testapp.audit_urls"


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> FakeProvider:
    # The test app's provider takes the key first, and its answer is an integer id.
    fake = FakeProvider(key_argument=0, answer=lambda n: n)
    monkeypatch.setattr(testapp_provider, "charge", fake)
    return fake


def logged_in(user: Any, path: str = "/") -> Any:
    if path.startswith("/api/"):
        from rest_framework.test import APIClient

        api = APIClient()
        api.force_authenticate(user)
        return api
    client = Client()
    client.force_login(user)
    return client


def post(client: Any, path: str, key: str, payload: Any = CHARGE) -> Any:
    return client.post(
        path, payload, content_type="application/json", headers={"Idempotency-Key": key}
    )


# Every adapter: the decorator on a function view and on a class-based view, the DRF mixin,
# @api_view over @idempotent, and ninja's decorator.
ADAPTERS = [
    "/charges/",
    "/cbv/charges/",
    pytest.param("/api/charges/", marks=needs_drf),
    pytest.param("/api/fn-charges/", marks=needs_drf),
    pytest.param("/ninja/charges", marks=needs_ninja),
]

# -- replays ----------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("path", ADAPTERS)
def test_assert_idempotent_passes_on_every_adapter(user, provider, path):
    check = assert_idempotent(logged_in(user, path), path, CHARGE, changed={**CHARGE, "amount": 5})
    assert check.first.status_code == 201
    assert check.refused is not None
    assert check.refused.status_code == 422
    assert (len(provider.calls), len(provider.effects)) == (1, 1)
    assert Charge.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("encoded", [json.dumps, lambda charge: json.dumps(charge).encode()])
def test_assert_idempotent_sends_a_payload_already_encoded_as_it_is(user, provider, encoded):
    path = "/charges/"
    check = assert_idempotent(
        logged_in(user, path), path, encoded(CHARGE), changed=encoded({**CHARGE, "amount": 5})
    )
    assert (check.first.status_code, check.refused.status_code) == (201, 422)
    assert (len(provider.calls), Charge.objects.count()) == (1, 1)


def test_an_answer_of_a_streamed_response_and_of_a_problem_that_is_no_json():
    streamed = Answer.of(StreamingHttpResponse([b'{"a":', b" 1}"], content_type="text/plain"))
    assert (streamed.status, streamed.json()) == (200, {"a": 1})
    problem = {"content-type": "application/problem+json"}
    assert Answer(400, problem, b'{"code": "idempotency_key_missing"}').problem_code() == (
        "idempotency_key_missing"
    )
    assert Answer(400, problem, b"not json").problem_code() is None
    assert Answer(400, problem, b'["a list"]').problem_code() is None
    assert Answer(400, problem, b'{"code": 7}').problem_code() is None


@needs_drf
@needs_ninja
@pytest.mark.django_db
@pytest.mark.urls(AUDIT_URLS)
def test_assert_idempotent_fails_on_an_unprotected_view(user):
    with pytest.raises(AssertionError, match="the retry was not replayed"):
        assert_idempotent(logged_in(user), "/orders/", CHARGE, changed=None)
    assert Charge.objects.count() == 2  # it did run twice


@pytest.mark.django_db
def test_assert_idempotent_names_a_key_in_use_or_reused(user, provider):
    client = logged_in(user)
    check = assert_idempotent(client, "/charges/", CHARGE, changed=None)
    with pytest.raises(AssertionError, match="used before with another request"):
        assert_idempotent(client, "/charges/", {**CHARGE, "amount": 7}, changed=None, key=check.key)
    with pytest.raises(AssertionError, match="is itself a replay"):
        assert_idempotent(client, "/charges/", CHARGE, changed=None, key=check.key)
    assert len(provider.effects) == 1


@pytest.mark.django_db
def test_assert_idempotent_refuses_to_call_a_5xx_an_outcome(user):
    client = logged_in(user)
    with pytest.raises(AssertionError, match="a 5xx is never stored"):
        assert_idempotent(client, "/outcome/", {"status": 503}, changed=None)


def answer(status: int = 201, body: bytes = b"{}", **headers: str) -> Answer:
    return Answer(status, {"content-type": "application/json", **headers}, body)


@pytest.mark.parametrize(
    ("replay", "message"),
    [
        (answer(), "the retry was not replayed"),
        (answer(200, **{"idempotent-replayed": "true"}), "status is 200"),
        (answer(body=b"[]", **{"idempotent-replayed": "true"}), "body differs"),
        (answer(**{"idempotent-replayed": "true", "location": "/x/"}), "location"),
        (
            answer(**{"idempotent-replayed": "true", "content-type": "text/plain"}),
            "content-type",
        ),
    ],
)
def test_assert_replay_compares_status_body_and_headers(replay, message):
    with pytest.raises(AssertionError, match=message):
        assert_replay(answer(), replay)
    assert_replay(answer(), answer(**{"idempotent-replayed": "true"}))


def test_assert_problem_wants_our_problem_and_its_code():
    problem = Answer(409, {"content-type": "application/problem+json"}, b'{"code": "x"}')
    assert assert_problem(problem, "x", 409) == {"code": "x"}
    with pytest.raises(AssertionError, match="expected the problem 'y'"):
        assert_problem(problem, "y")
    with pytest.raises(AssertionError, match="expected 422"):
        assert_problem(problem, "x", 422)
    with pytest.raises(AssertionError, match="expected the problem"):
        assert_problem(answer(409, b'{"code": "x"}'), "x")  # JSON, but no problem+json


@pytest.mark.django_db
def test_assert_accounts_isolated_runs_once_per_caller(user, other_user, provider):
    alice, bob = logged_in(user), logged_in(other_user)
    checks = assert_accounts_isolated([alice, bob], "/charges/", CHARGE)
    assert checks[0].key == checks[1].key
    assert checks[0].first.content != checks[1].first.content
    assert len(provider.effects) == 2  # each account's downstream key is its own
    assert Charge.objects.count() == 2


@pytest.mark.django_db
def test_assert_accounts_isolated_fails_when_two_callers_share_an_account(
    user, other_user, provider
):
    # The tenant view scopes keys by a header: both callers claim to be the same tenant.
    acme = {"X-Tenant": "acme"}
    with pytest.raises(AssertionError, match="is itself a replay"):
        assert_accounts_isolated(
            [logged_in(user), logged_in(other_user)], "/charges/tenant/", CHARGE, headers=acme
        )
    assert len(provider.effects) == 1


# -- crashes, leases and the TTL -----------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("path", ADAPTERS)
def test_a_crash_after_the_provider_then_the_retry_policy(user, provider, path):
    client, key = logged_in(user, path), new_key()
    with crash_after(PROVIDER) as point:
        post(client, path, key)
    assert (point.calls, point.crashed) == (1, True)
    assert Charge.objects.count() == 0  # rolled back with the attempt
    assert len(provider.effects) == 1  # the external call happened
    record = record_for(key)
    assert record.status == RecordStatus.IN_PROGRESS  # held, as a killed process leaves it
    assert_problem(post(client, path, key), "idempotency_key_in_use", 409)

    expire_lease(key)
    retry = post(client, path, key)
    assert retry.status_code == 201
    assert not retry.has_header("Idempotent-Replayed")
    assert_replay(retry, post(client, path, key))
    assert (len(provider.calls), len(provider.effects)) == (2, 1)  # the same downstream key
    assert Charge.objects.count() == 1
    assert record_for(key).recovery_attempts == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("account", "operation"),
    [("consumer:nul\x00", "orders.ship"), ("consumer", "orders.ship:\ud800")],
    ids=["account with a NUL", "operation with a lone surrogate"],
)
def test_a_record_whose_name_no_database_holds_is_found_by_that_name(account, operation):
    """A name holding a NUL or a lone surrogate is stored by its hash; ``record_for`` and
    ``expire_lease`` also compared the column with the name as given, which the driver
    refuses to send (PostgreSQL a NUL or a lone surrogate, MariaDB a lone surrogate): the
    test failed, and the recovery of such a caller's operation could not be tested.
    Counted: the body's runs."""
    key = new_key()
    runs: list[str] = []

    def ship() -> str:
        runs.append("ran")
        if len(runs) == 1:
            crash()
        return "shipped"

    with pytest.raises(SimulatedCrash):
        run_once(ship, account=account, operation=operation, key=key)
    assert record_for(key, account=account, operation=operation).status == "in_progress"
    expire_lease(key, account=account, operation=operation)
    assert run_once(ship, account=account, operation=operation, key=key) == "shipped"
    assert runs == ["ran", "ran"]
    expire_ttl(key, account=account, operation=operation)
    assert record_for(key, operation=operation).expires_at <= timezone.now()


@pytest.mark.django_db
def test_a_crash_then_the_fail_policy_never_runs_again(user, provider):
    client, key = logged_in(user), new_key()
    with crash_after(PROVIDER):
        post(client, "/charges/fail-policy/", key)
    expire_lease(key)
    closed = post(client, "/charges/fail-policy/", key)
    assert_problem(closed, "idempotency_outcome_unknown", 500)
    assert closed.has_header("Idempotent-Replayed")  # the stored "unknown", to every retry
    assert post(client, "/charges/fail-policy/", key).content == closed.content
    assert len(provider.calls) == 1
    assert Charge.objects.count() == 0
    assert record_for(key).status == RecordStatus.FAILED


@pytest.mark.django_db
def test_a_crash_then_a_recovery_callable_answers(user, provider):
    client, key = logged_in(user), "known-" + new_key()
    with crash_after(PROVIDER):
        post(client, "/charges/callable-policy/", key)
    expire_lease(key)
    answered = post(client, "/charges/callable-policy/", key)
    assert answered.status_code == 200
    assert answered.json() == {"recovered": key}
    assert len(provider.calls) == 1


@pytest.mark.django_db
def test_a_crash_before_the_provider_leaves_no_effect(user, provider):
    client, key = logged_in(user), new_key()
    with crash_before(PROVIDER) as point:
        post(client, "/charges/", key)
    assert point.crashed
    assert provider.calls == []
    expire_lease(key)
    assert post(client, "/charges/", key).status_code == 201
    assert len(provider.effects) == 1


def external() -> str:
    return "called"


def swallowing() -> None:
    with contextlib.suppress(BaseException):  # what a killed process never allows
        external()


def test_crash_after_fails_when_nothing_crashed():
    here = f"{__name__}.external"
    with pytest.raises(AssertionError, match="was never called"), crash_after(here):
        pass
    with pytest.raises(AssertionError, match="fewer than 2"), crash_after(here, on_call=2):
        external()
    with pytest.raises(AssertionError, match="caught inside the block"), crash_after(here):
        swallowing()
    assert external() == "called"  # unpatched again
    with pytest.raises(ValueError, match="counts calls from 1"), crash_after(here, on_call=0):
        pass
    with pytest.raises(ValueError, match="not a dotted path"), crash_after("external"):
        pass


def test_crash_and_expect_crash():
    with expect_crash():
        crash()
    with (
        pytest.raises(AssertionError, match="without the expected simulated crash"),
        expect_crash(),
    ):
        pass
    with pytest.raises(SimulatedCrash), crash_after(f"{__name__}.external"):
        raise SimulatedCrash("another crash than the one asked for")


@pytest.mark.django_db(transaction=True)
def test_a_crash_inside_an_async_view(user, provider):
    client, key = AsyncClient(), new_key()
    client.force_login(user)

    async def attempt() -> Any:
        try:
            return await post(client, "/async/charges/", key)
        finally:
            await sync_to_async(connections.close_all)()

    with crash_after(PROVIDER):
        asyncio.run(attempt())
    assert Charge.objects.count() == 0
    expire_lease(key)
    assert asyncio.run(attempt()).status_code == 201
    assert (len(provider.calls), len(provider.effects)) == (2, 1)


@pytest.mark.django_db
def test_a_crash_inside_run_once(provider):
    def ship(order: int) -> int:
        return int(testapp_provider.charge(f"ship-{order}", 1, "EUR"))

    def ship_once() -> int:
        return run_once(ship, 7, account="consumer", operation="orders.ship", key="m-1")

    with crash_after(PROVIDER):
        ship_once()
    assert record_for("m-1", account="consumer").status == RecordStatus.IN_PROGRESS
    expire_lease("m-1")
    assert ship_once() == ship_once() == 1
    assert len(provider.calls) == 2  # the crashed attempt's call and the retry's
    assert len(provider.effects) == 1


@pytest.mark.django_db
def test_expire_ttl_makes_the_key_new(user, provider):
    client, key = logged_in(user), new_key()
    first = post(client, "/charges/", key)
    assert post(client, "/charges/", key).has_header("Idempotent-Replayed")
    with pytest.raises(AssertionError, match="only an in-progress record holds a lease"):
        expire_lease(key)
    assert expire_ttl(key).expires_at < timezone.now()
    again = post(client, "/charges/", key)
    assert again.status_code == 201
    assert not again.has_header("Idempotent-Replayed")
    assert again.content != first.content
    assert Charge.objects.count() == 2


@pytest.mark.django_db
def test_record_for_finds_the_newest_record_of_a_key(user, other_user, provider):
    key = new_key()
    with pytest.raises(AssertionError, match="no idempotency record for key"):
        record_for(key)
    post(logged_in(user), "/charges/", key)
    post(logged_in(other_user), "/charges/", key)
    assert record_for(key).account == f"user:{other_user.pk}"
    mine = record_for(key, account=f"user:{user.pk}", operation="POST charges/")
    assert mine.account == f"user:{user.pk}"
    assert record_for(mine) == mine
    with pytest.raises(AssertionError, match="operation 'nope'"):
        record_for(key, operation="nope")
    IdempotencyRecord.objects.filter(pk=mine.pk).delete()
    with pytest.raises(AssertionError, match="is gone"):
        record_for(mine)


class ToolkitInATestCase(TestCase):
    """The same helpers inside Django's TestCase: each test is one rolled-back transaction."""

    def setUp(self) -> None:
        self.provider = FakeProvider(key_argument=0, answer=lambda n: n)
        patcher = mock.patch(PROVIDER, self.provider)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.client.force_login(UserFactory())

    def test_replay_and_crash_recovery(self) -> None:
        assert_idempotent(self.client, "/charges/", CHARGE, changed={"amount": 1})
        key = new_key()
        with crash_after(PROVIDER):
            post(self.client, "/charges/", key)
        expire_lease(key)
        assert post(self.client, "/charges/", key).status_code == 201
        assert len(self.provider.effects) == 2  # one per key
        assert Charge.objects.count() == 2


# -- the provider -------------------------------------------------------------------------------


def test_fake_provider_answers_a_key_once():
    provider = FakeProvider()
    first = provider(100, idempotency_key="k")
    assert provider(100, idempotency_key="k") is first
    assert provider(100) == {"id": "fake_2"}  # no key: a new effect every time
    assert provider(100, idempotency_key=None) == {"id": "fake_3"}
    assert first == {"id": "fake_1"}
    assert [call.key for call in provider.calls] == ["k", "k", None, None]
    assert len(provider.effects) == 3
    positional = FakeProvider(key_argument=0)
    positional("k")
    positional("k")
    assert len(positional.effects) == 1


def test_fake_provider_counts_calls_from_many_threads():
    provider = FakeProvider()
    threads = [
        threading.Thread(target=provider, kwargs={"idempotency_key": f"k{i % 5}"})
        for i in range(40)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert (len(provider.calls), len(provider.effects)) == (40, 5)


# -- queues ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_redeliver_runs_a_deduplicated_task_once():
    pytest.importorskip("celery")
    from tests.testapp.models import ProviderCall
    from tests.testapp.tasks import record_effect

    results = redeliver(record_effect, "twice", times=3)
    assert results[0] == results[1] == results[2]
    assert ProviderCall.objects.filter(key="effect:twice").count() == 1
    with pytest.raises(ValueError, match="at least 1"):
        redeliver(record_effect, "never", times=0)


@pytest.mark.django_db
def test_redeliver_runs_an_unguarded_task_each_time(provider):
    celery = pytest.importorskip("celery")

    @celery.shared_task(name="tests.unguarded_charge")
    def unguarded(order: int) -> int:
        return int(testapp_provider.charge(f"order-{order}-{uuid.uuid4()}", 1, "EUR"))

    assert redeliver(unguarded, 1) == [1, 2]
    assert len(provider.effects) == 2


@pytest.mark.django_db
def test_a_crash_inside_a_task_delivery_then_the_redelivery(provider):
    pytest.importorskip("celery")
    from celery import shared_task

    from django_idempotency.tasks import idempotent_task

    @shared_task(name="tests.charge_task")
    @idempotent_task()
    def charge_task(order: int) -> int:
        return int(testapp_provider.charge(f"order-{order}", 1, "EUR"))

    delivery = str(uuid.uuid4())
    with crash_after(PROVIDER):
        redeliver(charge_task, 3, task_id=delivery, times=1)
    expire_lease(delivery)
    assert redeliver(charge_task, 3, task_id=delivery) == [1, 1]
    assert (len(provider.calls), len(provider.effects)) == (2, 1)


# -- through a live server ------------------------------------------------------------------------


# A live server's threads each have a connection of their own: committed data, PostgreSQL.
LIVE = pytest.mark.django_db(transaction=True)


@LIVE
@postgres_only
def test_storm_and_assert_single_execution(live_server, user, provider):
    requests = 8
    headers = {**login_headers(user), "Idempotency-Key": new_key()}
    answers = storm(live_server.url, "/charges/", CHARGE, headers=headers, requests=requests)
    assert len(answers) == requests
    ran = assert_single_execution(answers)
    assert ran.status == 201
    assert_replay(ran, settle(live_server.url, "/charges/", CHARGE, headers=headers))
    assert len(provider.effects) == 1
    assert Charge.objects.count() == 1
    with pytest.raises(ValueError, match="at least 2"):
        storm(live_server.url, "/charges/", CHARGE, headers=headers, requests=1)


@needs_drf
@needs_ninja
@pytest.mark.urls(AUDIT_URLS)
@LIVE
@postgres_only
def test_assert_single_execution_fails_on_an_unprotected_view(live_server, user):
    headers = {**login_headers(user), "Idempotency-Key": new_key()}
    answers = storm(live_server.url, "/orders/", CHARGE, headers=headers, requests=4)
    with pytest.raises(AssertionError, match="4 of 4 requests ran the view"):
        assert_single_execution(answers)
    assert Charge.objects.count() == 4


def test_assert_single_execution_refuses_lost_answers():
    with pytest.raises(AssertionError, match="1 of 2 requests got no answer"):
        assert_single_execution([answer(), Answer(0, error="timed out")])


@LIVE
@postgres_only
def test_a_timeout_after_the_provider_answered(live_server, user, provider):
    headers = {**login_headers(user), "Idempotency-Key": new_key()}
    with pause_after(PROVIDER) as pause:
        gave_up = send(live_server.url, "/charges/", CHARGE, headers=headers, timeout=0.5)
        pause.wait()
        assert gave_up.error == "timed out"
        in_flight = send(live_server.url, "/charges/", CHARGE, headers=headers)
        assert_problem(in_flight, "idempotency_key_in_use", 409)
    outcome = settle(live_server.url, "/charges/", CHARGE, headers=headers)
    assert (outcome.status, outcome.replayed) == (201, True)
    assert len(provider.calls) == 1
    assert Charge.objects.count() == 1


def test_pause_after_fails_when_nothing_came():
    with pause_after(f"{__name__}.external") as pause:
        with pytest.raises(AssertionError, match="was not called within"):
            pause.wait(timeout=0.05)
        pause.resume()
        assert external() == "called"
        assert pause.calls == 1


def test_send_reports_a_refused_connection():
    with socket_nobody_listens_on() as url:
        refused = send(url, "/", {"a": 1})
    assert refused.status == 0
    assert refused.error is not None
    assert refused.error.startswith("connection closed")


def test_storm_and_settle_pass_their_options_on_to_each_request():
    import http.server
    import socket
    import threading
    import time

    seen: list[tuple[str, str | None]] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            seen.append((self.command, self.headers.get("X-Caller")))
            self.send_response(204)
            self.end_headers()

        do_PUT = do_DELETE = answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        answers = storm(url, "/", None, requests=2, method="PUT", headers={"X-Caller": "a"})
        outcome = settle(url, "/", method="DELETE", headers={"X-Caller": "b"}, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert [a.status for a in answers] == [204, 204]
    assert outcome.status == 204
    assert sorted(seen) == [("DELETE", "b"), ("PUT", "a"), ("PUT", "a")]
    # The timeout reaches each request: a server that never answers times them out.
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts
        mute = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        unanswered = storm(mute, "/", None, requests=2, timeout=0.3)
        assert [a.error for a in unanswered] == ["timed out", "timed out"]
        # settle's timeout bounds the whole wait, its retries' included.
        with pytest.raises(AssertionError, match=r"still no outcome after 0\.5 s"):
            settle(mute, "/", {"a": 1}, timeout=0.5)
        assert time.monotonic() - started < 5


def socket_nobody_listens_on() -> Any:
    import contextlib
    import socket

    @contextlib.contextmanager
    def bound() -> Any:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"

    return bound()


@needs_drf
@LIVE
@postgres_only
@pytest.mark.parametrize("csrf_in_session", [False, True])
def test_login_headers_pass_drf_session_authentication(
    live_server, user, provider, csrf_in_session
):
    with override_settings(CSRF_USE_SESSIONS=csrf_in_session):
        headers = login_headers(user)
        created = send(
            live_server.url,
            "/api/charges/",
            CHARGE,
            headers={**headers, "Idempotency-Key": new_key()},
        )
        assert created.status == 201, created.body
        token = {k: v for k, v in headers.items() if k.lower() != "x-csrftoken"}
        refused = send(
            live_server.url,
            "/api/charges/",
            CHARGE,
            headers={**token, "Idempotency-Key": new_key()},
        )
        assert refused.status == 403  # DRF wants the CSRF token with a session
    assert len(provider.effects) == 1


@needs_drf
@pytest.mark.django_db
@pytest.mark.parametrize(
    "engine",
    ["django.contrib.sessions.backends.db", "django.contrib.sessions.backends.signed_cookies"],
)
def test_login_headers_carry_the_csrf_token_a_session_holds_whatever_its_engine(
    user, provider, engine
):
    """With ``CSRF_USE_SESSIONS`` the token is saved into the session. A signed-cookie
    session is its cookie, and saving it makes another one: before, the headers carried
    the cookie from before the token was saved, and DRF refused every ``POST`` (403)."""
    with override_settings(CSRF_USE_SESSIONS=True, SESSION_ENGINE=engine):
        client = Client(enforce_csrf_checks=True)  # a new handler: the engine of the test
        headers = {**login_headers(user), "Idempotency-Key": new_key()}
        created = client.post(
            "/api/charges/", CHARGE, content_type="application/json", headers=headers
        )
    assert created.status_code == 201, created.content
    assert len(provider.effects) == 1


class Gateway:
    """Targets of every kind that a view may call."""

    @staticmethod
    def static(amount: int) -> str:
        return f"static {amount}"

    @classmethod
    def bound(cls, amount: int) -> str:
        return f"{cls.__name__} {amount}"

    def method(self, amount: int) -> str:
        return f"method {amount}"


@pytest.mark.parametrize("name", ["static", "bound", "method"])
def test_crash_after_a_method_of_a_class(name):
    with crash_after(f"{__name__}.Gateway.{name}") as point:
        getattr(Gateway(), name)(5)
    assert point.crashed
    assert getattr(Gateway(), name)(5).endswith(" 5")  # unpatched again, and as it was
