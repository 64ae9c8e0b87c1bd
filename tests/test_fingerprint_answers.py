"""What a project's fingerprint answers, and the version it declares.

The record stores the fingerprint as text of at most 64 characters, and its version in a
column of 64. A fingerprint that answers something else (a number, ``None``, a SHA-512's
128 hex digits) is refused on the first request, where nothing ran, with a problem that
says the server is at fault: never a first request that runs and then a ``422`` for every
honest retry (a number stored as text compares unequal to the number), a ``503`` saying
the store is down, or a fingerprint that works on SQLite and fails on PostgreSQL. A version
longer than its column is a check Error, and refused where the view is decorated.
Effects counted: the charges written, the records stored.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import override_settings

from django_idempotency import checks
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.helpers import logged_in, new_key
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 250, "currency": "EUR"}


def as_number(request: Any) -> Any:
    return 12345


def as_none(request: Any) -> Any:
    return None


def as_sha512(request: Any) -> str:
    return hashlib.sha512(request.body).hexdigest()


def with_a_nul(request: Any) -> str:
    return "a\x00b"


def with_a_lone_surrogate(request: Any) -> str:
    return "a\ud800b"


class Marked(str):
    """A str subclass (a SafeString, a numpy str_): text the record holds."""


def as_a_str_subclass(request: Any) -> str:
    return Marked(hashlib.sha256(request.body).hexdigest())


def long_version(request: Any) -> str:
    return hashlib.sha256(request.body).hexdigest()


long_version.fingerprint_version = "v" * 65  # type: ignore[attr-defined]


def short_version(request: Any) -> str:
    return hashlib.sha256(request.body).hexdigest()


short_version.fingerprint_version = "v" * 64  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "answer", ["as_number", "as_none", "as_sha512", "with_a_nul", "with_a_lone_surrogate"]
)
def test_an_answer_the_record_cannot_hold_is_refused_before_anything_runs(user, answer):
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.{answer}"}):
        answers = [
            client.post("/charges/", CHARGE, content_type="application/json", headers=headers)
            for _ in range(2)
        ]
    assert [a.status_code for a in answers] == [500, 500]
    assert {a.json()["code"] for a in answers} == {"idempotency_fingerprint_invalid"}
    assert "FINGERPRINT" not in answers[0].content.decode()  # the settings are the log's
    assert (Charge.objects.count(), IdempotencyRecord.objects.count()) == (0, 0)


def test_a_str_subclass_is_text_the_record_holds(user):
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.as_a_str_subclass"}):
        answers = [
            client.post("/charges/", CHARGE, content_type="application/json", headers=headers)
            for _ in range(2)
        ]
        changed = client.post(
            "/charges/", {**CHARGE, "amount": 1}, content_type="application/json", headers=headers
        )
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers["Idempotent-Replayed"] == "true"
    assert changed.status_code == 422
    assert Charge.objects.count() == 1


def nul_version(request: Any) -> str:
    return hashlib.sha256(request.body).hexdigest()


nul_version.fingerprint_version = "v\x00"  # type: ignore[attr-defined]


def surrogate_version(request: Any) -> str:
    return hashlib.sha256(request.body).hexdigest()


surrogate_version.fingerprint_version = "v\ud800"  # type: ignore[attr-defined]


@pytest.mark.parametrize("fingerprint", ["nul_version", "surrogate_version"])
def test_a_version_the_column_cannot_hold_is_a_check_error(fingerprint):
    """A NUL (PostgreSQL refuses it: 503 on every request there) or a lone surrogate (no
    database encodes it: a bare exception on every request)."""
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.{fingerprint}"}):
        errors = [e for e in checks.check_settings() if e.id == "django_idempotency.E015"]
    assert len(errors) == 1
    assert "fingerprint_version" in errors[0].msg
    with pytest.raises(ImproperlyConfigured, match="fingerprint_version"):
        idempotent(fingerprint=globals()[fingerprint])


def test_a_version_longer_than_its_column_is_a_check_error():
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.long_version"}):
        errors = [e for e in checks.check_settings() if e.id == "django_idempotency.E015"]
    assert len(errors) == 1
    assert "fingerprint_version" in errors[0].msg
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.short_version"}):
        assert not [e for e in checks.check_settings() if e.id == "django_idempotency.E015"]


def test_a_view_given_a_version_longer_than_its_column_is_refused_where_it_is_decorated():
    with pytest.raises(ImproperlyConfigured, match="fingerprint_version"):

        @idempotent(fingerprint=long_version)
        def view(request: HttpRequest) -> HttpResponse:
            return HttpResponse()


def test_a_version_of_64_characters_is_stored_and_replayed(user):
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.short_version"}):
        answers = [
            client.post("/charges/", CHARGE, content_type="application/json", headers=headers)
            for _ in range(2)
        ]
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def a_fingerprint_whose_dotted_path_runs_past_its_column_v1(request: Any) -> str:
    return hashlib.sha256(b"v1" + request.body).hexdigest()


def a_fingerprint_whose_dotted_path_runs_past_its_column_v2(request: Any) -> str:
    return hashlib.sha256(b"v2" + request.body).hexdigest()


def test_two_fingerprints_whose_paths_differ_past_64_characters_are_two_versions(user):
    """Without a declared ``fingerprint_version`` the version is the dotted path, cut to its
    column: two paths alike in their first 64 characters were one version, so a deploy from
    ``..._v1`` to ``..._v2`` compared the new hashes with the old ones, and every honest
    retry of a key sent before it got ``422``."""
    v1 = f"{__name__}.a_fingerprint_whose_dotted_path_runs_past_its_column_v1"
    v2 = f"{__name__}.a_fingerprint_whose_dotted_path_runs_past_its_column_v2"
    assert len(v1) > 64
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}

    def post() -> Any:
        return client.post("/charges/", CHARGE, content_type="application/json", headers=headers)

    with override_settings(IDEMPOTENCY={"FINGERPRINT": v1}):
        assert post().status_code == 201
    with override_settings(IDEMPOTENCY={"FINGERPRINT": v2}):
        retry = post()
    assert retry.status_code == 201, retry.content
    assert retry.headers["Idempotent-Replayed"] == "true"
    (version,) = IdempotencyRecord.objects.values_list("fingerprint_version", flat=True)
    assert len(version) <= 64
    assert Charge.objects.count() == 1


class BodyFingerprint:
    """A fingerprint written as a class: its instances are called with the request."""

    salt = b"body"

    def __call__(self, request: Any) -> str:
        return hashlib.sha256(self.salt + request.body).hexdigest()


class PathFingerprint(BodyFingerprint):
    """Another fingerprint class of the same module: another algorithm."""

    salt = b"path"


by_body = BodyFingerprint()
by_path = PathFingerprint()


def salted(salt: bytes, request: Any) -> str:
    return hashlib.sha256(salt + request.body).hexdigest()


def peppered(pepper: bytes, request: Any) -> str:
    return hashlib.sha256(request.body + pepper).hexdigest()


by_salt = functools.partial(salted, b"salt")
by_pepper = functools.partial(peppered, b"pepper")


@pytest.mark.parametrize(("before", "after"), [("by_body", "by_path"), ("by_salt", "by_pepper")])
def test_two_fingerprint_objects_of_one_module_are_two_versions(user, before, after):
    """A fingerprint that is an object (an instance of a class with ``__call__``, a
    ``functools.partial``) has no dotted path of its own: its version was the module's name
    and a dot, the same for every such object of the module, so a deploy from one to
    another compared the new hashes with the old ones, and every honest retry of a key sent
    before it got ``422``. Its version is now its class's path (a partial's, its
    function's)."""
    client = logged_in(user)
    headers = {"Idempotency-Key": new_key()}

    def post() -> Any:
        return client.post("/charges/", CHARGE, content_type="application/json", headers=headers)

    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.{before}"}):
        assert post().status_code == 201
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.{after}"}):
        retry = post()
    assert retry.status_code == 201, retry.content
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    with override_settings(IDEMPOTENCY={"FINGERPRINT": f"{__name__}.{before}"}):
        changed = client.post(
            "/charges/", {**CHARGE, "amount": 1}, content_type="application/json", headers=headers
        )
    assert changed.status_code == 422  # the version it was stored under still compares
    assert Charge.objects.count() == 1
