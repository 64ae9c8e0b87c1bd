"""The example project's django-ninja charges (``/ninja/charges``), against a real server of
the example project: one charge per key, the replay, and the Swagger page that shows the key."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("ninja")
httpx = pytest.importorskip("httpx")
pytest.importorskip(
    "example_project.client", reason="the example project is not here (tox tests the wheel)"
)

from tests.helpers import Example  # noqa: E402

PAYLOAD = {"amount": 4200, "currency": "EUR", "description": "through ninja"}


def test_a_retried_ninja_charge_runs_once_and_replays(example: Example) -> None:
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    with httpx.Client(base_url=example.url, auth=("demo", "demo"), timeout=30) as client:
        first = client.post("/ninja/charges", json=PAYLOAD, headers=headers)
        retry = client.post("/ninja/charges", json=PAYLOAD, headers=headers)
        listed = client.get("/ninja/charges")
    assert first.status_code == 201, first.text
    assert first.headers["Location"] == f"/ninja/charges/{first.json()['id']}"
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert retry.headers["Location"] == first.headers["Location"]
    assert [c["id"] for c in listed.json()].count(first.json()["id"]) == 1
    assert example.count("payments_charge", "through ninja") == 1
    assert example.count("payments_providercall", "through ninja") == 1


def test_an_unauthenticated_ninja_charge_is_refused_before_the_claim(example: Example) -> None:
    payload = {**PAYLOAD, "description": "anonymous ninja"}
    response = httpx.post(
        f"{example.url}/ninja/charges",
        json=payload,
        headers={"Idempotency-Key": str(uuid.uuid4())},
        timeout=30,
    )
    # ninja's session authentication refuses a cookie-less POST on its CSRF check (403).
    assert response.status_code in (401, 403)
    assert response.headers["Content-Type"] != "application/problem+json"
    assert example.count("payments_charge", "anonymous ninja") == 0
    assert example.count("payments_providercall", "anonymous ninja") == 0


def test_the_swagger_page_shows_the_key(example: Example) -> None:
    docs = httpx.get(f"{example.url}/ninja/docs", timeout=30)
    assert docs.status_code == 200
    assert "/static/ninja/swagger-ui-bundle.js" in docs.text  # served here, not from a CDN
    schema = httpx.get(f"{example.url}/ninja/openapi.json", timeout=30).json()
    create = schema["paths"]["/ninja/charges"]["post"]
    (header,) = [p for p in create["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["in"] == "header"
    assert header["required"] is True
    assert {"201", "400", "409", "422", "503"} <= set(create["responses"])
    assert "Idempotent-Replayed" in create["responses"]["201"]["headers"]
    assert "parameters" not in schema["paths"]["/ninja/charges"]["get"] or not [
        p
        for p in schema["paths"]["/ninja/charges"]["get"]["parameters"]
        if p["name"] == "Idempotency-Key"
    ]
