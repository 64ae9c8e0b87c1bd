"""Rides in the manner of Stripe's rocket-rides: ``POST /api/rides/`` creates a ride, charges
it through the fake provider and mails a receipt, each a step of one resumable operation.

A crash between the steps, or inside one, is resumed by the next retry with the same key:
the steps recorded are skipped (the ride is not created twice, the mail not sent twice), the
step that was running runs again (its local writes were rolled back; the provider, which it
may have reached, gets the same ``downstream_key``). The lease is short, so that the demo's
retry after a crash resumes within seconds.

The step functions take what they need as arguments rather than reading it back: a step's
result is all that a later attempt gets, and on SQLite a transaction that reads before the
provider's connection writes could not write afterwards.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import current, step
from django_idempotency.decorators import idempotent
from example_project.payments import demo, mailer, provider
from example_project.payments.models import Ride
from example_project.payments.views import INVALID

#: Seconds: a crashed booking is resumed by a retry this long after it began.
RIDE_LEASE = 3


class RideSerializer(serializers.ModelSerializer[Ride]):
    """What a booking asks for."""

    class Meta:
        model = Ride
        fields = ["origin", "target", "amount", "currency"]


class BookedRideSerializer(serializers.Serializer[Any]):
    """What a booking answers: the ride, the provider's charge and the receipt's mail."""

    ride = serializers.IntegerField()
    charge = serializers.CharField()
    receipt = serializers.IntegerField()


def create_ride(user_id: int, ride: dict[str, Any]) -> dict[str, Any]:
    """The first step: a local write."""
    return {"id": Ride.objects.create(user_id=user_id, **ride).pk}


def charge_ride(ride_id: int, amount: int, currency: str, *, key: str) -> dict[str, Any]:
    """The second step: the provider's charge (with a key, so a second call with the same
    key charges nothing more), then the ride's local update."""
    charge = provider.charge(
        key=key, amount=amount, currency=currency, description=f"ride {ride_id}"
    )
    Ride.objects.filter(pk=ride_id).update(provider_charge_id=charge.reference)
    demo.crash_point("after-charge")
    return {"id": charge.reference}


def send_receipt(recipient: str, ride: dict[str, Any], charge: dict[str, Any]) -> int:
    """The third step: a mail, which no key can make idempotent."""
    return mailer.send(
        recipient,
        f"Your ride: {ride['origin']} to {ride['target']}",
        f"We charged {ride['amount']} {ride['currency']} (reference {charge['id']}).",
    )


@extend_schema(request=RideSerializer, responses={201: BookedRideSerializer, 400: INVALID})
# --8<-- [start:book-ride]
@api_view(["POST"])
@idempotent(operation="ride.book", recovery="resume", lease=RIDE_LEASE)
def book_ride(request: Request) -> Response:
    """Book a ride: create it, charge it, mail its receipt; each step runs once per key."""
    booking = RideSerializer(data=request.data)
    booking.is_valid(raise_exception=True)
    wanted = booking.validated_data
    operation = current()
    assert operation is not None  # inside a protected view
    ride = step("ride", create_ride, request.user.pk, wanted)  # a local write
    charge = step(
        "charge",
        charge_ride,
        ride["id"],
        wanted["amount"],
        wanted["currency"],
        key=operation.downstream_key("charge"),  # the same on every attempt
    )
    email = request.user.email or "customer@example.com"
    receipt = step("receipt", send_receipt, email, wanted, charge)  # no key can dedupe a mail
    return Response(
        {"ride": ride["id"], "charge": charge["id"], "receipt": receipt},
        status=status.HTTP_201_CREATED,
    )
    # --8<-- [end:book-ride]
