"""Per-view arguments fail loudly: ``@idempotent(...)`` and ``@idempotent_task(...)`` when the
view is decorated, the mixin's ``idempotency_*`` attributes on the view's first call."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse

from django_idempotency import _options
from django_idempotency.decorators import idempotent

try:
    from django_idempotency.ninja import idempotent as ninja_idempotent
except ImportError:  # the core tox env: no django-ninja
    ninja_idempotent = None  # type: ignore[assignment]
from tests.helpers import ApiClient, needs_drf, new_key
from tests.testapp.models import Charge

MISSING_PATH = "no_such_module.resolver"

# (argument, a value it must refuse, what the message says it expected)
BAD_ARGUMENTS = [
    ("methods", "POST", "list, tuple or set of HTTP method names"),
    ("methods", b"POST", "list, tuple or set of HTTP method names"),
    ("methods", [], "a non-empty list, tuple or set"),
    ("methods", ["POST", 5], "5 (int) is not a method name"),
    ("methods", ["GET"], "without safe methods"),
    ("required", "yes", "True or False"),
    ("required", 1, "True or False"),
    ("ttl", 0, "more than zero"),
    ("ttl", -1, "more than zero"),
    ("ttl", "1h", "a timedelta or a number of seconds"),
    ("lease", timedelta(0), "more than zero"),
    ("lease", True, "a timedelta or a number of seconds"),
    ("recovery", "retry ", '"retry", "fail", "resume", a callable'),
    ("recovery", MISSING_PATH, "cannot be imported"),
    ("recovery", 5, '"retry", "fail", "resume", a callable'),
    ("account", MISSING_PATH, "cannot be imported"),
    ("account", 5, "a callable or the dotted import path of one"),
    ("fingerprint", "django_idempotency.conf.DEFAULTS", "imports {"),
    ("operation", "", "a non-empty string"),
    ("operation", 5, "a non-empty string"),
]


def refused(decorator, name: str, argument: str, value: object, expected: str) -> None:
    """``decorator(argument=value)`` raises, naming where the view is decorated, the argument
    and what it expected."""
    with pytest.raises(ImproperlyConfigured) as raised:
        decorator(**{argument: value})
    message = str(raised.value)
    assert message.startswith(f"{name}(...) at {__name__} line ")
    assert f": {argument} must be " in message
    assert expected in message


@pytest.mark.parametrize(("argument", "value", "expected"), BAD_ARGUMENTS)
def test_the_decorator_refuses_a_wrong_argument_when_applied(argument, value, expected):
    refused(idempotent, "@idempotent", argument, value, expected)


def test_methods_as_a_string_raises_at_decoration():
    with pytest.raises(ImproperlyConfigured, match="methods must be a non-empty list"):

        @idempotent(methods="POST")  # type: ignore[call-overload]
        def create(request: object) -> HttpResponse:
            raise AssertionError("never called")


def test_a_view_given_with_arguments_is_named_by_its_own_name():
    def create(request: object) -> HttpResponse:
        raise AssertionError("never called")

    with pytest.raises(ImproperlyConfigured) as raised:
        idempotent(create, ttl=0)  # type: ignore[call-overload]
    assert str(raised.value).startswith(f"@idempotent on {__name__}.")
    assert "create: ttl must be" in str(raised.value)


def test_positional_arguments_are_refused():
    with pytest.raises(ImproperlyConfigured, match="keyword arguments"):
        idempotent(["POST"])  # type: ignore[call-overload]


def test_a_ttl_not_longer_than_the_lease_is_refused():
    with pytest.raises(ImproperlyConfigured, match=r"ttl \(0:01:00\) must be longer than lease"):
        idempotent(ttl=60, lease=timedelta(minutes=1))


def test_good_arguments_are_kept_in_their_typed_form():
    cleaned = _options.validated(
        "here",
        {"methods": ["post", "put"], "ttl": 60, "lease": 1.5, "recovery": "fail", "required": None},
    )
    assert cleaned == {
        "methods": ("POST", "PUT"),
        "ttl": timedelta(seconds=60),
        "lease": timedelta(seconds=1.5),
        "recovery": "fail",
        **dict.fromkeys(("required", "operation", "account", "fingerprint", "key")),
    }


def test_a_dotted_recovery_path_stays_a_path():
    path = "tests.testapp.views.recover_by_asking_provider"
    assert _options.validated("here", {"recovery": path})["recovery"] == path


@pytest.mark.parametrize(
    ("given", "near"),
    [({"lease_seconds": 5}, None), ({"methdos": ["POST"]}, "methods"), ({"tll": 5}, "ttl")],
)
def test_an_unknown_option_is_refused_with_the_nearest_name(given, near):
    with pytest.raises(ImproperlyConfigured, match="unknown option") as refused:
        idempotent(**given)
    if near:
        assert f"did you mean {near}?" in str(refused.value)
    if ninja_idempotent is not None:
        with pytest.raises(ImproperlyConfigured, match="unknown option"):
            ninja_idempotent(**given)


def test_ninja_takes_methods_as_a_set_too():
    if ninja_idempotent is None:
        pytest.skip("django-ninja is not installed")
    options = ninja_idempotent(methods={"post", "put"})
    assert callable(options)


# -- the mixin, on the view's first call ---------------------------------------------------


@needs_drf
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("attribute", "value", "expected"),
    [
        ("idempotency_methods", "POST", "idempotency_methods must be a non-empty list"),
        ("idempotency_required", "no", "idempotency_required must be True or False"),
        ("idempotency_ttl", -5, "idempotency_ttl must be a timedelta"),
        ("idempotency_lease", "60", "idempotency_lease must be a timedelta"),
        ("idempotency_recovery", MISSING_PATH, "idempotency_recovery must be"),
        ("idempotency_operation", "", "idempotency_operation must be a non-empty string"),
    ],
)
def test_a_wrong_mixin_attribute_fails_the_first_call_before_anything_runs(
    user, monkeypatch, attribute, value, expected
):
    from tests.testapp.drf_views import ChargeViewSet

    monkeypatch.setattr(ChargeViewSet, attribute, value)
    api = ApiClient(user)
    with pytest.raises(ImproperlyConfigured) as raised:
        api.post("/api/charges/", {"amount": 100, "currency": "EUR"}, key=new_key())
    message = str(raised.value)
    assert message.startswith("IdempotencyMixin on tests.testapp.drf_views.ChargeViewSet: ")
    assert expected in message
    assert Charge.objects.count() == 0


@needs_drf
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_an_attribute_changed_after_the_first_call_is_validated_and_used_again(user, monkeypatch):
    """The mixin validates its attributes once per class, not per request: a value put on
    the class after a view served is checked on the next call all the same, and a good new
    value is the one used."""
    from django_idempotency.models import IdempotencyRecord
    from tests.testapp.drf_views import ChargeViewSet

    api = ApiClient(user)
    charge = {"amount": 100, "currency": "EUR"}
    assert api.post("/api/charges/", charge, key=new_key()).status_code == 201
    monkeypatch.setattr(ChargeViewSet, "idempotency_ttl", -5)
    with pytest.raises(ImproperlyConfigured, match="idempotency_ttl must be a timedelta"):
        api.post("/api/charges/", charge, key=new_key())
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1
    monkeypatch.setattr(ChargeViewSet, "idempotency_ttl", timedelta(hours=3))
    key = new_key()
    assert api.post("/api/charges/", charge, key=key).status_code == 201
    record = IdempotencyRecord.objects.get(key=key)
    assert record.expires_at - record.created_at == timedelta(hours=3)
    assert Charge.objects.count() == 2


@needs_drf
@pytest.mark.django_db(transaction=True)
def test_a_recovery_function_in_the_class_body_is_the_policy_not_a_method(user, monkeypatch):
    from tests.testapp.drf_views import ChargeViewSet

    def recover(record: object) -> None:
        return None

    monkeypatch.setattr(ChargeViewSet, "idempotency_recovery", recover)
    view = ChargeViewSet()
    assert view._idempotency_options().recovery is recover


# -- the Celery decorator, when the task is decorated --------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"ttl": 0}, "ttl must be a timedelta"),
        ({"lease": "10"}, "lease must be a timedelta"),
        ({"key": 5}, "key must be a callable"),
        ({"key": MISSING_PATH}, "cannot be imported"),
        ({"ttl": 10, "lease": 10}, "ttl (0:00:10) must be longer than lease"),
    ],
)
def test_the_task_decorator_refuses_a_wrong_argument(arguments, expected):
    pytest.importorskip("celery")
    from django_idempotency.tasks import idempotent_task

    with pytest.raises(ImproperlyConfigured) as raised:
        idempotent_task(**arguments)
    assert str(raised.value).startswith(f"@idempotent_task(...) at {__name__} line ")
    assert expected in str(raised.value)


# -- the ninja decorator, when the operation is decorated -----------------------------------


@pytest.mark.parametrize(("argument", "value", "expected"), BAD_ARGUMENTS)
def test_the_ninja_decorator_refuses_a_wrong_argument(argument, value, expected):
    pytest.importorskip("ninja")
    from django_idempotency.ninja import idempotent as ninja_idempotent

    refused(ninja_idempotent, "ninja @idempotent", argument, value, expected)
