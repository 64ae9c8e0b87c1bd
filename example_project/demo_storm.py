"""A storm of retries against the example payments API, and what it did to the money.

Start the example server, then::

    python -m example_project.demo_storm --url http://127.0.0.1:8000 --user demo --password demo

It plays a client whose charge timed out and that retries from many places at once: N
concurrent ``POST /api/charges/`` with one ``Idempotency-Key`` and one body. The first request
runs; the ones that arrive while it is in flight get a prompt ``409`` with ``Retry-After``
and come back after it (bounded by ``--retry-for``); later ones get the replay. Then it sends
the same key with a changed amount, which must be refused with ``422``.

Finally it reads the example project's database through the ORM (so run it with the server's
settings, e.g. the same ``EXAMPLE_DB``) and counts the provider calls, provider charges and
local charges made for this operation. Exit status 0 when there is exactly one of each charge
and every request ended with the same ``201``; 1 otherwise.

It logs in once with ``--user``/``--password`` (a session, like a browser or an app); pass
``--basic`` to send HTTP Basic credentials on every request instead, which is slower because
every request then checks a password hash. Only the standard library talks to the server:
threads and ``http.client``.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlencode, urlsplit

CHARGES = "/api/charges/"


@dataclass(frozen=True)
class Answer:
    """What the server said to one request."""

    status: int
    body: bytes
    replayed: bool
    retry_after: float | None

    @property
    def code(self) -> str:
        """The problem+json ``code`` of an error answer, or ``""``."""
        try:
            return str(json.loads(self.body).get("code", ""))
        except (ValueError, AttributeError):
            return ""


@dataclass(frozen=True)
class Outcome:
    """One storm request: its first answer, its last answer and how many tries it took."""

    first: Answer
    final: Answer
    attempts: int


class Api:
    """A tiny JSON client, one connection per request.

    It logs in once through the session login form, as a browser or an app would, and sends
    the session cookie and CSRF token from then on: checking a password hash on every request
    (HTTP Basic) would take longer than the storm itself. ``basic=True`` sends Basic
    credentials with every request instead.
    """

    def __init__(self, url: str, user: str, password: str, basic: bool = False) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise SystemExit(f"--url must look like http://HOST:PORT, not {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.user = user
        self.password = password
        self.basic = basic
        self.cookies: dict[str, str] = {}

    def send(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[http.client.HTTPResponse, bytes]:
        headers = dict(headers)
        if self.basic:
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
            if "csrftoken" in self.cookies:
                headers["X-CSRFToken"] = self.cookies["csrftoken"]
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            connection.request(method, self.prefix + path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        return response, data

    def login(self) -> None:
        """Log in through DRF's login form (``/api-auth/login/``) and keep the cookies."""
        if self.basic:
            return
        path = "/api-auth/login/"
        response, _ = self.send("GET", path, None, {})
        self.keep_cookies(response)
        form = urlencode(
            {
                "username": self.user,
                "password": self.password,
                "csrfmiddlewaretoken": self.cookies.get("csrftoken", ""),
                "next": CHARGES,
            }
        ).encode()
        response, _ = self.send(
            "POST", path, form, {"Content-Type": "application/x-www-form-urlencoded"}
        )
        self.keep_cookies(response)
        if response.status != 302 or "sessionid" not in self.cookies:
            raise SystemExit(f"could not log in as {self.user!r} (HTTP {response.status})")

    def keep_cookies(self, response: http.client.HTTPResponse) -> None:
        for header in response.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(header).items():
                self.cookies[name] = morsel.value

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        key: str | None = None,
        extra: dict[str, str] | None = None,
    ) -> Answer:
        headers = {"Accept": "application/json", **(extra or {})}
        body = None
        if payload is not None:
            body = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if key is not None:
            headers["Idempotency-Key"] = key
        response, data = self.send(method, path, body, headers)
        retry_after = response.getheader("Retry-After")
        return Answer(
            status=response.status,
            body=data,
            replayed=response.getheader("Idempotent-Replayed") == "true",
            retry_after=float(retry_after) if retry_after else None,
        )


def wait_for_server(api: Api, seconds: float) -> None:
    """Poll until the server answers at all (any status), or give up after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            api.request("GET", CHARGES)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"no server answered on {api.host}:{api.port}") from None
            time.sleep(0.2)


def one_request(
    api: Api, start: threading.Barrier, payload: Any, key: str, retry_for: float
) -> Outcome:
    """Fire with the others, then come back after each 409's ``Retry-After``, bounded."""
    start.wait()
    first = final = api.request("POST", CHARGES, payload, key)
    attempts = 1
    deadline = time.monotonic() + retry_for
    while final.status == 409 and time.monotonic() < deadline:
        pause = final.retry_after if final.retry_after is not None else 1.0
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        final = api.request("POST", CHARGES, payload, key)
        attempts += 1
    return Outcome(first, final, attempts)


