"""Security: tenants are isolated, stored responses stay bounded and free of credentials,
the admin needs the view permission, and no key or body reaches a log at INFO.

Admin permissions are covered in tests/test_admin.py (anonymous, non-staff, staff without
the view permission on the changelist, the detail page and the actions; view-only staff);
this module adds the history page, the delete-only permission and the admin index.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, override_settings
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_idempotency import conf, maintenance, signals, states
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory, UserFactory
from tests.helpers import (
    ApiClient,
    examples,
    logged_in,
    make_in_progress,
    needs_drf,
    new_key,
    staff_with,
)
from tests.live import basic_auth
from tests.testapp.models import Charge, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

PROPERTY = hypothesis_settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def problem_code(response) -> str | None:
    if response["Content-Type"] != "application/problem+json":
        return None
    code: str = json.loads(response.content)["code"]
    return code


# -- tenants -------------------------------------------------------------------------------


@pytest.fixture
def tenants(db: Any) -> list[tuple[str, ApiClient]]:
    users = UserFactory.create_batch(3)
    return [(f"user:{user.pk}", ApiClient(user)) for user in users]


# Two operations of plain views, and DRF's viewset where installed.
TENANT_PATHS = ["/charges/", "/cbv/charges/", *(["/api/charges/"] if settings.HAS_DRF else [])]
operations = st.lists(
    st.tuples(
        st.integers(0, 2),  # which tenant
        st.sampled_from(TENANT_PATHS),
        st.sampled_from(["k1", "k2"]),  # few keys: tenants collide on them all the time
        st.sampled_from([100, 200]),  # the payload: same or different
    ),
    min_size=1,
    max_size=12,
)


@PROPERTY
@given(ops=operations)
def test_a_tenant_never_reads_or_replays_another_tenants_record(tenants, ops):
    """Random tenants send random keys, colliding with each other's; every answer is the
    caller's own: a fresh run, a replay of the caller's first answer, or the caller's 422."""
    prefix = uuid.uuid4().hex[:8]  # examples share the database
    charges, provider_charges = Charge.objects.count(), ProviderCharge.objects.count()
    first: dict[tuple[int, str, str], tuple[int, bytes]] = {}
    for who, path, key, amount in ops:
        account, api = tenants[who]
        response = api.post(path, {"amount": amount, "currency": "EUR"}, key=f"{prefix}-{key}")
        slot = (who, path, key)
        if slot not in first:
            assert response.status_code == 201, response.content
            assert "Idempotent-Replayed" not in response
            first[slot] = (amount, response.content)
        elif first[slot][0] == amount:
            assert response["Idempotent-Replayed"] == "true"
            assert response.content == first[slot][1]
        else:
            assert response.status_code == 422
            assert problem_code(response) == "idempotency_key_reused"
            continue
        charge = Charge.objects.get(pk=json.loads(response.content)["id"])
        assert charge.account == account  # never another tenant's charge
    # One effect per (tenant, operation, key), locally and at the provider.
    assert Charge.objects.count() - charges == len(first)
    assert ProviderCharge.objects.count() - provider_charges == len(first)
    for who, (account, _api) in enumerate(tenants):
        mine = [body for slot, (_amount, body) in first.items() if slot[0] == who]
        records = IdempotencyRecord.objects.filter(account=account, key__startswith=prefix)
        assert records.count() == len(mine)
        ids = [json.loads(body)["id"] for body in mine]
        assert Charge.objects.filter(pk__in=ids, account=account).count() == len(mine)


# -- stored responses ----------------------------------------------------------------------


@PROPERTY
@given(
    limit=st.integers(1, 64),
    text=st.text(st.sampled_from("a\u00e9\u20ac\U0001f600"), max_size=40),
)
def test_the_stored_response_size_limit_counts_bytes_and_is_never_exceeded(api, limit, text):
    """A body is kept only when its encoded bytes fit; otherwise the request is rolled back
    (no charge, no record) and answered 500, never stored truncated."""
    size = len(text.encode())
    charges = Charge.objects.count()
    key = new_key()
    with override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": limit}):
        response = api.post("/outcome/", {"body": text}, key=key)
    record = IdempotencyRecord.objects.filter(key=key).first()
    if size <= limit:
        assert response.status_code == 200
        assert record is not None
        assert bytes(record.response_body) == text.encode()
        assert Charge.objects.count() == charges + 1
    else:
        assert response.status_code == 500
        assert problem_code(response) == "idempotency_response_not_storable"
        assert record is None
        assert Charge.objects.count() == charges


