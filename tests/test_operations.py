"""One endpoint, one operation; two endpoints, two operations.

- DRF's format suffixes make one endpoint answer at ``transfers/`` and ``transfers.json``.
  Both spellings once derived an operation of their own (the route), so one key sent to
  both ran the view twice (the mixin and ``@api_view`` alike). They are now one operation,
  the plain spelling's, and the audit lists the endpoint once.
- One viewset's basename under two routers (``v1/``, ``v2/``) derives one operation for
  two endpoints: v2 replayed v1's outcome and its own handler never ran. That is a check
  Error naming both, unless the project gives one its own operation (a basename of its own,
  ``idempotency_operation``), and the audit flags it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("rest_framework")

from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.http import JsonResponse
from django.test import Client, override_settings
from rest_framework.urlpatterns import format_suffix_patterns

from django_idempotency import _check_ids
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key
from tests.testapp import shapes_urls
from tests.testapp.models import Charge

SHAPES = "tests.testapp.shapes_urls"


def audit(*args: str) -> dict[str, Any]:
    out = io.StringIO()
    call_command("idempotency_audit", "--format", "json", *args, stdout=out)
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.fixture
def client(user):
    client = Client()
    client.force_login(user)
    return client


def post(client: Client, url: str, key: str) -> Any:
    return client.post(url, {}, content_type="application/json", headers={"Idempotency-Key": key})


# -- format suffixes ---------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.urls(SHAPES)
@pytest.mark.parametrize(
    ("spellings", "account"),
    [
        (["/transfers/", "/transfers.json", "/transfers.api"], "transfer"),  # the mixin
        (["/refunds/", "/refunds.json"], "refund"),  # @api_view
        (["/api/ledger/", "/api/ledger.json"], "ledger:/api/ledger/"),  # a router's
        (["/payments/", "/payments.json"], "payment"),  # regex, included under ""
    ],
)
def test_one_key_sent_to_every_spelling_of_an_endpoint_runs_it_once(client, spellings, account):
    key = new_key()
    first = post(client, spellings[0], key)
    assert first.status_code == 201
    for url in spellings[1:]:
        # The same operation: never a second run (a replay, or 422 where the spelling's
        # format is part of the request's fingerprint).
        assert post(client, url, key).status_code in (201, 422), url
    assert Charge.objects.filter(account__startswith=account.partition(":")[0]).count() == 1
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.urls(SHAPES)
def test_each_spelling_names_the_plain_spellings_operation(client):
    for url, operation in [
        ("/transfers.json", "POST transfers/"),
        ("/refunds.json", "POST refunds/"),
        ("/api/ledger.json", "ledger.create"),
        # As Django's ResolverMatch.route spells it: an empty prefix keeps the "^".
        ("/payments.json", "POST ^payments/$"),
    ]:
        assert post(client, url, new_key()).status_code == 201
        assert IdempotencyRecord.objects.filter(operation=operation).count() == 1, url


@pytest.mark.django_db
@pytest.mark.urls(SHAPES)
def test_a_retry_after_the_upgrade_finds_what_a_regex_suffix_stored_under_its_own_route(
    client, monkeypatch
):
    """The previous release named ``payments.json`` (a regex included under ``""``) by its
    own route: its twin table never matched Django's spelling. A retry now replays that
    record, adopted under the plain route's operation, and the view does not run again."""
    from django_idempotency import _routes

    key = new_key()
    with monkeypatch.context() as old_release:
        old_release.setattr(_routes, "twins", lambda urlconf=None: {})
        assert post(client, "/payments.json", key).status_code == 201
    (record,) = IdempotencyRecord.objects.all()
    assert record.operation == r"POST ^payments\.(?P<format>[a-z0-9]+)/?$"
    retried = post(client, "/payments.json", key)
    assert (retried.status_code, retried["Idempotent-Replayed"]) == (201, "true")
    assert Charge.objects.filter(account="payment").count() == 1
    assert IdempotencyRecord.objects.get().operation == "POST ^payments/$"