def storm(api: Api, count: int, payload: Any, key: str, retry_for: float) -> list[Outcome]:
    """``count`` concurrent requests with one key and one body, released together."""
    start = threading.Barrier(count)
    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [
            pool.submit(one_request, api, start, payload, key, retry_for) for _ in range(count)
        ]
        return [future.result() for future in futures]


def tally(answers: Iterable[Answer]) -> str:
    """``201 x1, 409 x15 (replayed: 0)``."""
    answers = list(answers)
    counts = Counter(answer.status for answer in answers)
    statuses = ", ".join(f"{status} x{n}" for status, n in sorted(counts.items()))
    replayed = sum(answer.replayed for answer in answers)
    return f"{statuses} (replayed: {replayed})"


def ledger(description: str) -> dict[str, int]:
    """What the provider and the local database hold for this operation, read via the ORM."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    import django

    django.setup()
    from django_idempotency.models import OutboxMessage
    from example_project.payments.models import Charge, ProviderCall, ProviderCharge

    charges = list(Charge.objects.filter(description=description).values_list("pk", flat=True))
    receipts = OutboxMessage.objects.filter(task="payments.send_receipt")
    return {
        "provider calls": ProviderCall.objects.filter(description=description).count(),
        "provider charges": ProviderCharge.objects.filter(description=description).count(),
        "local charges": len(charges),
        "receipts in outbox": sum(receipts.filter(args=[pk]).count() for pk in charges),
    }


def problems_with(outcomes: list[Outcome], mismatch: Answer, counts: dict[str, int]) -> list[str]:
    """Every way in which the run broke the promise; empty when it kept it."""
    found = []
    finals = [outcome.final for outcome in outcomes]
    if any(answer.status != 201 for answer in finals):
        found.append(f"not every request ended with 201: {tally(finals)}")
    if len({answer.body for answer in finals}) != 1:
        found.append("the 201 bodies differ between requests")
    originals = [answer for answer in finals if answer.status == 201 and not answer.replayed]
    if len(originals) != 1:
        found.append(f"{len(originals)} requests ran the view instead of exactly one")
    if mismatch.status != 422:
        found.append(f"the changed payload got {mismatch.status}, not 422")
    for name in ("provider charges", "local charges", "receipts in outbox"):
        if counts[name] != 1:
            found.append(f"{counts[name]} {name} instead of exactly one")
    # Nothing crashed and no lease ran out, so the view itself should have run once: more
    # provider calls mean duplicates got past the claim and only the provider's own
    # deduplication saved the money.
    if counts["provider calls"] != 1:
        found.append(f"the provider was called {counts['provider calls']} times, not once")
    return found


def client_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a demo that logs in to the example server: ``--url``, ``--user``,
    ``--password``, ``--wait``, ``--basic``."""
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--user", default="demo")
    parser.add_argument("--password", default="demo")
    parser.add_argument(
        "--wait", type=float, default=30, help="seconds to wait for the server to answer (30)"
    )
    parser.add_argument(
        "--basic", action="store_true", help="send HTTP Basic credentials on every request"
    )


def connect(args: argparse.Namespace) -> Api:
    """A client of the server ``args`` name, once the server answers, logged in."""
    api = Api(args.url, args.user, args.password, basic=args.basic)
    wait_for_server(api, args.wait)
    api.login()
    return api


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    client_arguments(parser)
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests (16)")
    parser.add_argument(
        "--retry-for", type=float, default=30, help="seconds a request keeps retrying 409s (30)"
    )
    args = parser.parse_args(argv)

    api = connect(args)
    key = str(uuid.uuid4())
    description = f"demo storm {key[:8]}"
    payload = {"amount": 1999, "currency": "EUR", "description": description}

    began = time.monotonic()
    outcomes = storm(api, args.requests, payload, key, args.retry_for)
    elapsed = time.monotonic() - began
    mismatch = api.request("POST", CHARGES, {**payload, "amount": 2999}, key)
    counts = ledger(description)

    sent = sum(outcome.attempts for outcome in outcomes) + 1
    print()
    print(f"Retry storm: {args.requests} concurrent POST {CHARGES}, Idempotency-Key {key}")
    print(f"  requests sent        {sent} ({args.requests} at once, 409s retried, 1 changed)")
    print(f"  first wave           {tally(o.first for o in outcomes)}")
    print(f"  final outcome        {tally(o.final for o in outcomes)} after {elapsed:.1f} s")
    print(f"  same key, new amount {mismatch.status} {mismatch.code}".rstrip())
    for name, value in counts.items():
        print(f"  {name:<20} {value}")
    found = problems_with(outcomes, mismatch, counts)
    return report(
        found,
        "one charge at the provider, one local charge, one receipt in the outbox, "
        "the same 201 for everyone.",
    )


def report(found: list[str], ok: str) -> int:
    """Print the problems found, or ``ok``; the exit status: 1 when a problem was found."""
    for problem in found:
        print(f"  PROBLEM: {problem}")
    if not found:
        print(f"  OK: {ok}")
    print()
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
