"""Records written by the previous release, read by this one: a retry after the upgrade finds
the record its earlier release wrote, within its TTL, and runs nothing again.

0.1.4 stored an account or operation beginning with ``sha256:`` or ending in whitespace as it
was; this release stores such a name by its hash (two names never share a record). The
records here are written by 0.1.4's own code (its package taken from the repository's
history, run in a process of its own against the test database), then retried with today's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from io import BytesIO
from pathlib import Path

import pytest
from django.db import connection

from django_idempotency import InProgress, run_once, run_once_result
from django_idempotency.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)
# 0.1.4 runs in a process of its own: it reaches the test database on a server, never
# SQLite's in-memory one.
on_a_server = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="0.1.4's process needs the database on a server"
)

#: The commit of release 0.1.4 (the last before names were spelled by their hash).
RELEASE_0_1_4 = "667d7e7ea960ae2d041220e262832871b2beda3e"
ROOT = Path(__file__).resolve().parent.parent

# The earlier release's side: each call of run_once as 0.1.4 made it, printed as JSON.
OLD_CALLS = textwrap.dedent(
    """
    import json, sys
    import django
    django.setup()
    import django_idempotency
    from django_idempotency import run_once
    from django_idempotency.exceptions import SimulatedCrash

    def charge(tag):
        return {"charged": tag}

    def crash(tag):
        raise SimulatedCrash(tag)

    def order_view(account):
        from django.http import JsonResponse
        from django_idempotency.decorators import idempotent

        @idempotent(operation="orders.create", account=lambda request: account)
        def create_order(request):
            return JsonResponse({"made": "by 0.1.4"}, status=201)

        return create_order

    def post(call):
        from django.test import RequestFactory

        request = RequestFactory().post(
            "/orders/", '{"item": "pen"}', content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=call["key"],
        )
        response = order_view(call["account"])(request)
        return {"status": response.status_code, "body": response.content.decode()}

    results = []
    for call in json.loads(sys.argv[1]):
        if call.get("http"):
            results.append(post(call))
            continue
        body = crash if call.get("crash") else charge
        try:
            value = run_once(
                body, call["tag"], account=call["account"], operation=call["operation"],
                key=call["key"],
            )
            results.append({"value": value})
        except BaseException as exc:
            results.append({"error": type(exc).__name__})
    print(json.dumps({"version": django_idempotency.__version__, "results": results}))
    """
)

OLD_SETTINGS = textwrap.dedent(
    """
    import json, os
    SECRET_KEY = "django-idempotency-tests"
    USE_TZ = True
    INSTALLED_APPS = [
        "django.contrib.auth", "django.contrib.contenttypes", "django_idempotency",
    ]
    DATABASES = {"default": json.loads(os.environ["OLD_DATABASE"])}
    DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
    """
)


def release(tmp_path_factory: pytest.TempPathFactory, commit: str, version: str) -> Path:
    """A release's package, from the repository's history, beside a settings module of its
    own."""
    archive = subprocess.run(
        ["git", "archive", commit, "django_idempotency"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip(f"release {version} is not in this checkout's history: {archive.stderr!r}")
    where = tmp_path_factory.mktemp(f"release-{version}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(where, filter="data")
    (where / "old_settings.py").write_text(OLD_SETTINGS)
    return where


@pytest.fixture(scope="module")
def release_0_1_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return release(tmp_path_factory, RELEASE_0_1_4, "0.1.4")


def old_environment(where: Path) -> dict[str, str]:
    """The environment of an earlier release's process: its package, its settings, and the
    test database."""
    database = {
        key: value
        for key, value in connection.settings_dict.items()
        if key in ("ENGINE", "NAME", "USER", "PASSWORD", "HOST", "PORT")
    }
    return {
        **os.environ,
        "PYTHONPATH": str(where),
        "DJANGO_SETTINGS_MODULE": "old_settings",
        "OLD_DATABASE": json.dumps(database),
    }


def written_by_0_1_4(where: Path, calls: list[dict[str, object]]) -> list[dict[str, object]]:
    """Make ``calls`` with 0.1.4's ``run_once``, against the test database: what each gave."""
    env = old_environment(where)
    done = subprocess.run(
        [sys.executable, "-c", OLD_CALLS, json.dumps(calls)],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["version"] == "0.1.4"
    results: list[dict[str, object]] = answer["results"]
    return results


@pytest.fixture
def effects() -> list[str]:
    return []


def charge_now(effects: list[str], tag: str) -> dict[str, str]:
    effects.append(tag)
    return {"charged": f"{tag} (after the upgrade)"}


# Names 0.1.4 stored as they are, and this release by their hash.
RESPELLED = [
    ("acct ", "charges.create"),
    ("acct\t", "charges.create"),
    ("sha256:acct", "charges.create"),
    ("acct", "charges.create "),
    ("acct", "sha256:charges.create"),
]


@on_a_server
def test_a_retry_after_the_upgrade_replays_what_0_1_4_stored(release_0_1_4, effects):
    calls = [
        {"account": account, "operation": operation, "key": f"k-{n}", "tag": f"first-{n}"}
        for n, (account, operation) in enumerate(RESPELLED)
    ]
    before = written_by_0_1_4(release_0_1_4, calls)
    assert before == [{"value": {"charged": f"first-{n}"}} for n in range(len(RESPELLED))]
    assert IdempotencyRecord.objects.count() == len(RESPELLED)
    for n, (account, operation) in enumerate(RESPELLED):
        retried = run_once_result(
            charge_now, effects, f"retry-{n}", account=account, operation=operation, key=f"k-{n}"
        )
        assert retried.replayed
        assert retried.value == {"charged": f"first-{n}"}
        # and again, now under today's spelling
        again = run_once(
            charge_now, effects, f"again-{n}", account=account, operation=operation, key=f"k-{n}"
        )
        assert again == {"charged": f"first-{n}"}
    assert effects == []  # nothing ran a second time
    assert IdempotencyRecord.objects.count() == len(RESPELLED)  # adopted, not copied


@on_a_server
def test_a_claim_0_1_4_left_in_progress_is_still_in_progress_after_the_upgrade(
    release_0_1_4, effects
):
    """A crashed 0.1.4 attempt (its lease live): the retry is refused, not run."""
    calls = [{"account": "acct ", "operation": "refunds", "key": "k-c", "tag": "c", "crash": 1}]
    assert written_by_0_1_4(release_0_1_4, calls) == [{"error": "SimulatedCrash"}]
    with pytest.raises(InProgress):
        run_once(charge_now, effects, "retry", account="acct ", operation="refunds", key="k-c")
    assert effects == []


@on_a_server
def test_no_name_adopts_another_names_record_written_by_0_1_4(release_0_1_4, effects):
    """``acct`` and ``acct `` are two accounts (MariaDB's collations compare them as one):
    neither finds the other's record, whichever release wrote it."""
    calls = [
        {"account": "acct", "operation": "charges.create", "key": "k-1", "tag": "plain"},
        {"account": "sha256:x", "operation": "charges.create", "key": "k-2", "tag": "hashy"},
    ]
    assert len(written_by_0_1_4(release_0_1_4, calls)) == 2
    spaced = run_once(
        charge_now, effects, "spaced", account="acct ", operation="charges.create", key="k-1"
    )
    assert spaced == {"charged": "spaced (after the upgrade)"}
    plain = run_once(
        charge_now, effects, "plain", account="acct", operation="charges.create", key="k-1"
    )
    assert plain == {"charged": "plain"}  # 0.1.4's own record, untouched
    other = run_once(
        charge_now, effects, "other", account="sha256:y", operation="charges.create", key="k-2"
    )
    assert other == {"charged": "other (after the upgrade)"}
    assert effects == ["spaced", "other"]


@on_a_server
def test_0_1_4_wrote_no_record_for_a_name_holding_a_lone_surrogate(release_0_1_4, effects):
    """Such a name has no earlier spelling to look up: 0.1.4 could not store it at all."""
    calls = [{"account": "acct\ud800", "operation": "x", "key": "k-s", "tag": "s"}]
    (result,) = written_by_0_1_4(release_0_1_4, calls)
    assert "error" in result
    assert IdempotencyRecord.objects.count() == 0
    assert run_once(charge_now, effects, "s", account="acct\ud800", operation="x", key="k-s")
    assert effects == ["s"]


def test_a_name_spelling_a_hash_never_adopts_the_record_that_hash_stands_for(effects):
    """``sha256:<hex>`` of ``org\\x00acme`` is how that name is stored today, and how 0.1.4
    stored the name ``sha256:<hex>`` itself: looked up, it would find the other name's."""
    hidden = "org\x00acme"
    spelled = "sha256:" + hashlib.sha256(hidden.encode()).hexdigest()
    first = run_once(charge_now, effects, "hidden", account=hidden, operation="x", key="k-h")
    second = run_once(charge_now, effects, "spelled", account=spelled, operation="x", key="k-h")
    assert (first, second) != (first, first)
    assert effects == ["hidden", "spelled"]
    assert IdempotencyRecord.objects.count() == 2


@on_a_server
def test_over_http_a_retry_after_the_upgrade_replays_the_response_0_1_4_stored(release_0_1_4):
    """The same path for a view: a resolver's account ending in a space."""
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.test import RequestFactory

    from django_idempotency.decorators import idempotent

    ran: list[str] = []

    @idempotent(operation="orders.create", account=lambda request: "acct ")
    def create_order(request: HttpRequest) -> HttpResponse:
        ran.append("today")
        return JsonResponse({"made": "today"}, status=201)

    calls = [{"http": 1, "account": "acct ", "key": "k-http"}]
    (first,) = written_by_0_1_4(release_0_1_4, calls)
    assert first == {"status": 201, "body": '{"made": "by 0.1.4"}'}
    request = RequestFactory().post(
        "/orders/",
        '{"item": "pen"}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="k-http",
    )
    retried = create_order(request)
    assert ran == []
    assert (retried.status_code, retried.content) == (201, b'{"made": "by 0.1.4"}')
    assert retried["Idempotent-Replayed"] == "true"


# -- 0.2.0: DRF's format-suffix spelling of a route ---------------------------------------------

#: The commit of release 0.2.0 (the last that named a request to ``refunds.json`` by that
#: spelling's route, ``POST refunds<drf_format_suffix:format>``).
RELEASE_0_2_0 = "15028d7"

# The same URLconf as tests/testapp/suffix_upgrade_urls.py, for 0.2.0's process.
OLD_SUFFIX_URLS = textwrap.dedent(
    """
    from django.urls import path
    from rest_framework.decorators import api_view
    from rest_framework.response import Response
    from rest_framework.urlpatterns import format_suffix_patterns

    from django_idempotency.decorators import idempotent


    @api_view(["POST"])
    @idempotent(account=lambda request: "acct")
    def create_refund(request, format=None):
        return Response({"made": "by 0.2.0"}, status=201)


    urlpatterns = format_suffix_patterns([path("refunds/", create_refund)])
    """
)

OLD_SUFFIX_POST = textwrap.dedent(
    """
    import json, sys
    import django
    django.setup()
    import django_idempotency
    from django.test import Client

    response = Client().post(
        "/refunds.json", {"amount": 5}, content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=sys.argv[1],
    )
    print(json.dumps({"version": django_idempotency.__version__,
                      "status": response.status_code, "body": response.content.decode()}))
    """
)


@on_a_server
def test_a_retry_to_a_format_suffix_after_the_upgrade_replays_what_0_2_0_stored(
    tmp_path_factory, settings
):
    """0.2.0 stored a request to ``refunds.json`` under ``POST refunds<drf_format_suffix:
    format>``; this release names it ``POST refunds/``, and finds 0.2.0's record."""
    pytest.importorskip("rest_framework")  # DRF's format suffixes
    from django.test import Client

    from tests.testapp import suffix_upgrade_urls

    where = release(tmp_path_factory, RELEASE_0_2_0, "0.2.0")
    (where / "old_urls.py").write_text(OLD_SUFFIX_URLS)
    with (where / "old_settings.py").open("a") as old_settings:
        old_settings.write(
            '\nINSTALLED_APPS.append("rest_framework")\nROOT_URLCONF = "old_urls"\n'
            'ALLOWED_HOSTS = ["*"]\n'
        )
    env = old_environment(where)
    key = "k-suffix"
    done = subprocess.run(
        [sys.executable, "-c", OLD_SUFFIX_POST, key],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    old = json.loads(done.stdout.strip().splitlines()[-1])
    assert (old["version"], old["status"]) == ("0.2.0", 201)
    assert IdempotencyRecord.objects.get().operation == "POST refunds<drf_format_suffix:format>"

    settings.ROOT_URLCONF = "tests.testapp.suffix_upgrade_urls"
    suffix_upgrade_urls.RAN.clear()
    retried = Client().post(
        "/refunds.json", {"amount": 5}, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert suffix_upgrade_urls.RAN == []  # not run again
    assert (retried.status_code, retried.content) == (201, b'{"made":"by 0.2.0"}')
    assert retried["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().operation == "POST refunds/"  # adopted
    fresh = Client().post(
        "/refunds.json", {"amount": 5}, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k2"
    )
    assert fresh.status_code == 201
    assert suffix_upgrade_urls.RAN == ["today"]