@override_settings(ROOT_URLCONF=SHAPES)
def test_the_audit_lists_one_endpoint_once_with_its_one_operation():
    posts = [(e["url"], e["operation"]) for e in audit()["endpoints"] if e["method"] == "POST"]
    assert posts == [
        ("/payouts/", "POST payouts/"),
        ("/refunds/async/", "refunds.async"),
        ("/refunds/async/listed/", "refunds.async-listed"),
        ("/notes/async/", "notes.async"),
        ("/transfers/", "POST transfers/"),
        ("/refunds/", "POST refunds/"),
        ("/api/ledger/", "ledger.create"),
        ("/payments/", "POST ^payments/$"),
    ]


# -- with and without a trailing slash --------------------------------------------------------


class WithAndWithoutSlash:
    urlpatterns = shapes_urls.with_and_without_slash


@pytest.fixture
def slash_urls() -> Iterator[None]:
    with override_settings(ROOT_URLCONF=WithAndWithoutSlash):
        yield


@pytest.mark.django_db
@pytest.mark.usefixtures("slash_urls")
@pytest.mark.parametrize(
    ("spellings", "account", "operation"),
    [
        (["/deposits/", "/deposits"], "deposit", "POST deposits/"),
        (["/deposits", "/deposits/"], "deposit", "POST deposits/"),
        (["/withdrawals", "/withdrawals/"], "withdrawal", "POST withdrawals/"),
        (["/fees/", "/fees"], "fee", "POST ^fees/$"),
    ],
)
def test_one_key_sent_with_and_without_the_slash_runs_the_view_once(
    client, spellings, account, operation
):
    key = new_key()
    first, again = (post(client, url, key) for url in spellings)
    assert first.status_code == 201
    assert (again.status_code, again["Idempotent-Replayed"]) == (201, "true")
    assert Charge.objects.filter(account=account).count() == 1
    assert list(IdempotencyRecord.objects.values_list("operation", flat=True)) == [operation]


@pytest.mark.django_db
@pytest.mark.usefixtures("slash_urls")
def test_another_view_without_the_slash_is_another_operation(client):
    key = new_key()
    assert post(client, "/grants/", key).status_code == 201
    assert post(client, "/grants", key).status_code == 201
    assert Charge.objects.filter(account="grant").count() == 1
    assert Charge.objects.filter(account="deposit").count() == 1
    assert sorted(IdempotencyRecord.objects.values_list("operation", flat=True)) == [
        "POST grants",
        "POST grants/",
    ]


@pytest.mark.django_db
@pytest.mark.usefixtures("slash_urls")
def test_a_retry_after_the_upgrade_finds_what_the_other_spelling_stored_under_its_route(
    client, monkeypatch
):
    """The previous release named ``deposits`` by its own route. A retry now replays that
    record, adopted under the first spelling's operation, and the view does not run again."""
    from django_idempotency import _routes

    key = new_key()
    with monkeypatch.context() as old_release:
        old_release.setattr(_routes, "twins", lambda urlconf=None: {})
        assert post(client, "/deposits", key).status_code == 201
    assert IdempotencyRecord.objects.get().operation == "POST deposits"
    retried = post(client, "/deposits", key)
    assert (retried.status_code, retried["Idempotent-Replayed"]) == (201, "true")
    assert Charge.objects.filter(account="deposit").count() == 1
    assert IdempotencyRecord.objects.get().operation == "POST deposits/"


@override_settings(ROOT_URLCONF=WithAndWithoutSlash)
def test_the_audit_lists_an_endpoint_with_and_without_its_slash_once():
    posts = [(e["url"], e["operation"]) for e in audit()["endpoints"] if e["method"] == "POST"]
    assert posts == [
        ("/deposits/", "POST deposits/"),
        ("/withdrawals/", "POST withdrawals/"),
        ("/fees/", "POST ^fees/$"),
        ("/grants/", "POST grants/"),
        ("/grants", "POST grants"),
    ]


class SlashSpelledOtherwise:
    urlpatterns = shapes_urls.slash_spelled_otherwise