@pytest.mark.parametrize("name", sorted(conf.NEVER_STORED_HEADERS))
def test_allow_listing_a_sensitive_header_is_refused_not_ignored(api, name):
    # Mixed case: the allow-list may spell a header either way.
    for spelling in (name.upper(), name.title()):
        allow = override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["x-kept", spelling]})
        with allow, pytest.raises(ImproperlyConfigured, match=f"{name} is never stored"):
            api.post("/outcome/", {"cookie": True}, key=new_key())
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 0


def test_sensitive_headers_are_never_stored(api):
    never = sorted(conf.NEVER_STORED_HEADERS)
    headers = {name.title(): "secret-header-value" for name in never if name != "set-cookie"}
    headers.pop("Content-Length")  # Django computes it
    payload = {"cookie": True, "headers": {**headers, "X-Kept": "1"}}
    key = new_key()
    with override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["x-kept"]}):
        first = api.post("/outcome/", payload, key=key)
        replay = api.post("/outcome/", payload, key=key)
    assert "session-ish" in first.cookies
    stored = IdempotencyRecord.objects.get(key=key).response_headers
    assert {name.lower() for name, _ in stored} == {"content-type", "x-kept"}
    assert "secret-header-value" not in json.dumps(stored)
    assert replay["Idempotent-Replayed"] == "true"
    assert "session-ish" not in replay.cookies
    assert not replay.has_header("Set-Cookie")
    assert replay["X-Kept"] == "1"


@pytest.mark.parametrize("path", ["/charges/", pytest.param("/api/charges/", marks=needs_drf)])
def test_request_credentials_never_reach_a_record(user, path):
    """The session cookie and the Authorization header are transport, not the request."""
    api = ApiClient(user)
    session_id = api.client.cookies["sessionid"].value
    auth = basic_auth(user.username)
    token = auth["Authorization"].split()[1]
    response = api.post(path, {"amount": 1, "currency": "EUR"}, key=new_key(), headers=auth)
    assert response.status_code == 201
    (row,) = IdempotencyRecord.objects.values()
    text = json.dumps(
        {
            k: bytes(v).decode("latin-1") if isinstance(v, memoryview | bytes) else str(v)
            for k, v in row.items()
        }
    )
    for secret in (session_id, token):
        assert secret not in text


# -- the admin -----------------------------------------------------------------------------

ADMIN = "/admin/django_idempotency/idempotencyrecord/"


def staff(*codenames: str) -> Client:
    return logged_in(staff_with(*codenames))


@pytest.mark.parametrize("codenames", [(), ("delete_idempotencyrecord",)])
def test_admin_pages_of_a_record_need_the_view_permission(codenames):
    record = RecordFactory(key="admin-secret-key", response_body=b'{"card":"admin-secret-body"}')
    client = staff(*codenames)
    for url in (
        ADMIN,
        f"{ADMIN}?q={record.key}",
        f"{ADMIN}{record.pk}/change/",
        f"{ADMIN}{record.pk}/history/",
    ):
        response = client.get(url)
        assert response.status_code == 403, url
        assert b"admin-secret" not in response.content
    index = client.get("/admin/").content.decode()
    assert "idempotencyrecord" not in index


def test_admin_history_page_with_the_view_permission():
    record = RecordFactory()
    assert staff("view_idempotencyrecord").get(f"{ADMIN}{record.pk}/history/").status_code == 200


# -- logs ----------------------------------------------------------------------------------


