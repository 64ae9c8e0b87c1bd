"""How the client guide's ``create_charge`` is used."""

from __future__ import annotations

from typing import Any

import httpx

from example_project.client import create_charge


def pay(base_url: str) -> Any:
    # --8<-- [start:usage]
    with httpx.Client(base_url=base_url, auth=("demo", "demo"), timeout=10) as api:
        charge = create_charge(api, 1000, "EUR", "order 1234").json()
    # --8<-- [end:usage]
    return charge