@pytest.mark.django_db
@override_settings(ROOT_URLCONF=SlashSpelledOtherwise)
@pytest.mark.parametrize(
    ("spellings", "account", "operation"),
    [
        (["/remits/", "/remits.json", "/remits", "/remits.api"], "remit", "POST remits/"),
        (["/remits", "/remits.json"], "remit", "POST remits/"),
        (["/rebates/", "/rebates"], "rebate", "POST rebates/"),
        (["/rebates", "/rebates/"], "rebate", "POST rebates/"),
    ],
)
def test_one_key_sent_to_a_slash_twin_spelled_otherwise_runs_the_view_once(
    client, spellings, account, operation
):
    """DRF's format suffix of a view at ``x/`` and at ``x`` (both suffixed spellings are
    ``x<drf_format_suffix:format>``), and a ``path()`` beside a ``re_path()``: one endpoint."""
    key = new_key()
    first = post(client, spellings[0], key)
    assert first.status_code == 201
    for url in spellings[1:]:
        # Never a second run: a replay, or 422 where the format is part of the fingerprint.
        assert post(client, url, key).status_code in (201, 422), url
    assert Charge.objects.filter(account=account).count() == 1
    assert list(IdempotencyRecord.objects.values_list("operation", flat=True)) == [operation]


@pytest.mark.django_db
@override_settings(ROOT_URLCONF=SlashSpelledOtherwise)
def test_one_view_given_other_url_arguments_at_each_spelling_is_two_operations(client):
    """``bonuses/`` pays cash and ``bonuses`` vouchers: one function, two endpoints. A key sent
    to both runs each once; neither is refused as the other's request."""
    key = new_key()
    assert post(client, "/bonuses/", key).status_code == 201
    assert post(client, "/bonuses", key).status_code == 201
    assert sorted(Charge.objects.values_list("account", flat=True)) == [
        "bonus:cash",
        "bonus:voucher",
    ]
    assert sorted(IdempotencyRecord.objects.values_list("operation", flat=True)) == [
        "POST bonuses",
        "POST bonuses/",
    ]


@override_settings(ROOT_URLCONF=SlashSpelledOtherwise)
def test_the_audit_lists_a_slash_twin_spelled_otherwise_as_it_runs():
    posts = [(e["url"], e["operation"]) for e in audit()["endpoints"] if e["method"] == "POST"]
    assert posts == [
        ("/remits/", "POST remits/"),
        ("/rebates/", "POST rebates/"),
        ("/bonuses/", "POST bonuses/"),
        ("/bonuses", "POST bonuses"),
    ]


class SlashAtTwoLevels:
    urlpatterns = shapes_urls.slash_at_two_levels


@pytest.mark.django_db
@override_settings(ROOT_URLCONF=SlashAtTwoLevels)
@pytest.mark.parametrize(
    ("spellings", "account", "operation"),
    [
        (["/api/levies/", "/api/levies"], "levy", "POST api/levies/"),
        (["/api/ledger/", "/api/ledger"], "ledger", "ledger.create"),
    ],
)
def test_one_key_sent_to_a_slash_twin_at_another_level_runs_the_view_once(
    client, spellings, account, operation
):
    key = new_key()
    first, again = (post(client, url, key) for url in spellings)
    assert first.status_code == 201
    assert (again.status_code, again["Idempotent-Replayed"]) == (201, "true")
    assert Charge.objects.filter(account__startswith=account).count() == 1
    assert list(IdempotencyRecord.objects.values_list("operation", flat=True)) == [operation]


@override_settings(ROOT_URLCONF=SlashAtTwoLevels)
def test_a_slash_twin_at_another_level_is_one_endpoint_to_the_audit_and_the_check():
    """Two routers of one viewset, with and without trailing slashes, are one endpoint: not
    E060, whose ways out (another basename, an operation of its own) would make them two
    operations, and a key sent to both would run twice."""
    report = audit()
    posts = [(e["url"], e["operation"]) for e in report["endpoints"] if e["method"] == "POST"]
    assert posts == [("/api/levies/", "POST api/levies/"), ("/api/ledger/", "ledger.create")]
    assert report["shared_operations"] == []
    assert [m.id for m in run_checks(tags=["urls"])] == []


