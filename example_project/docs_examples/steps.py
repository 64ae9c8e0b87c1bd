"""Steps shown in the documentation (docs/steps.md): a queue consumer that ships each line of
an order once, whatever the redeliveries and crashes."""

from __future__ import annotations

from typing import Any


class Carrier:
    """A stand-in for a carrier's API, which takes no idempotency key: it keeps every call."""

    def __init__(self) -> None:
        self.shipped: list[tuple[int, str]] = []
        self.notified: list[int] = []

    def ship(self, order_id: int, line: dict[str, Any]) -> dict[str, Any]:
        self.shipped.append((order_id, line["sku"]))
        return {"parcel": f"P-{order_id}-{line['id']}", "sku": line["sku"]}

    def notify(self, order_id: int, parcels: list[dict[str, Any]]) -> bool:
        self.notified.append(order_id)
        return True


carrier = Carrier()


# --8<-- [start:ship-lines]
from django_idempotency import run_once, step


def handle_order_message(order_id: int, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """A queue consumer: a redelivery after a crash ships only what was not shipped yet."""
    return run_once(
        ship_lines,
        order_id,
        lines,
        account="consumer:shipping",
        operation="orders.ship",
        key=f"order:{order_id}",
        recovery="resume",
    )


def ship_lines(order_id: int, lines: list[dict[str, Any]]) -> dict[str, Any]:
    # One step per line, each named after its line: names are unique within an operation.
    parcels = [step(f"ship:{line['id']}", carrier.ship, order_id, line) for line in lines]
    step("notify", carrier.notify, order_id, parcels)
    return {"order": order_id, "parcels": [parcel["parcel"] for parcel in parcels]}


# --8<-- [end:ship-lines]
