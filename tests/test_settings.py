"""Settings fail loudly: every wrong value is a check Error of its own id, and the same value
read at run time raises ``ImproperlyConfigured`` before any request runs unprotected."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client, override_settings
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_idempotency import _check_ids, conf
from django_idempotency.checks import check_settings
from django_idempotency.conf import IdempotencySettings, app_settings
from django_idempotency.models import IdempotencyRecord
from tests.helpers import examples, needs_drf, new_key
from tests.testapp.models import Charge, ProviderCall

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_PAGE = ROOT / "docs" / "settings.md"
CHECKS_PAGE = ROOT / "docs" / "checks.md"
needs_docs = pytest.mark.skipif(
    not SETTINGS_PAGE.exists(), reason="the docs are not here (tox tests the wheel)"
)
MISSING_PATH = "no_such_module.resolver"
FERNET_KEY = "qBVrZ0nW2kkE7z5Q8y6Hn3m1uXc9d0T4aJfLsR2pVYo="  # 32 bytes: a well-formed key
NOT_CALLABLE = "django_idempotency.conf.DEFAULTS"

# Every setting, and values it must refuse: a string for each sequence, None where it is
# not admitted, a wrong scalar type, a negative or zero duration, a dotted path that does
# not import.
BAD_VALUES: dict[str, list[object]] = {
    # A trailing newline (a name read from a file): no header has it, the key never found.
    "HEADER": [
        None,
        5,
        b"Idempotency-Key",
        "",
        "Idempotency Key",
        ["Idempotency-Key"],
        "Idempotency-Key\n",
    ],
    "REQUIRED": [None, 1, 0, "true", "False"],
    "TTL": [None, 0, -1, timedelta(0), timedelta(seconds=-1), "1h", True, float("nan")],
    "LEASE": [None, 0, -5, timedelta(0), "60", False, float("inf"), 10**20],
    "METHODS": [
        None,
        "POST",
        b"POST",
        "POST,PATCH",
        [],
        ["POST", 1],
        ["GET"],
        5,
        {"POST": 1},
        ["POST\n", "PATCH"],  # no request's method: POST would run unprotected
    ],
    "ACCOUNT_RESOLVER": [None, 5, "", "resolver", MISSING_PATH, NOT_CALLABLE],
    "FINGERPRINT": [None, 5, MISSING_PATH, NOT_CALLABLE, "default_fingerprint"],
    "RECOVERY": [None, 5, "", "retry ", "RETRY", MISSING_PATH, NOT_CALLABLE],
    "DATABASE": [None, 5, "", "nope", ["default"]],
    "REPLAY_HEADERS": [None, "X-Foo", b"X-Foo", [1], ["X Foo"], ["Set-Cookie"], 5, ["X-Foo\n"]],
    "MAX_RESPONSE_BYTES": [0, -1, "1MB", 1.5, True, 2**40],
    "TRANSIENT_STATUSES": [None, 409, "409", b"409", [409, "429"], [503], [True], {409: 1}],
    "IN_PROGRESS_WAIT": [None, -1, timedelta(seconds=-1), "0", True],
    "RETRY_AFTER": [None, 0, -1, "1", 1.5, True, timedelta(seconds=1)],
    "RETRY_AFTER_MAX": [0, -1, "60", 30.0, False, timedelta(seconds=30)],
    "PURGE_BATCH_SIZE": [None, 0, -1, "1000", 10.0, True, 2**40],
    "PURGE_MAX_BATCHES": [0, -1, "5", 2.0, False],
    "AUDIT": [None, 1, 0, "yes"],
    "AUDIT_RETENTION": [None, 0, -1, timedelta(0), "90d", True],
    # A key given as a str, not in a list; keys that are not 32 bytes of URL-safe base64.
    "ENCRYPTION_KEYS": [None, FERNET_KEY, FERNET_KEY.encode(), [""], ["k" * 44], [5], {"k": 1}],
    # Another alias than DATABASE ("default"), or None.
    "CLAIM_DATABASE": [5, "", "nope", ["claims"], "default", True],
    "CLAIM_TIMEOUT": [None, 0, -1, timedelta(0), "5s", True, float("nan")],
    "OUTBOX_SENDER": [None, 7, "", "send", MISSING_PATH, NOT_CALLABLE],
    "OUTBOX_MAX_ATTEMPTS": [None, 0, -1, "20", 2.5, True],
    "OUTBOX_RETENTION": [None, 0, -1, timedelta(0), "7d", True],
    "OUTBOX_BATCH_SIZE": [None, 0, -1, "100", False, 2**40],
    "OUTBOX_BACKOFF": [None, 0, -1, "1s", True, float("nan")],
    "OUTBOX_BACKOFF_MAX": [None, 0, -1, "5m", timedelta(0)],
    "OUTBOX_POLL_INTERVAL": [None, 0, -1, "1s", True],
}
CASES = [
    pytest.param(name, value, id=f"{name}={value!r}")
    for name, values in BAD_VALUES.items()
    for value in values
]


def expected_id(name: str) -> str:
    return conf.BY_NAME[name].id


def test_the_table_covers_every_setting():
    assert set(BAD_VALUES) == set(conf.DEFAULTS)


# The Error numbers, from the one table of them.
ERROR_NUMBERS = list(_check_ids.ERRORS.values())


def test_the_ids_are_unique_in_order_and_e040_to_e049_stay_free():
    # E037 is the outbox's default sender without Celery (checks.py), no setting's own id;
    # E038 and E039 the claim connection's.
    assert sorted(set(ERROR_NUMBERS)) == ERROR_NUMBERS
    warnings = list(_check_ids.WARNINGS.values())
    assert warnings == sorted(set(warnings))
    assert set(conf.BY_NAME) <= set(_check_ids.ERRORS)  # every setting has its own
    outbox = {_check_ids.ERRORS[setting.name] for setting in conf.OUTBOX_SETTINGS}
    assert outbox == set(range(30, 37))
    assert {n for n in ERROR_NUMBERS if 30 <= n <= 49} == outbox | {37, 38, 39}


@pytest.mark.parametrize(("name", "value"), CASES)
def test_a_wrong_value_is_an_error_of_its_own_id(name, value):
    with override_settings(IDEMPOTENCY={name: value}):
        found = check_settings()
    assert [m.id for m in found] == [expected_id(name)]
    assert f"IDEMPOTENCY['{name}']" in found[0].msg
    assert "must be" in found[0].msg


@pytest.mark.parametrize(("name", "value"), CASES)
def test_a_wrong_value_fails_the_check_command(name, value):
    with override_settings(IDEMPOTENCY={name: value}), pytest.raises(SystemCheckError) as raised:
        call_command("check", stdout=StringIO(), stderr=StringIO())
    assert expected_id(name) in str(raised.value)


@pytest.mark.parametrize(("name", "value"), CASES)
def test_a_wrong_value_is_never_read_at_run_time(name, value):
    with override_settings(IDEMPOTENCY={name: value}):
        # Every entry refuses to answer, not only the wrong one: no request runs on a
        # setting that is half right.
        for entry in ("DATABASE", name):
            with pytest.raises(ImproperlyConfigured) as raised:
                getattr(app_settings, entry)
            message = str(raised.value)
            assert f"IDEMPOTENCY['{name}'] must be" in message
            assert expected_id(name) in message
    assert frozenset({"POST", "PATCH"}) == app_settings.METHODS


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"TTL": 3600}, ("TTL", timedelta(hours=1))),
        ({"LEASE": 1.5}, ("LEASE", timedelta(seconds=1.5))),
        ({"METHODS": ["post", "PUT"]}, ("METHODS", frozenset({"POST", "PUT"}))),
        ({"METHODS": {"DELETE"}}, ("METHODS", frozenset({"DELETE"}))),
        ({"TRANSIENT_STATUSES": []}, ("TRANSIENT_STATUSES", frozenset())),
        ({"REPLAY_HEADERS": ["X-A", "x-a"]}, ("REPLAY_HEADERS", ("X-A",))),
        ({"MAX_RESPONSE_BYTES": None}, ("MAX_RESPONSE_BYTES", None)),
        ({"IN_PROGRESS_WAIT": 0}, ("IN_PROGRESS_WAIT", timedelta(0))),
        ({"RECOVERY": "tests.testapp.views.recover_by_asking_provider"}, None),
    ],
)
def test_valid_values_are_read_as_typed_values(entry, expected):
    with override_settings(IDEMPOTENCY=entry):
        assert check_settings() == []
        if expected is not None:
            name, value = expected
            assert getattr(app_settings, name) == value
        else:
            assert entry["RECOVERY"] == app_settings.RECOVERY


def test_callables_are_imported_once_and_given_typed():
    from django_idempotency.accounts import user_account
    from django_idempotency.fingerprint import default_fingerprint

    assert app_settings.ACCOUNT_RESOLVER is user_account
    assert app_settings.FINGERPRINT is default_fingerprint


def test_override_settings_is_seen_and_undone():
    assert timedelta(hours=24) == app_settings.TTL
    with override_settings(IDEMPOTENCY={"TTL": 3600}):
        assert timedelta(hours=1) == app_settings.TTL
    assert timedelta(hours=24) == app_settings.TTL


def test_nothing_is_read_at_construction_nor_written_into_django_settings():
    fresh = IdempotencySettings()
    with override_settings(IDEMPOTENCY={"METHODS": "POST"}):
        # Made while the setting is wrong: nothing read yet, so nothing raised.
        later = IdempotencySettings()
    assert frozenset({"POST", "PATCH"}) == later.METHODS
    assert timedelta(hours=24) == fresh.TTL
    assert not hasattr(settings, "IDEMPOTENCY")


def test_the_setting_as_a_whole_and_unknown_keys_fail_at_run_time_too():
    with override_settings(IDEMPOTENCY=["TTL"]), pytest.raises(ImproperlyConfigured, match="E001"):
        _ = app_settings.TTL
    # A misspelt key would leave its intended value unused: refused, not ignored.
    misspelt = override_settings(IDEMPOTENCY={"METHOD": ["PUT"]})
    with misspelt, pytest.raises(ImproperlyConfigured, match="unknown key 'METHOD'"):
        _ = app_settings.METHODS


def test_a_backoff_max_shorter_than_the_backoff_is_an_error_of_backoff_max():
    with override_settings(IDEMPOTENCY={"OUTBOX_BACKOFF": 10, "OUTBOX_BACKOFF_MAX": 5}):
        found = check_settings()
        with pytest.raises(ImproperlyConfigured, match="E035"):
            _ = app_settings.OUTBOX_BACKOFF
    assert [m.id for m in found] == ["django_idempotency.E035"]
    assert "must not be shorter than IDEMPOTENCY['OUTBOX_BACKOFF']" in found[0].msg


def test_relations_fail_at_run_time_too():
    relation = override_settings(IDEMPOTENCY={"TTL": 30, "LEASE": 60})
    with relation, pytest.raises(ImproperlyConfigured, match="E004"):
        _ = app_settings.TTL


# -- manage.py check, as a process ----------------------------------------------------------


@pytest.mark.parametrize(
    ("idempotency", "expected"),
    [
        ({"METHODS": "POST"}, ["E006"]),
        ({"METHODS": None}, ["E006"]),
        ({"TRANSIENT_STATUSES": 409}, ["E017"]),
        ({"REPLAY_HEADERS": [1], "RETRY_AFTER": "1", "LEASE": 0}, ["E009", "E013", "E018"]),
    ],
)
def test_manage_py_check_reports_errors_and_never_crashes(idempotency, expected):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TEST_IDEMPOTENCY": repr(idempotency)}
    done = subprocess.run(
        [sys.executable, "-m", "django", "check", "--settings=tests.settings_from_env"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    found = sorted(set(re.findall(r"django_idempotency\.(E\d{3})", done.stderr)))
    assert found == expected, done.stderr


# -- a wrong setting never runs a request unprotected ---------------------------------------


PROTECTED_PATHS = [
    "/charges/",
    "/cbv/charges/",
    pytest.param("/api/charges/", marks=needs_drf),
    pytest.param("/api/fn-charges/", marks=needs_drf),
]


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("path", PROTECTED_PATHS)
def test_methods_as_a_string_never_runs_a_post_twice(user, path):
    """``METHODS = "POST"`` once made the protected methods P, O, S and T: POST ran
    unprotected. Now every request fails before the view, and nothing happens at all."""
    client = Client(raise_request_exception=False)
    client.force_login(user)
    key = new_key()
    body = {"amount": 100, "currency": "EUR"}
    headers = {"Idempotency-Key": key}
    with override_settings(IDEMPOTENCY={"METHODS": "POST"}):
        answers = [
            client.post(path, body, content_type="application/json", headers=headers)
            for _ in range(2)
        ]
        strict = Client()
        strict.force_login(user)
        with pytest.raises(ImproperlyConfigured, match="METHODS"):
            strict.post(path, body, content_type="application/json", headers=headers)
    assert [a.status_code for a in answers] == [500, 500]
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
    # Once the setting is right, the same key runs once and replays.
    with override_settings(IDEMPOTENCY={"METHODS": ["POST"]}):
        first, second = (
            client.post(path, body, content_type="application/json", headers=headers)
            for _ in range(2)
        )
    assert (first.status_code, second.status_code) == (201, 201)
    assert second["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


# -- the settings page documents every setting ----------------------------------------------------

_HEADING = re.compile(r"^## `(?P<name>[A-Z_]+)`\n(?P<line>[^\n]*)", re.M)
_FIRST_LINE = re.compile(
    r"^`(?P<type>[^`]+)` · default `(?P<default>[^`]+)` · check `(?P<check>[^`]+)`$"
)


def _settings_reference() -> dict[str, dict[str, str]]:
    section = SETTINGS_PAGE.read_text()
    documented: dict[str, dict[str, str]] = {}
    for heading in _HEADING.finditer(section):
        line = _FIRST_LINE.match(heading["line"])
        assert line, f"{heading['name']}: its first line is not `type` · default `x` · check `id`"
        documented[heading["name"]] = line.groupdict()
    return documented


@needs_docs
def test_every_setting_is_documented_and_every_documented_setting_exists():
    assert sorted(_settings_reference()) == sorted(conf.DEFAULTS)


@needs_docs
@pytest.mark.parametrize("name", sorted(conf.DEFAULTS))
def test_the_settings_page_gives_each_setting_its_real_default_and_check(name):
    entry = _settings_reference()[name]
    assert eval(entry["default"], {"timedelta": timedelta}) == conf.DEFAULTS[name]
    assert entry["check"] == expected_id(name)
    checks_table = CHECKS_PAGE.read_text()
    row = re.search(rf"^\| `{re.escape(entry['check'])}` \| (.*)$", checks_table, re.M)
    assert row, entry["check"]
    assert f"`{name}`" in row[1]


_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=10)
    | st.timedeltas()
    | st.sampled_from(["POST", "retry", "fail", "default", "X-Foo", MISSING_PATH, 409]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.frozensets(st.integers() | st.text(max_size=8), max_size=3)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(name=st.sampled_from(sorted(conf.DEFAULTS)), value=_ANY)
@hypothesis_settings(max_examples=examples(400), deadline=None)
def test_the_check_never_raises_and_agrees_with_the_run_time(name, value):
    with override_settings(IDEMPOTENCY={name: value}):
        found = [m.id for m in check_settings()]
        try:
            getattr(app_settings, name)
            refused = ""
        except ImproperlyConfigured as exc:
            refused = str(exc)
    # The entry's own id, a relation with its default neighbours (TTL/LEASE/wait, the
    # outbox's backoffs), or
    # nothing; and the run time refuses exactly when the check reports.
    assert set(found) <= {
        expected_id(name),
        _check_ids.error("TTL_NOT_LONGER_THAN_LEASE"),
        _check_ids.error("WAIT_NOT_SHORTER_THAN_LEASE"),
        expected_id("OUTBOX_BACKOFF_MAX"),
    }
    assert bool(refused) == bool(found)
    assert all(found_id in refused for found_id in found)


def test_a_method_with_a_trailing_newline_is_refused_where_the_view_is_decorated():
    """``methods=["POST\\n"]`` names no request's method: POST would run unprotected."""
    from django.http import HttpRequest, HttpResponse

    from django_idempotency.decorators import idempotent

    with pytest.raises(ImproperlyConfigured, match="method"):

        @idempotent(methods=["POST\n", "PATCH"])
        def view(request: HttpRequest) -> HttpResponse:
            return HttpResponse()