def test_the_twins_of_a_large_urlconf_are_found_without_comparing_every_pair(monkeypatch):
    """Every request reads the twins table, and a process's first request builds it: a
    router of many viewsets puts thousands of patterns at one level. Each pattern is compared
    with the patterns that could be its twins, not with every pattern before it (which cost
    seconds on the first request of every process)."""
    from django.urls import clear_url_caches, path

    from django_idempotency import _routes

    def view(number: int) -> Any:
        return lambda request: JsonResponse({"number": number})

    views = [view(number) for number in range(300)]

    class Many:
        urlpatterns = [
            *[path(f"items{n}/", v) for n, v in enumerate(views)],
            *[path(f"items{n}", v) for n, v in enumerate(views)],
            *format_suffix_patterns([path(f"other{n}/", v) for n, v in enumerate(views)]),
        ]

    compared = []

    def counted(pattern: Any, plain: Any) -> bool:
        compared.append(pattern)
        return is_twin(pattern, plain)

    is_twin = _routes._is_twin
    monkeypatch.setattr(_routes, "_is_twin", counted)
    with override_settings(ROOT_URLCONF=Many):
        try:
            twins = _routes.twins()
        finally:
            clear_url_caches()
    assert twins == {
        **{f"items{n}": f"items{n}/" for n in range(300)},
        **{f"other{n}<drf_format_suffix:format>": f"other{n}/" for n in range(300)},
    }
    assert len(compared) <= 2 * 1200, len(compared)


# -- one view in every language (i18n_patterns) -----------------------------------------------


class InEveryLanguage:
    urlpatterns = shapes_urls.in_every_language


class DefaultLanguageUnprefixed:
    urlpatterns = shapes_urls.default_language_unprefixed


in_languages = override_settings(
    USE_I18N=True,
    LANGUAGE_CODE="en",
    LANGUAGES=[("en", "English"), ("fr", "French"), ("pt-br", "Brazilian Portuguese")],
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.locale.LocaleMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
    ],
)


@pytest.mark.django_db
@in_languages
@pytest.mark.parametrize(
    ("urlconf", "spellings", "account", "operation"),
    [
        (
            InEveryLanguage,
            ["/en/charges/", "/fr/charges/", "/pt-br/charges/"],
            "refund",
            "POST en/charges/",
        ),
        (DefaultLanguageUnprefixed, ["/charges/", "/fr/charges/"], "refund", "POST charges/"),
        (
            InEveryLanguage,
            ["/fr/bookings/", "/en/bookings.json", "/fr/bookings.json"],
            "booking",
            "POST en/bookings/$",
        ),
        (
            DefaultLanguageUnprefixed,
            ["/fr/bookings.json", "/bookings/"],
            "booking",
            "POST ^bookings/$",
        ),
    ],
)
def test_one_key_sent_in_every_language_runs_the_view_once(
    client, urlconf, spellings, account, operation
):
    """A language prefix is a spelling of the endpoint: one operation, named by the route
    as the default language (LANGUAGE_CODE) spells it."""
    key = new_key()
    with override_settings(ROOT_URLCONF=urlconf):
        assert post(client, spellings[0], key).status_code == 201
        for url in spellings[1:]:
            assert post(client, url, key).status_code in (201, 422), url
    assert Charge.objects.filter(account=account).count() == 1
    assert list(IdempotencyRecord.objects.values_list("operation", flat=True)) == [operation]


class BesideALanguage:
    urlpatterns = shapes_urls.beside_a_language


@pytest.mark.django_db
@in_languages
@override_settings(ROOT_URLCONF=BesideALanguage)
def test_a_view_of_its_own_at_a_languages_spelling_is_another_operation(client):
    """``fr/charges/`` outside ``i18n_patterns`` (listed first, so Django resolves it there)
    is another endpoint than the i18n view's ``en/charges/``: never its operation."""
    key = new_key()
    assert post(client, "/fr/charges/", key).status_code == 201
    assert post(client, "/en/charges/", key).status_code == 201
    assert Charge.objects.filter(account="transfer").count() == 1
    assert Charge.objects.filter(account="refund").count() == 1
    assert sorted(IdempotencyRecord.objects.values_list("operation", flat=True)) == [
        "POST en/charges/",
        "POST fr/charges/",
    ]


