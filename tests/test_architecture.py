"""docs/architecture.md tells the truth: its module map is the package's modules, and the
hand-offs it counts on one protected request are those a trace of that request sees."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.test import RequestFactory

pytest.importorskip("rest_framework")  # the traced request is a DRF create

from rest_framework import viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory, force_authenticate

import django_idempotency
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotencyMixin
from tests.factories import UserFactory

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = Path(django_idempotency.__file__).parent

pytestmark = pytest.mark.skipif(not PAGE.is_file(), reason="the docs are not here")


def modules() -> set[str]:
    """Every module of the package with code of its own (not its migrations)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        if "migrations" in relative.parts or not path.read_text().strip():
            continue
        found.add(".".join(relative.parts).removesuffix(".__init__"))
    return found


def test_the_module_map_is_the_packages_modules() -> None:
    text = PAGE.read_text()
    mapped = set(re.findall(r"^\| `(django_idempotency[\w.]*)` \|", text, re.M))
    assert mapped == modules()
    # Public and private as their names say: the private ones under their own headings.
    private = text.split("### Private modules", 1)[1]
    public = text.split("### Public modules", 1)[1].split("### Private modules", 1)[0]
    for name in mapped:
        is_private = any(part.startswith("_") for part in name.split(".")[1:])
        assert f"| `{name}` |" in (private if is_private else public), name


def test_no_module_tells_one_database_from_another_outside_the_vendor_seam() -> None:
    """Every difference between databases is a member of ``django_idempotency._vendors``
    (docs/architecture.md, "Vendors"): no test of ``connection.vendor`` outside it. The
    migrations keep theirs: a migration is history, and does the same thing for ever."""
    seam = PACKAGE / "_vendors"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if seam in path.parents or "migrations" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = isinstance(node, ast.Attribute) and node.attr == "vendor"
            spelled = (  # getattr(connection, "vendor")
                isinstance(node, ast.Constant) and node.value == "vendor"
            )
            if named or spelled:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []
    # And the seam is where the page says it is.
    assert "## Vendors" in PAGE.read_text()


def test_every_member_of_the_vendor_interface_is_on_the_page() -> None:
    """The page's table of the seam is the checklist of a new vendor: every member of
    ``Vendor``, and nothing else."""
    from django_idempotency._vendors.base import Vendor

    members = {name for name in vars(Vendor) if not name.startswith("_") and name != "name"}
    section = PAGE.read_text().split("## Vendors", 1)[1]
    shown = set(re.findall(r"^\| `(\w+)(?:\(\))?` \|", section, re.M))
    assert shown == members


def handoffs(call: Callable[[], Any]) -> list[tuple[str, str]]:
    """The calls from a function of one module of the package to a function of another
    while ``call`` runs, reads of the settings (``conf``) left out."""
    seen: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if (
            callee != caller
            and callee.startswith("django_idempotency")
            and caller.startswith("django_idempotency")
            and callee != "django_idempotency.conf"
        ):
            seen.append((caller, f"{callee}.{frame.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def modules_of(trace: list[tuple[str, str]]) -> set[str]:
    """The package's modules a trace crosses: every caller's and every callee's."""
    return {module for caller, callee in trace for module in (caller, callee.rsplit(".", 1)[0])}


@idempotent
def create_order(request: Any) -> HttpResponse:
    return JsonResponse({"order": 1}, status=201)


class Orders(IdempotencyMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response({"order": 1}, status=201)


def function_view(user: Any) -> Callable[[str], HttpResponseBase]:
    def post(key: str) -> HttpResponseBase:
        request = RequestFactory().post(
            "/orders/", "{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )
        request.user = user
        return create_order(request)

    return post


def drf_viewset(user: Any) -> Callable[[str], HttpResponseBase]:
    # As a router makes it: the basename names the operation (orders.create).
    view = Orders.as_view({"post": "create"}, basename="orders")

    def post(key: str) -> HttpResponseBase:
        request = APIRequestFactory().post("/orders/", {}, format="json", HTTP_IDEMPOTENCY_KEY=key)
        force_authenticate(request, user)
        response: HttpResponseBase = view(request)
        return response

    return post


ENTRIES = {"a DRF viewset's create": drf_viewset, "an `@idempotent` function view": function_view}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_the_handoffs_counted_on_the_page_are_those_of_a_traced_request(
    transactional_db: Any, entry: str
) -> None:
    # The request's connection in autocommit, as a server's is (no test case's transaction).
    shown = {
        (name, database): tuple(int(n) for n in figures)
        for name, database, *figures in re.findall(
            r"^\| (.+?) \| (PostgreSQL|SQLite) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$",
            PAGE.read_text(),
            re.M,
        )
    }
    database = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}.get(connection.vendor)
    if database is None:
        pytest.skip(f"the page counts on PostgreSQL and SQLite, not {connection.vendor}")
    if connection.settings_dict["OPTIONS"].get("prepare_threshold") is not None:
        # make test-pg16 runs with prepared statements: their cursor is one more hand-off.
        pytest.skip("the page counts on Django's defaults, without prepared statements")
    post = ENTRIES[entry](UserFactory())
    post("warm-up")  # the statements' text, built once per database
    post("warm-up")
    answers: list[HttpResponseBase] = []
    first = handoffs(lambda: answers.append(post("counted")))
    replay = handoffs(lambda: answers.append(post("counted")))
    assert [a.get("Idempotent-Replayed") for a in answers] == [None, "true"]
    assert ("django_idempotency._http", "django_idempotency._execution.run_owned") in first
    assert all(not callee.startswith("django_idempotency._execution") for _, callee in replay)
    counted = (len(first), len(modules_of(first)), len(replay), len(modules_of(replay)))
    assert counted == shown[(entry, database)], (first, replay)
    if database == "PostgreSQL":
        # What a POST may cross, first request and replay alike.
        assert max(counted[0], counted[2]) <= 15
        assert max(counted[1], counted[3]) <= 10
