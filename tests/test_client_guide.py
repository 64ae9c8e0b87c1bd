"""The client guide's retry code (``example_project/client.py``): the guide shows this
file, and it charges once against a real server of the example project, whatever
the retries; its retry decisions, answer by answer, against a mock transport."""

from __future__ import annotations

from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
client_module = pytest.importorskip(
    "example_project.client", reason="the example project is not here (tox tests the wheel)"
)

from example_project.client import ChargeError, create_charge  # noqa: E402
from tests.helpers import Example  # noqa: E402
from tests.live import ROOT  # noqa: E402

GUIDE = ROOT / "docs" / "client.md"
CLIENT = ROOT / "example_project" / "client.py"

# The impatient client gives up sooner than the example's fake provider answers
# (PROVIDER_LATENCY).
IMPATIENT = 0.3


def test_the_guide_shows_the_tested_code() -> None:
    guide = GUIDE.read_text()
    # The page holds the file itself, whole, under the comment naming it (tests/docs_code.py).
    assert f"<!-- code: example_project/client.py -->\n```python\n{CLIENT.read_text()}```" in guide


# --- against the example project -------------------------------------------------------------


def api(
    example: Example, timeout: float, sent: list[Any], answered: list[int] | None = None
) -> Any:
    """A client as an application would make one; ``sent`` collects every request, and
    ``answered`` the status of every answer."""
    hooks: dict[str, list[Any]] = {"request": [sent.append], "response": []}
    if answered is not None:
        hooks["response"].append(lambda response: answered.append(response.status_code))
    return httpx.Client(
        base_url=example.url, auth=("demo", "demo"), timeout=timeout, event_hooks=hooks
    )


def test_a_timed_out_charge_is_retried_into_its_replay(example: Example) -> None:
    # The first attempt gives up while the provider is still busy, the server carries on;
    # the retries with the same key get a 409 (with Retry-After) and then the replay.
    sent: list[Any] = []
    answered: list[int] = []
    with api(example, timeout=IMPATIENT, sent=sent, answered=answered) as client:
        response = create_charge(client, 1250, "EUR", "timed out", backoff=0.1)
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "true"
    assert response.json()["amount"] == 1250
    # The first attempt got no answer; then at least one 409, and the replay last.
    assert len(sent) == len(answered) + 1
    assert answered[0] == 409
    assert answered[-1] == 201
    assert len({request.headers["Idempotency-Key"] for request in sent}) == 1
    assert example.count("payments_charge", "timed out") == 1
    assert example.count("payments_providercall", "timed out") == 1


def test_a_charge_that_answers_in_time_is_not_retried(example: Example) -> None:
    sent: list[Any] = []
    with api(example, timeout=30, sent=sent) as client:
        response = create_charge(client, 990, "EUR", "in time")
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response.headers
    assert response.headers["Location"].endswith(f"/api/charges/{response.json()['id']}/")
    assert len(sent) == 1
    assert example.count("payments_charge", "in time") == 1


def test_a_key_reused_for_another_charge_is_a_bug_not_a_retry(example: Example) -> None:
    sent: list[Any] = []
    with api(example, timeout=30, sent=sent) as client:
        create_charge(client, 100, "EUR", "reused", key="order-1234-payment")
        with pytest.raises(ChargeError) as refused:
            create_charge(client, 200, "EUR", "reused", key="order-1234-payment")
    assert refused.value.response.status_code == 422
    assert refused.value.code == "idempotency_key_reused"
    assert len(sent) == 2
    assert example.count("payments_charge", "reused") == 1


def test_a_refused_charge_is_final(example: Example) -> None:
    sent: list[Any] = []
    with api(example, timeout=30, sent=sent) as client, pytest.raises(ChargeError) as refused:
        create_charge(client, 100, "eur", "refused")
    assert refused.value.response.status_code == 400
    assert refused.value.code is None  # the view's validation error, not ours
    assert "currency" in refused.value.response.json()
    assert len(sent) == 1


# --- every answer, one by one, against a mock transport ---------------------------------------


def problem(status: int, code: str, retry_after: int | None = None) -> Any:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return httpx.Response(
        status,
        json={"type": f"urn:django-idempotency:{code}", "status": status, "code": code},
        headers={"Content-Type": "application/problem+json", **headers},
    )


