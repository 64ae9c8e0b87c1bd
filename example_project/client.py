"""A client of the example payments API that retries safely (the client guide's snippet)."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import httpx


def problem_code(response: httpx.Response) -> Any:
    """django-idempotency's ``code`` of a problem+json answer, else ``None``."""
    if response.headers.get("Content-Type", "").startswith("application/problem+json"):
        return response.json().get("code")
    return None


class ChargeError(Exception):
    """The API refused the charge, or its outcome is unknown: see ``response`` and ``code``."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"{response.status_code} {response.text}")
        self.response = response
        self.code = problem_code(response)


def create_charge(
    client: httpx.Client,
    amount: int,
    currency: str,
    description: str = "",
    *,
    key: str | None = None,
    attempts: int = 5,
    backoff: float = 0.5,
) -> httpx.Response:
    """Charge once, however many attempts it takes; returns the charge's one answer.

    ``client`` holds the base URL, the credentials and the timeout. The key is made here,
    when the user acts, and every retry reuses it; pass ``key`` to go on with an operation
    after a restart (store the key with the order before the first attempt).
    """
    key = key or str(uuid.uuid4())
    payload = {"amount": amount, "currency": currency, "description": description}
    attempt = 0
    while True:
        attempt += 1
        wait = backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
        try:
            response = client.post("/api/charges/", json=payload, headers={"Idempotency-Key": key})
        except httpx.TransportError:
            # Timed out or cut off: the charge may or may not exist. A retry with the same
            # key finds out, and never charges twice.
            if attempt == attempts:
                raise
            time.sleep(wait)
            continue
        if response.is_success:
            return response  # the first answer, or its replay (Idempotent-Replayed: true)
        code = problem_code(response)
        # 409: still running elsewhere. 429, 502-504, a 500 of the view: nothing was kept
        # (but a 503 idempotency_record_unreadable: the answer is kept, unreadable for now).
        retry = response.status_code in (409, 429, 502, 503, 504) or (
            response.status_code == 500 and code is None
        )
        if not retry or attempt == attempts:
            # 400/422 of ours: a bug here. Another 4xx: the final answer, replayed to
            # every retry. 500 idempotency_outcome_unknown: reconcile by hand.
            raise ChargeError(response)
        retry_after = response.headers.get("Retry-After", "")
        time.sleep(float(retry_after) if retry_after.isdigit() else wait)