class Secrets:
    """Recognisable keys and bodies; ``check`` fails on any log record at INFO that holds one."""

    def __init__(self) -> None:
        self.values: list[str] = []

    def key(self) -> str:
        return self.add(f"key-secret-{uuid.uuid4().hex}")

    def known_key(self) -> str:
        # The callable recovery policy answers for keys that start with "known-".
        return self.add(f"known-secret-{uuid.uuid4().hex}")

    def add(self, value: str) -> str:
        self.values.append(value)
        return value

    def check(self, records: list[logging.LogRecord]) -> int:
        checked = 0
        for record in records:
            if record.levelno < logging.INFO:
                continue
            checked += 1
            text = record.getMessage() + repr(vars(record))
            if record.exc_info:
                text += logging.Formatter().formatException(record.exc_info)
            for secret in self.values:
                assert secret not in text, f"{record.name} {record.levelname}: {text[:500]}"
        return checked


@pytest.fixture
def secrets(caplog) -> Iterator[Secrets]:
    # Every logger, Django's included, at INFO: what a production setup would keep.
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="django_idempotency")
    found = Secrets()
    yield found
    logged = caplog.get_records("call")
    assert found.check(logged) > 0, "the paths logged nothing: the test proves nothing"


def test_no_key_or_body_reaches_a_log_on_any_path(api, anon_api, secrets):
    body = {"amount": 100, "currency": "EUR", "note": secrets.add("body-secret-request")}
    api.client.raise_request_exception = False

    key = secrets.key()  # new, replay, mismatch, in progress
    api.post("/charges/", body, key=key)
    api.post("/charges/", body, key=key)
    api.post("/charges/", {**body, "amount": 7}, key=key)
    make_in_progress(key, timedelta(seconds=30))
    assert api.post("/charges/", body, key=key).status_code == 409

    api.post("/charges/", body)  # missing key
    api.post("/charges/", body, key=secrets.add("invalid secret-key"))
    anon_api.post("/charges/", body, key=secrets.key())

    for path, key in (  # stale leases taken over under each policy
        ("/charges/", secrets.key()),
        ("/charges/fail-policy/", secrets.key()),
        ("/charges/callable-policy/", secrets.known_key()),
    ):
        api.post(path, body, key=key)
        make_in_progress(key, -timedelta(seconds=5))
        api.post(path, body, key=key)

    def take_over(sender: Any, key: str, **kwargs: Any) -> None:
        IdempotencyRecord.objects.filter(key=key).update(lease_token=uuid.uuid4())

    signals.record_claimed.connect(take_over, dispatch_uid="security-take-over")
    try:
        assert api.post("/charges/", body, key=secrets.key()).status_code == 409  # lease lost
    finally:
        signals.record_claimed.disconnect(dispatch_uid="security-take-over")

    response_secret = secrets.add("body-secret-response")
    for payload in (
        {"status": 503, "body": response_secret},
        {"raise": True, "body": response_secret},
        {"stream": True},
        {"size": 2 * 1024 * 1024},
        {"status": 201, "body": response_secret},
    ):
        api.post("/outcome/", payload, key=secrets.key())

    if settings.HAS_DRF:  # a created charge, a validation error, a mismatch
        key = secrets.key()
        api.post("/api/charges/", body, key=key)
        api.post("/api/charges/", {**body, "amount": -1}, key=secrets.key())
        api.post("/api/charges/", {**body, "amount": 8}, key=key)

    for policy in ("retry", "fail", "tests.testapp.views.no_such_policy"):  # the recovery job
        RecordFactory(
            key=secrets.key(),
            status=states.IN_PROGRESS,
            lease_token=uuid.uuid4(),
            lease_expires_at=timezone.now() - timedelta(seconds=5),
            recovery_policy=policy,
            response_body=None,
        )
    maintenance.recover_stale_leases()
    RecordFactory(key=secrets.key(), expires_at=timezone.now() - timedelta(hours=1))
    maintenance.purge_expired()


def test_no_key_or_body_reaches_a_log_when_the_store_is_down(
    anon_api,
    secrets,
    unreachable_store,
):
    body = {"amount": 1, "currency": "EUR", "note": secrets.add("body-secret-down")}
    response = anon_api.post("/charges/tenant/", body, key=secrets.key(), headers={"X-Tenant": "t"})
    assert problem_code(response) == "idempotency_store_unavailable"
