"""``manage.py idempotency_audit``: its text and JSON reports, in full, over a URLconf with
every kind of view (``tests/testapp/audit_urls.py``, one of each kind unprotected) and over
the example project; its exit status for CI; and that what it says of each view is what
the view does.

The expected reports are the files of ``tests/audit/``, compared byte for byte.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("rest_framework")
pytest.importorskip("ninja")

from django.contrib import admin
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.http import HttpResponse
from django.test import Client, override_settings
from django.urls import include, path, re_path
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from django_idempotency._endpoints import audit, duration
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from tests.live import ROOT
from tests.testapp.models import Charge

EXPECTED = Path(__file__).parent / "audit"
AUDIT_URLS = "tests.testapp.audit_urls"


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("idempotency_audit", *args, stdout=out)
    return out.getvalue()


# -- every kind of view ----------------------------------------------------------------------


@override_settings(ROOT_URLCONF=AUDIT_URLS)
def test_the_text_report_over_every_kind_of_view():
    assert run() == (EXPECTED / "urlconf.txt").read_text()


@override_settings(ROOT_URLCONF=AUDIT_URLS)
def test_the_json_report_over_every_kind_of_view():
    assert run("--format", "json") == (EXPECTED / "urlconf.json").read_text()
    report = json.loads(run("--format", "json"))
    unprotected = {e["view"].rpartition(".")[2] for e in report["endpoints"] if not e["protected"]}
    # One of each kind: a function view, a class-based view (and a method of a protected
    # one), an APIView, a viewset, an @api_view, a ninja operation.
    assert unprotected == {
        "create_order_unprotected",
        "PayoutViewUnprotected",
        "NoteView",
        "TransferViewUnprotected",
        "ChargeViewSetUnprotected",
        "create_refund_unprotected",
        "update_item",
    }


@override_settings(ROOT_URLCONF=AUDIT_URLS)
def test_fail_on_unprotected_exits_1_and_names_them():
    with pytest.raises(
        CommandError, match=r"^10 unprotected: POST /orders/, PATCH /orders/, "
    ) as e:
        run("--fail-on-unprotected", "--verbosity", "0")
    assert e.value.returncode == 1


@override_settings(ROOT_URLCONF=AUDIT_URLS)
def test_exclude_leaves_prefixes_out_and_says_so():
    out = run("--exclude", "orders/", "--exclude", "/api/")
    assert " /orders/ " not in out
    assert "/api/" not in out
    assert "/v2/orders/" in out  # a prefix of the URL, not a part of it
    assert out.endswith("8 patterns left out by --exclude.\n")
    assert json.loads(run("--format", "json", "--exclude", "notes/"))["excluded"] == 1


@override_settings(ROOT_URLCONF=AUDIT_URLS)
def test_verbosity_0_prints_no_table():
    assert run("--verbosity", "0") == ""


def accepts(url: str) -> str:
    """A listed URL with its parameters filled in."""
    return url.replace("<pk>", str(Charge.objects.create(account="target", amount=1).pk))


@pytest.mark.django_db
@pytest.mark.urls(AUDIT_URLS)
def test_what_the_audit_says_of_each_post_is_what_the_view_does(user):
    client = Client()
    client.force_login(user)
    report = json.loads(run("--format", "json"))
    checked = 0
    for endpoint in report["endpoints"]:
        if endpoint["method"] != "POST" or "<int:" in endpoint["url"]:
            continue
        url, key = accepts(endpoint["url"]), f"key-{checked}"
        before = Charge.objects.count()
        for _ in range(2):
            response = client.post(
                url,
                {"amount": 1, "currency": "EUR", "transfer_id": key},
                content_type="application/json",
                headers={"Idempotency-Key": key, "X-Request-Id": key},
            )
            assert response.status_code in (200, 201), (url, response.content)
        runs = Charge.objects.count() - before
        assert runs == (1 if endpoint["protected"] else 2), endpoint
        checked += 1
    assert checked == 14  # every listed POST, 5 of them unprotected


# -- the example project ----------------------------------------------------------------------


def manage(*args: str) -> subprocess.CompletedProcess[str]:
    if not (ROOT / "example_project").is_dir():
        pytest.skip("the example project is not here (tox tests the wheel)")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "example_project.settings"}
    return subprocess.run(
        [sys.executable, "manage.py", "idempotency_audit", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_reports_over_the_example_project():
    text, data = manage(), manage("--format", "json")
    assert (text.returncode, text.stderr) == (0, "")
    assert text.stdout == (EXPECTED / "example.txt").read_text()
    assert data.stdout == (EXPECTED / "example.json").read_text()


def test_the_example_project_in_ci():
    # DRF's browsable-API login and logout are forms, not an API: CI leaves them out.
    passed = manage("--fail-on-unprotected", "--exclude", "api-auth/")
    assert passed.returncode == 0, passed.stderr
    assert "8 endpoints" not in passed.stdout
    failed = manage("--fail-on-unprotected")
    assert failed.returncode == 1
    assert failed.stderr == (
        "CommandError: 2 unprotected: POST /api-auth/login/, POST /api-auth/logout/\n"
    )


# -- parts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (timedelta(days=4), "4d"),
        (timedelta(hours=24), "1d"),
        (timedelta(hours=1, minutes=30), "1h30m"),
        (timedelta(seconds=90), "1m30s"),
        (timedelta(seconds=1.5), "1.5s"),
        (timedelta(0), "0s"),
    ],
)
def test_durations(value, shown):
    assert duration(value) == shown


class Misconfigured(IdempotencyMixin, APIView):
    idempotency_methods = "POST"  # type: ignore[assignment]  # a string, not a list

    def post(self, request: Any) -> Response:
        return Response(status=201)


urlpatterns = [path("wrong/", Misconfigured.as_view())]


@override_settings(ROOT_URLCONF=__name__)
def test_a_wrong_mixin_attribute_is_an_error_of_the_audit():
    with pytest.raises(ImproperlyConfigured, match="idempotency_methods"):
        audit()
    with pytest.raises(CommandError, match="idempotency_methods"):
        run()


# -- one name for every action of a viewset --------------------------------------------------


class Ledger(IdempotencyMixin, ViewSet):
    """``idempotency_operation`` on a viewset (what E060's hint offered for a basename under
    two routers) names every action of it: ``create`` and ``close`` are one operation."""

    idempotency_operation = "ledger-v2"

    def create(self, request: Any) -> Response:
        return Response(
            {"id": Charge.objects.create(account="create", amount=1, currency="EUR").pk}, status=201
        )

    @action(detail=False, methods=["post"])
    def close(self, request: Any) -> Response:
        return Response({"id": Charge.objects.create(account="close", amount=1, currency="EUR").pk})


ledger = SimpleRouter()
ledger.register("ledger", Ledger, basename="ledger")
LEDGER_URLS = types.ModuleType("ledger_urls")
LEDGER_URLS.urlpatterns = ledger.urls  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF=LEDGER_URLS)
def test_one_operation_for_several_actions_of_a_viewset_is_a_check_error(user):
    from django.core import checks

    from django_idempotency import _check_ids
    from tests.helpers import ApiClient, new_key

    client = ApiClient(user)
    key = new_key()
    created = client.post("/ledger/", {}, key=key)
    closed = client.post("/ledger/close/", {}, key=key)
    # close answered create's outcome, and never ran: what the check and the audit report.
    assert closed.content == created.content
    assert list(Charge.objects.values_list("account", flat=True)) == ["create"]
    errors = [
        m
        for m in checks.run_checks(tags=[checks.Tags.urls])
        if m.id == _check_ids.error("OPERATION_SHARED")
    ]
    assert len(errors) == 1
    assert "POST /ledger/," in errors[0].msg
    assert "POST /ledger/close/" in errors[0].msg
    assert "get_idempotency_operation" in (errors[0].hint or "")
    assert list(audit().shared) == ["ledger-v2"]


# -- the methods a pattern's view answers, as as_view() gave them ------------------------------


class _Narrow(View):
    """Answers GET only, by its class: a pattern's ``as_view(http_method_names=...)`` may
    open its unprotected ``post``."""

    http_method_names = ["get"]

    def get(self, request: Any) -> HttpResponse:
        return HttpResponse("read")

    def post(self, request: Any) -> HttpResponse:
        Charge.objects.create(account="narrow", amount=1, currency="EUR")
        return HttpResponse("made", status=201)


@method_decorator(idempotent, name="post")
class _Protected(View):
    """Protected, and answering POST by its class: a pattern may close it."""

    def post(self, request: Any) -> HttpResponse:
        Charge.objects.create(account="protected", amount=1, currency="EUR")
        return HttpResponse("made", status=201)


class _NarrowApi(APIView):
    http_method_names = ["get"]

    def get(self, request: Any) -> Response:
        return Response({})

    def post(self, request: Any) -> Response:
        Charge.objects.create(account="narrow-api", amount=1, currency="EUR")
        return Response({}, status=201)


METHOD_NAMES_URLS = types.ModuleType("method_names_urls")
METHOD_NAMES_URLS.urlpatterns = [  # type: ignore[attr-defined]
    path("opened/", _Narrow.as_view(http_method_names=["get", "post"])),
    path("closed/", _Protected.as_view(http_method_names=["get", "options"])),
    path("opened-api/", _NarrowApi.as_view(http_method_names=["get", "post"])),
]


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF=METHOD_NAMES_URLS)
def test_the_audit_lists_the_methods_a_patterns_view_answers_as_as_view_gave_them(user):
    """``as_view(http_method_names=...)`` is what Django and DRF answer by. Before, the
    audit read the class's list: a POST opened by the pattern ran unprotected and was not
    listed (``--fail-on-unprotected`` passed), and a POST the pattern closed was listed
    as protected."""
    client = Client()
    client.force_login(user)
    answers = {
        url: client.post(url, {}, headers={"Idempotency-Key": "k-1"}).status_code
        for url in ("/opened/", "/closed/", "/opened-api/")
    }
    assert answers == {"/opened/": 201, "/closed/": 405, "/opened-api/": 201}
    assert sorted(Charge.objects.values_list("account", flat=True)) == ["narrow", "narrow-api"]
    listed = {(e.method, e.url): e.protected for e in audit().endpoints}
    assert listed == {("POST", "/opened/"): False, ("POST", "/opened-api/"): False}
    with pytest.raises(CommandError):
        call_command("idempotency_audit", "--fail-on-unprotected", stdout=io.StringIO())


# -- the admin's own views, and a project's views under the app name "admin" ------------------


def _staff_refund(request: Any) -> HttpResponse:
    """A project's staff API: unprotected, and included under the application namespace
    ``admin`` (its instance namespace ``staff``)."""
    Charge.objects.create(account="staff", amount=1, currency="EUR")
    return HttpResponse("refunded", status=201)


STAFF_URLS = types.ModuleType("staff_urls")
STAFF_URLS.urlpatterns = [  # type: ignore[attr-defined]
    path("admin/", admin.site.urls),
    path("staff/", include(([path("refunds/", _staff_refund)], "admin"), namespace="staff")),
]


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF=STAFF_URLS)
def test_a_projects_views_under_the_app_name_admin_are_listed_the_admins_are_not(user):
    """Only the admin site's own views are left out. Before, every URLconf included under
    the application namespace ``admin`` was: a project's unprotected staff endpoint there
    ran twice for one key, was not listed, and ``--fail-on-unprotected`` passed."""
    client = Client()
    client.force_login(user)
    for _ in range(2):
        response = client.post("/staff/refunds/", {}, headers={"Idempotency-Key": "k-1"})
        assert response.status_code == 201
    assert Charge.objects.filter(account="staff").count() == 2
    found = audit()
    assert [(e.method, e.url, e.protected) for e in found.endpoints] == [
        ("POST", "/staff/refunds/", False),
        ("PATCH", "/staff/refunds/", False),
    ]
    assert found.left_out == ("the admin's own views",)
    with pytest.raises(CommandError, match="unprotected: POST /staff/refunds/") as e:
        run("--fail-on-unprotected", "--verbosity", "0")
    assert e.value.returncode == 1


# -- --exclude with no prefix -------------------------------------------------------------------


@override_settings(ROOT_URLCONF=AUDIT_URLS)
@pytest.mark.parametrize("prefix", ["", "/", "//"])
def test_an_empty_exclude_prefix_is_refused_not_taken_for_every_url(prefix):
    """``--exclude "$PREFIX"`` with the variable unset names no prefix. Before, the empty
    prefix began every URL: every pattern was left out, and ``--fail-on-unprotected``
    passed over ten unprotected endpoints."""
    with pytest.raises(CommandError, match="--exclude"):
        run("--fail-on-unprotected", "--exclude", "api-auth/", "--exclude", prefix)
    with pytest.raises(ValueError, match="exclude"):
        audit(exclude=[prefix])
    assert len(audit(exclude=["api-auth/"]).unprotected) == 10


# -- a regex pattern's URL, as read ----------------------------------------------------------


def _legacy(request: Any, *args: Any, **kwargs: Any) -> HttpResponse:
    return HttpResponse("made", status=201)


REGEX_URLS = types.ModuleType("regex_urls")
REGEX_URLS.urlpatterns = [  # type: ignore[attr-defined]
    re_path(r"^legacy/(\d+)/(?P<slug>[\w-]+)/$", _legacy),
    re_path(r"(?i)^case/(?P<code>[a-z]{2}(?:-[a-z]{2})?)\.json$", _legacy),
    re_path(r"^files/(?:(?P<year>[0-9]{4})/)?(\w+)\.txt\Z", _legacy),
]


@override_settings(ROOT_URLCONF=REGEX_URLS)
def test_a_regex_patterns_url_names_its_groups_and_keeps_its_character_classes():
    r"""A regex's unnamed group is shown as ``<var>`` (as Django's admindocs shows it) and
    its named groups by their names; a leading ``(?i)`` is no part of a URL. Before, an
    unnamed group was shown as written with its escapes taken for literals: ``(\d+)``
    read ``(d+)``, a URL that matches nothing the pattern takes."""
    urls = [e.url for e in audit().endpoints if e.method == "POST"]
    assert urls == [
        "/legacy/<var>/<slug>/",
        "/case/<code>.json",
        "/files/(?:<year>/)?<var>.txt",
    ]
