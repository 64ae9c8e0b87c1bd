"""A ride booking that dies after its charge, resumed by its retry, and what it did.

Start the example server (with ``DEBUG`` on, as ``make demo`` runs it), then::

    python -m example_project.demo_steps --url http://127.0.0.1:8000 --user demo --password demo

``POST /api/rides/`` is an operation in three steps (``recovery="resume"``): create the ride
(a local write), charge it at the fake provider with ``downstream_key("charge")``, mail its
receipt (a mail service takes no key). The script books one ride with
``X-Demo-Crash: after-charge``: the booking dies inside its charge step, after the provider
charged and the ride was updated, before the step is recorded. Then it retries with the same
key, as a client whose request failed would: ``409`` while the dead attempt's lease runs (3
seconds on this endpoint), then the retry takes the lease over and resumes: the ride step is
skipped (recorded), the charge step runs again (its local update was rolled back; the
provider gets the same key and charges nothing more), the receipt is mailed. A last retry
gets the stored answer, byte for byte.

How it dies. A killed process would take the development server with it (one process serves
every request, in threads), so the request ends as a crash does without killing the server:
the view raises ``django_idempotency.exceptions.SimulatedCrash``, a ``BaseException`` that no
handler of Django or DRF catches. The engine leaves the claim held, exactly as a SIGKILL
would (the step's transaction rolls back, nothing is released or recorded), and the
development server's WSGI handler answers ``500`` with a plain-text "A server error
occurred" (another server may drop the connection instead: both count as the crash here).
The example project honours ``X-Demo-Crash`` only with ``DEBUG`` on
(``example_project/payments/demo.py``): never in production.

Finally it counts, through the ORM (run it with the server's settings, e.g. the same
``EXAMPLE_DB``), the rides, provider calls and charges, and mails of this booking. Exit status
0 when the ride was created once, the provider charged once (called twice, with one key), the
receipt was mailed once and the replay was the first answer's bytes; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from example_project.demo_storm import Answer, Api, client_arguments, connect, report

RIDES = "/api/rides/"
CRASH = {"X-Demo-Crash": "after-charge"}
NO_ANSWER = Answer(status=0, body=b"", replayed=False, retry_after=None)


@dataclass(frozen=True)
class Effects:
    """What the booking left: rides, the provider's calls and charges, mails, steps."""

    rides: int
    provider_calls: int
    provider_keys: int
    provider_charges: int
    mails: int
    steps: list[str]
    charge_on_ride: str


