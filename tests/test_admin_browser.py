"""The records admin in a real browser: headless Chromium driven by Playwright.

Needs the ``playwright`` Python package and Debian's ``chromium`` at ``/usr/bin/chromium``
(Playwright's own browser downloads are not used). Without them the test is skipped on a
developer's machine, and fails under CI (``CI`` set), so a CI run can never pass without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django.contrib.admin
import pytest

import django_idempotency
from django_idempotency.models import RecordStatus
from tests.factories import RecordFactory, UserFactory

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ADMIN_STATIC = Path(django.contrib.admin.__file__).parent / "static"
PACKAGE_STATIC = Path(django_idempotency.__file__).parent / "static"
# The docs' admin page shows these screenshots. They are taken on every run; with
# DOCS_SCREENSHOTS=1 (`make docs-screenshots`) they replace the docs' images, otherwise they
# go to the test's temporary directory, so a test run leaves the checkout as it was.
DOCS_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images" / "admin"


def screenshot_path(tmp_path: Path, name: str) -> Path:
    """Where a screenshot goes: the docs' images when asked to and the docs are here."""
    wanted = os.environ.get("DOCS_SCREENSHOTS") == "1" and DOCS_IMAGES.is_dir()
    return DOCS_IMAGES / name if wanted else tmp_path / name