@in_languages
@override_settings(ROOT_URLCONF=InEveryLanguage)
def test_the_audit_lists_a_view_in_every_language_once_under_its_one_operation():
    posts = [(e["url"], e["operation"]) for e in audit()["endpoints"] if e["method"] == "POST"]
    assert posts == [("/en/charges/", "POST en/charges/"), ("/en/bookings/", "POST en/bookings/$")]
    assert shared_errors() == []


@pytest.mark.django_db
@in_languages
@override_settings(ROOT_URLCONF=InEveryLanguage)
def test_a_retry_after_the_upgrade_finds_what_another_language_stored_under_its_route(
    client, monkeypatch
):
    """The previous release named a request to ``fr/charges/`` by that route; a retry now
    replays its record, adopted under the default language's operation."""
    from django_idempotency import _routes

    key = new_key()
    with monkeypatch.context() as old_release:
        old_release.setattr(_routes, "canonical_route", lambda route, *where: route)
        assert post(client, "/fr/charges/", key).status_code == 201
    assert IdempotencyRecord.objects.get().operation == "POST fr/charges/"
    retried = post(client, "/fr/charges/", key)
    assert (retried.status_code, retried["Idempotent-Replayed"]) == (201, "true")
    assert Charge.objects.filter(account="refund").count() == 1
    assert IdempotencyRecord.objects.get().operation == "POST en/charges/"


# -- one basename under two routers -----------------------------------------------------------


class TwoRouters:
    urlpatterns = shapes_urls.two_routers


class OwnBasename:
    urlpatterns = shapes_urls.two_routers_own_basename


class OwnOperation:
    urlpatterns = shapes_urls.two_routers_own_operation


SHARED = _check_ids.error("OPERATION_SHARED")


def shared_errors() -> list[Any]:
    return [m for m in run_checks(tags=["urls"]) if m.id == SHARED]


@pytest.mark.django_db
@override_settings(ROOT_URLCONF=TwoRouters)
def test_one_basename_under_two_routers_shares_one_record(client):
    # What the check stops: v2's handler never runs, v2 gets v1's answer.
    key = new_key()
    v1, v2 = post(client, "/v1/ledger/", key), post(client, "/v2/ledger/", key)
    assert v2.content == v1.content
    assert v2["Idempotent-Replayed"] == "true"
    assert list(Charge.objects.values_list("account", flat=True)) == ["ledger:/v1/ledger/"]


@override_settings(ROOT_URLCONF=TwoRouters)
def test_it_is_a_check_error_naming_both_endpoints():
    [error] = shared_errors()
    assert error.level == 40  # Error
    assert "ledger.create" in error.msg
    assert "POST /v1/ledger/" in error.msg
    assert "POST /v2/ledger/" in error.msg
    assert "basename" in error.hint


@override_settings(ROOT_URLCONF=TwoRouters)
def test_the_audit_flags_it_and_fails_ci():
    report = audit()
    assert report["shared_operations"] == [
        {"operation": "ledger.create", "endpoints": ["POST /v1/ledger/", "POST /v2/ledger/"]}
    ]
    out = io.StringIO()
    call_command("idempotency_audit", stdout=out)
    # The report docs/checks.md shows.
    assert out.getvalue() == (Path(__file__).parent / "audit" / "shared.txt").read_text()
    with pytest.raises(CommandError, match="1 operation shared by several endpoints") as e:
        audit("--fail-on-unprotected")
    assert e.value.returncode == 1


@pytest.mark.django_db
@pytest.mark.parametrize("urlconf", [OwnBasename, OwnOperation])
def test_an_operation_of_its_own_is_accepted_and_runs_each_endpoint(client, urlconf):
    with override_settings(ROOT_URLCONF=urlconf):
        assert shared_errors() == []
        assert audit()["shared_operations"] == []
        key = new_key()
        assert [post(client, url, key).status_code for url in ("/v1/ledger/", "/v2/ledger/")] == [
            201,
            201,
        ]
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 2


@override_settings(ROOT_URLCONF=SHAPES)
def test_format_suffix_twins_are_not_two_endpoints():
    assert shared_errors() == []
    assert audit()["shared_operations"] == []