def effects(key: str, target: str) -> Effects:
    """Counted through the ORM, in the server's database."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    import django

    django.setup()
    from django_idempotency.models import IdempotencyStep
    from example_project.payments.models import ProviderCall, ProviderCharge, Ride, SentMail

    rides = list(Ride.objects.filter(target=target).values_list("pk", "provider_charge_id"))
    described = [f"ride {pk}" for pk, _ in rides]
    calls = ProviderCall.objects.filter(description__in=described)
    steps = IdempotencyStep.objects.filter(record__operation="ride.book", record__key=key)
    return Effects(
        rides=len(rides),
        provider_calls=calls.count(),
        provider_keys=len(set(calls.values_list("key", flat=True))),
        provider_charges=ProviderCharge.objects.filter(description__in=described).count(),
        mails=SentMail.objects.filter(subject__endswith=f" to {target}").count(),
        steps=list(steps.order_by("created_at", "pk").values_list("name", flat=True)),
        charge_on_ride=rides[0][1] if rides else "",
    )


def attempt(api: Api, payload: Any, key: str, extra: dict[str, str] | None = None) -> Answer:
    """One booking request; ``NO_ANSWER`` when the server dropped the connection."""
    try:
        return api.request("POST", RIDES, payload, key, extra)
    except OSError:
        return NO_ANSWER


def retry(api: Api, payload: Any, key: str, retry_for: float) -> tuple[Answer, int]:
    """Retry as a client would: after each 409's ``Retry-After``, bounded; the last answer
    and how many requests it took."""
    deadline = time.monotonic() + retry_for
    answer, sent = attempt(api, payload, key), 1
    while answer.status in (0, 409) and time.monotonic() < deadline:
        pause = answer.retry_after if answer.retry_after is not None else 1.0
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        answer, sent = attempt(api, payload, key), sent + 1
    return answer, sent


def problems_with(
    crashed: Answer, after_crash: Effects, final: Answer, replay: Answer, done: Effects
) -> list[str]:
    """Every way in which the booking broke the promise; empty when it kept it."""
    found = []
    if crashed.status not in (0, 500):
        found.append(f"the crashing request got {crashed.status}, not a 500 or a dropped line")
    if (after_crash.rides, after_crash.mails, after_crash.steps) != (1, 0, ["ride"]):
        found.append(f"the crash did not stop inside the charge step: {after_crash}")
    if final.status != 201 or final.replayed:
        found.append(f"the retry got {final.status} (replayed: {final.replayed}), not a fresh 201")
    if replay.status != 201 or not replay.replayed or replay.body != final.body:
        found.append("the last retry was not the stored answer, byte for byte")
    for name, count in (("rides", done.rides), ("provider charges", done.provider_charges)):
        if count != 1:
            found.append(f"{count} {name} instead of exactly one")
    if (done.provider_calls, done.provider_keys) != (2, 1):
        found.append(
            f"the provider was called {done.provider_calls} times with {done.provider_keys} "
            "keys, not twice with one (the crash came inside the charge step)"
        )
    if done.mails != 1:
        found.append(f"{done.mails} receipts mailed instead of exactly one")
    if done.steps != ["ride", "charge", "receipt"]:
        found.append(f"the recorded steps are {done.steps}")
    if final.status == 201 and json.loads(final.body)["charge"] != done.charge_on_ride:
        found.append("the ride does not carry the charge the answer names")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    client_arguments(parser)
    parser.add_argument(
        "--retry-for", type=float, default=30, help="seconds the retry keeps at 409s (30)"
    )
    args = parser.parse_args(argv)

    api = connect(args)
    key = str(uuid.uuid4())
    target = f"demo steps {key[:8]}"
    payload = {"origin": "Dock 1", "target": target, "amount": 2400, "currency": "EUR"}

    crashed = attempt(api, payload, key, CRASH)
    after_crash = effects(key, target)
    began = time.monotonic()
    final, sent = retry(api, payload, key, args.retry_for)
    waited = time.monotonic() - began
    replay = attempt(api, payload, key)
    done = effects(key, target)

    print()
    print(f"Steps that resume: POST {RIDES}, Idempotency-Key {key}")
    print(f"  dies after the charge  {crashed.status or 'no answer'} (X-Demo-Crash: after-charge)")
    print(
        f"  left by the crash      {after_crash.rides} ride, {after_crash.provider_calls} "
        f"provider call, {after_crash.mails} mails, steps recorded: "
        f"{', '.join(after_crash.steps) or 'none'}"
    )
    print(f"  the retry              {final.status} after {sent} requests, {waited:.1f} s")
    print(f"  {final.body.decode(errors='replace')}")
    print(f"  the last retry         {replay.status} (replayed: {replay.replayed})")
    print(f"  rides                  {done.rides}")
    print(f"  provider calls         {done.provider_calls} (keys: {done.provider_keys})")
    print(f"  provider charges       {done.provider_charges}")
    print(f"  receipts mailed        {done.mails}")
    print(f"  steps recorded         {', '.join(done.steps)}")
    return report(
        problems_with(crashed, after_crash, final, replay, done),
        "one ride, one charge (the provider called twice with one key), one receipt, "
        "the same 201 replayed byte for byte.",
    )


if __name__ == "__main__":
    sys.exit(main())