pytestmark = pytest.mark.django_db(transaction=True)


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run the browser test", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed")
    if not CHROMIUM.exists():
        unavailable(f"{CHROMIUM} is missing (Debian package chromium)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield launched
        launched.close()


def serve_admin_static(route: Any) -> None:
    """The test settings have no staticfiles app: the browser gets the admin's CSS, and the
    package's, from disk."""
    relative = route.request.url.split("/static/", 1)[1].split("?")[0]
    for root in (ADMIN_STATIC, PACKAGE_STATIC):
        path = (root / relative).resolve()
        if root.resolve() in path.parents and path.is_file():
            route.fulfill(path=str(path))
            return
    route.fulfill(status=404)


@pytest.fixture
def records() -> dict[str, Any]:
    """Requested before ``browser``: once Playwright's event loop runs in this thread,
    Django refuses synchronous queries in it."""
    admin = UserFactory(username="ops", is_staff=True, is_superuser=True)
    RecordFactory(key="done-key", operation="charges.create")
    failed = RecordFactory(
        key="failed-key",
        operation="refunds.create",
        status=RecordStatus.FAILED,
        response_status=200,
        response_headers=[["Content-Type", "application/problem+json"]],
        response_body=b'{"type":"about:blank","title":"Outcome unknown","status":200,'
        b'"code":"idempotency_outcome_unknown","detail":"<needs reconciliation>"}',
    )
    return {"admin": admin, "failed": failed}


def test_log_in_filter_by_status_and_open_a_record(records, live_server, browser, tmp_path):
    admin, failed = records["admin"], records["failed"]
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(15_000)
    page.route("**/static/**", serve_admin_static)

    changelist = "/admin/django_idempotency/idempotencyrecord/"
    page.goto(f"{live_server.url}/admin/login/?next={changelist}")
    page.fill("#id_username", admin.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{changelist}")
    assert page.locator("#result_list tbody tr").count() == 2

    page.locator("#changelist-filter a", has_text="failed").first.click()
    page.wait_for_url("**status__exact=failed**")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    assert "failed-key" in rows.first.inner_text()
    page.screenshot(path=screenshot_path(tmp_path, "changelist-failed.png"), full_page=True)

    rows.first.locator("th a").click()
    page.wait_for_url(f"**{changelist}{failed.pk}/change/**")
    body = page.locator("pre.idempotency-body").inner_text()
    assert '"code": "idempotency_outcome_unknown"' in body
    assert "<needs reconciliation>" in body  # shown as text, not parsed as markup
    assert page.locator("input[name=_save]").count() == 0
    shot = screenshot_path(tmp_path, "record.png")
    page.screenshot(path=shot, full_page=True)
    assert shot.stat().st_size > 10_000


# --- the example project's own admin ------------------------------------------------------


def test_the_example_projects_admin_in_a_browser(example, browser, tmp_path):
    """Log in to the example project's admin, list the records, filter, open one."""
    import httpx

    charge = {"amount": 1234, "currency": "EUR"}
    headers = {"Idempotency-Key": "browser-" + os.urandom(8).hex()}
    with httpx.Client(base_url=example.url, auth=("demo", "demo"), timeout=30) as client:
        created = client.post("/api/charges/", json=charge, headers=headers)
        assert created.status_code == 201
        replayed = client.post("/api/charges/", json=charge, headers=headers)
        assert replayed.headers["Idempotent-Replayed"] == "true"

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(15_000)
    page.route("**/static/**", serve_admin_static)
    changelist = "/admin/django_idempotency/idempotencyrecord/"
    page.goto(f"{example.url}/admin/login/?next={changelist}")
    page.fill("#id_username", "demo")
    page.fill("#id_password", "demo")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{changelist}")

    page.locator("#changelist-filter a", has_text="completed").first.click()
    page.wait_for_url("**status__exact=completed**")
    rows = page.locator("#result_list tbody tr", has_text=headers["Idempotency-Key"])
    assert rows.count() == 1
    page.screenshot(path=screenshot_path(tmp_path, "example-changelist.png"), full_page=True)

    rows.first.locator("th a").click()
    page.wait_for_url("**/change/**")
    body = page.locator("pre.idempotency-body").inner_text()
    assert '"amount": 1234' in body
    assert page.locator("input[name=_save]").count() == 0
    shot = screenshot_path(tmp_path, "example-record.png")
    page.screenshot(path=shot, full_page=True)
    assert shot.stat().st_size > 10_000


# --- the changelist at a laptop's width -----------------------------------------------------


@pytest.fixture
def long_records() -> dict[str, Any]:
    """Records with the longest values of everyday use: UUID keys, accounts of a resolver of
    the project's own, dotted operation names and the default's method-and-route names."""
    admin = UserFactory(username="ops", is_staff=True, is_superuser=True)
    for n in range(5):
        RecordFactory(
            key=f"7f3c2a9e-1b4d-4c8e-9f10-2a6b8c0d4e{n:02d}",
            account=f"tenant:acme-industries-europe/user:{123456789 + n}",
            operation="POST api/v1/organisations/<int:org_id>/subscriptions/renewals/",
        )
    RecordFactory(
        key="in-progress-" + "x" * 60,
        account="webhook:stripe",
        operation="webhooks.stripe.invoice.payment_succeeded",
        status=RecordStatus.IN_PROGRESS,
        response_status=None,
    )
    return {"admin": admin}


def test_the_changelist_fits_a_1280_pixel_window(long_records, live_server, browser, tmp_path):
    """At 1280 px the records list needs no horizontal scrolling: a long key is cut short
    in its cell (whole in its title), accounts and operations are shown whole (wrapped where
    they must be), and the age ("0 minutes") and a short expiry stay on one line."""
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(15_000)
    page.route("**/static/**", serve_admin_static)
    changelist = "/admin/django_idempotency/idempotencyrecord/"
    page.goto(f"{live_server.url}/admin/login/?next={changelist}")
    page.fill("#id_username", long_records["admin"].username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{changelist}")
    assert page.locator("#result_list tbody tr").count() == 6
    page.screenshot(path=tmp_path / "changelist-1280.png", full_page=True)

    widths = page.evaluate(
        """() => ({
            page: document.documentElement.scrollWidth,
            window: document.documentElement.clientWidth,
            table: document.querySelector('#result_list').getBoundingClientRect().right,
            results: document.querySelector('.results').clientWidth,
            resultsScroll: document.querySelector('.results').scrollWidth,
        })"""
    )
    assert widths["page"] <= widths["window"] <= 1280, widths
    assert widths["resultsScroll"] <= widths["results"], widths
    # The key of the oldest row in its title; its account and operation whole, nothing
    # hidden; its age and its expiry each on one line.
    row = page.locator("#result_list tbody tr").last
    titles = row.locator("[title]").evaluate_all("cells => cells.map(c => c.title)")
    assert titles == ["7f3c2a9e-1b4d-4c8e-9f10-2a6b8c0d4e00"]
    shown = row.locator(".idempotency-whole").evaluate_all(
        """spans => spans.map(s => ({text: s.innerText.replace(/\\s+/g, ''),
            hidden: s.parentElement.scrollWidth > s.parentElement.clientWidth}))"""
    )
    assert shown == [
        {"text": "tenant:acme-industries-europe/user:123456789", "hidden": False},
        {"text": "POSTapi/v1/organisations/<int:org_id>/subscriptions/renewals/", "hidden": False},
    ]
    lines = row.locator("td.field-age, td.field-expiry").evaluate_all(
        """cells => cells.map(c => {
            const range = document.createRange(); range.selectNodeContents(c);
            return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
        })"""
    )
    assert lines == [1, 1], lines  # "0 minutes", "in 23 hours"