CREATED = httpx.Response(201, json={"id": 1})


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", waits.append)
    return waits


def scripted(*answers: Any) -> tuple[Any, list[Any]]:
    """A client whose server gives ``answers`` in turn (an exception is raised instead)."""
    sent: list[Any] = []
    queue = list(answers)

    def handler(request: Any) -> Any:
        sent.append(request)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    transport = httpx.MockTransport(handler)
    return httpx.Client(base_url="http://api.test", transport=transport), sent


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(problem(409, "idempotency_key_in_use", retry_after=2), id="409-in-use"),
        pytest.param(problem(409, "idempotency_lease_lost", retry_after=2), id="409-lease-lost"),
        pytest.param(problem(503, "idempotency_store_unavailable", 2), id="503-store"),
        pytest.param(httpx.Response(429, headers={"Retry-After": "2"}), id="429"),
    ],
)
def test_a_transient_answer_is_retried_after_retry_after(first: Any, slept: list[float]) -> None:
    client, sent = scripted(first, CREATED)
    assert create_charge(client, 1, "EUR").status_code == 201
    assert slept == [2.0]
    assert sent[0].headers["Idempotency-Key"] == sent[1].headers["Idempotency-Key"]


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(httpx.ReadTimeout("slow"), id="timeout"),
        pytest.param(httpx.ConnectError("refused"), id="connect-error"),
        pytest.param(httpx.Response(500, text="Server Error"), id="500-of-the-view"),
        pytest.param(httpx.Response(502, text="Bad Gateway"), id="502"),
    ],
)
def test_a_lost_or_released_attempt_is_retried_with_backoff(first: Any, slept: list[float]) -> None:
    client, sent = scripted(first, CREATED)
    assert create_charge(client, 1, "EUR", backoff=1.0).status_code == 201
    assert len(slept) == 1
    assert 0.5 <= slept[0] <= 1.5
    assert sent[0].headers["Idempotency-Key"] == sent[1].headers["Idempotency-Key"]


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        (problem(400, "idempotency_key_missing"), "idempotency_key_missing"),
        (problem(400, "idempotency_key_invalid"), "idempotency_key_invalid"),
        (problem(422, "idempotency_key_reused"), "idempotency_key_reused"),
        (problem(500, "idempotency_outcome_unknown"), "idempotency_outcome_unknown"),
        (problem(500, "idempotency_response_not_storable"), "idempotency_response_not_storable"),
        (httpx.Response(400, json={"amount": ["bad"]}), None),
        (httpx.Response(402, json={"detail": "card declined"}), None),
    ],
)
def test_a_final_answer_is_raised_at_once(
    answer: Any, code: str | None, slept: list[float]
) -> None:
    client, sent = scripted(answer)
    with pytest.raises(ChargeError) as raised:
        create_charge(client, 1, "EUR")
    assert raised.value.code == code
    assert len(sent) == 1
    assert slept == []


def test_attempts_are_bounded(slept: list[float]) -> None:
    client, sent = scripted(*[httpx.ReadTimeout("slow")] * 3)
    with pytest.raises(httpx.ReadTimeout):
        create_charge(client, 1, "EUR", attempts=3, backoff=0.1)
    assert len(sent) == 3
    assert len({request.headers["Idempotency-Key"] for request in sent}) == 1
    # Exponential backoff with jitter: about 0.1, then about 0.2.
    assert len(slept) == 2
    assert 0.05 <= slept[0] <= 0.15
    assert 0.1 <= slept[1] <= 0.3

    client, sent = scripted(*[problem(409, "idempotency_key_in_use", 1)] * 3)
    with pytest.raises(ChargeError) as raised:
        create_charge(client, 1, "EUR", attempts=3)
    assert raised.value.code == "idempotency_key_in_use"
    assert len(sent) == 3


def test_a_key_made_earlier_is_used(slept: list[float]) -> None:
    client, sent = scripted(CREATED)
    create_charge(client, 1, "EUR", key="order-77-payment")
    assert sent[0].headers["Idempotency-Key"] == "order-77-payment"
