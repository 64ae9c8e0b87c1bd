"""An ``@idempotent_tool`` called as a plain function, outside any server's request.

A script, a management command or a unit test of the tool calls it directly: there is no
call context (no ``_meta``, no registered name, no principal), so the key comes from the
tool's ``idempotency_key`` argument and the account from ``account=``; the tool still runs
once per key, under either framework. Also: what the fingerprint makes of arguments JSON
has no single spelling for (infinities, dates), and a tool's answer that cannot be stored.
Effects are counted as ``Charge`` rows.
"""

from __future__ import annotations

import datetime
import threading
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, InputRequiredResult, TextContent

from django_idempotency import _tools
from django_idempotency import fastmcp as fastmcp_adapter
from django_idempotency import mcp as mcp_adapter
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import in_thread, new_key, postgres_only, watching_polls
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 30
ADAPTERS = {"mcp": mcp_adapter, "fastmcp": fastmcp_adapter}


def charged(account: str) -> int:
    return Charge.objects.filter(account=account).count()


def structured(result: Any) -> dict[str, Any]:
    content: dict[str, Any] = result.structured_content
    return content


def replayed(result: Any) -> bool:
    return bool((result.meta or {}).get("idempotentReplayed"))


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request: pytest.FixtureRequest) -> Any:
    return ADAPTERS[request.param]


def test_a_direct_call_runs_once_per_key(adapter):
    @adapter.idempotent_tool(account="ops")
    def refund(order: str, amount: float, idempotency_key: str) -> dict[str, Any]:
        Charge.objects.create(account="direct", amount=int(amount), currency="EUR")
        return {"order": order}

    key = new_key()
    first = refund(order="o-1", amount=5.0, idempotency_key=key)
    assert (first.is_error, structured(first), replayed(first)) == (False, {"order": "o-1"}, False)
    # 5 and 5.0 are one amount: the retry replays.
    again = refund(order="o-1", amount=5, idempotency_key=key)
    assert (structured(again), replayed(again)) == ({"order": "o-1"}, True)
    other = refund(order="o-2", amount=5.0, idempotency_key=key)
    assert (other.is_error, structured(other)["code"]) == (True, "idempotency_key_reused")
    assert charged("direct") == 1
    (record,) = IdempotencyRecord.objects.all()
    assert (record.account, record.operation) == ("ops", "tool:refund")


@pytest.mark.parametrize(
    ("value", "same", "different"),
    [
        (float("inf"), float("inf"), float("-inf")),
        (Decimal("Infinity"), Decimal("Infinity"), Decimal("-Infinity")),
        (Decimal("1.50"), Decimal("1.5"), Decimal("1.51")),
        ((1, 2.0), [1, 2], [2, 1]),
        (datetime.date(2026, 12, 6), datetime.date(2026, 12, 6), datetime.date(2026, 12, 7)),
    ],
)
def test_arguments_json_spells_many_ways_are_one_fingerprint(value, same, different):
    @mcp_adapter.idempotent_tool(account="ops")
    def book(when: Any, idempotency_key: str) -> str:
        Charge.objects.create(account="booked", amount=1, currency="EUR")
        return "booked"

    key = new_key()
    assert not book(when=value, idempotency_key=key).is_error
    assert replayed(book(when=same, idempotency_key=key))
    refused = book(when=different, idempotency_key=key)
    assert structured(refused)["code"] == "idempotency_key_reused"
    assert charged("booked") == 1


def test_a_context_outside_a_request_names_no_tool_and_carries_no_key():
    @mcp_adapter.idempotent_tool(account="ops")
    def ship(order: str, ctx: Context) -> str:
        Charge.objects.create(account="shipped", amount=1, currency="EUR")
        return order

    @mcp_adapter.idempotent_tool(account="ops")
    def pack(order: str) -> str:
        Charge.objects.create(account="shipped", amount=1, currency="EUR")
        return order

    for refused in (ship(order="o-1", ctx=Context()), pack(order="o-1")):
        assert refused.is_error
        assert structured(refused)["code"] == "idempotency_key_missing"
    assert "tool:ship" in structured(ship(order="o-1", ctx=Context()))["detail"]
    assert (charged("shipped"), IdempotencyRecord.objects.count()) == (0, 0)


def test_an_answer_that_asks_for_input_is_handed_back_and_rolled_back():
    """A round of MCP's multi-round flow is no outcome of the call (``docs/mcp.md``): the
    question is answered as the body gave it, nothing is stored, and the next round with
    the key runs again."""
    asked = InputRequiredResult(request_state="asked once")

    @mcp_adapter.idempotent_tool(account="ops")
    def ask(idempotency_key: str) -> Any:
        Charge.objects.create(account="asked", amount=1, currency="EUR")
        return asked

    key = new_key()
    for _ in range(2):
        assert ask(idempotency_key=key) == asked
    # Each call ran, and its write went with it; no outcome was stored.
    assert charged("asked") == 0
    assert not IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).exists()


@pytest.mark.parametrize("account", ["", 7])
def test_an_account_option_that_is_no_account_is_refused_before_any_call(adapter, account):
    with pytest.raises(ImproperlyConfigured, match="account"):
        adapter.idempotent_tool(account=account)


@postgres_only  # two callers at once, each on a connection of its own
def test_a_duplicate_that_waits_runs_the_tool_once_the_first_attempt_failed():
    entered: list[str] = []
    started, go = threading.Event(), threading.Event()

    @mcp_adapter.idempotent_tool(account="ops", wait=timedelta(seconds=WAIT))
    def pay(idempotency_key: str) -> str:
        entered.append(threading.current_thread().name)
        if len(entered) == 1:
            started.set()
            assert go.wait(WAIT)
            raise ConnectionError("the provider hung up")
        Charge.objects.create(account="paid", amount=1, currency="EUR")
        return "paid"

    key = new_key()
    outcomes: dict[str, Any] = {}

    def call(name: str) -> None:
        try:
            outcomes[name] = pay(idempotency_key=key)
        except ConnectionError as exc:
            outcomes[name] = exc

    first = threading.Thread(target=in_thread(call), args=("first",), name="first")
    first.start()
    assert started.wait(WAIT)
    duplicate = threading.Thread(target=in_thread(call), args=("duplicate",), name="duplicate")
    with watching_polls() as polls:
        duplicate.start()
        polls.wait(timeout=WAIT)  # the duplicate is waiting on the first attempt's record
    go.set()
    for thread in (first, duplicate):
        thread.join(WAIT)
        assert not thread.is_alive()
    assert isinstance(outcomes["first"], ConnectionError)
    assert (outcomes["duplicate"].is_error, replayed(outcomes["duplicate"])) == (False, False)
    assert entered == ["first", "duplicate"]
    assert charged("paid") == 1
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


def test_a_tool_called_inside_the_callers_transaction_commits_with_it():
    @mcp_adapter.idempotent_tool(account="ops", recovery="retry")
    def note(text: str, idempotency_key: str) -> str:
        Charge.objects.create(account="noted", amount=1, currency="EUR")
        return text

    key = new_key()
    with transaction.atomic():
        assert not note(text="kept", idempotency_key=key).is_error
        # The caller's transaction and connection go on after the call.
        Charge.objects.create(account="caller", amount=1, currency="EUR")
    assert replayed(note(text="kept", idempotency_key=key))
    assert (charged("noted"), charged("caller")) == (1, 1)

    def caller_fails() -> None:
        with transaction.atomic():
            note(text="rolled back", idempotency_key=new_key())
            raise RuntimeError("the caller's work failed")

    with pytest.raises(RuntimeError):
        caller_fails()
    assert charged("noted") == 1


class Bare(_tools.Framework[CallToolResult]):
    """The least a new framework says: how a return value becomes its result, and that its
    results are the protocol's own. Everything else is the contract's defaults: no context,
    no registered name, no ``_meta``, no principal."""

    name = "Bare"

    def converter(self, func: Any) -> Any:
        return lambda context, value: CallToolResult(
            content=[TextContent(type="text", text=str(value))]
        )

    def sent(self, result: CallToolResult) -> CallToolResult:
        return result

    def received(self, result: Any) -> CallToolResult:
        return CallToolResult.model_validate(result.model_dump())


def bare_tool(**options: Any) -> Any:
    accepted = frozenset(mcp_adapter.ToolOptions.__optional_keys__)
    return _tools.protector(Bare(), options, "tests", accepted)


def test_a_framework_that_says_only_the_least_gets_the_whole_contract():
    @bare_tool(account="ops")
    def label(parcel: str, idempotency_key: str) -> str:
        Charge.objects.create(account="labelled", amount=1, currency="EUR")
        return f"label for {parcel}"

    key = new_key()
    first = label(parcel="p-1", idempotency_key=key)
    again = label(parcel="p-1", idempotency_key=key)
    assert first.content[0].text == again.content[0].text == "label for p-1"
    assert (replayed(first), replayed(again)) == (False, True)
    assert structured(label(parcel="p-2", idempotency_key=key))["code"] == "idempotency_key_reused"
    assert charged("labelled") == 1
    assert IdempotencyRecord.objects.get().operation == "tool:label"

    @bare_tool()
    def unscoped(idempotency_key: str) -> str:
        Charge.objects.create(account="unscoped", amount=1, currency="EUR")
        return "ran"

    # No principal: refused, nothing ran.
    refused = unscoped(idempotency_key=new_key())
    assert structured(refused)["code"] == "idempotency_account_missing"
    assert charged("unscoped") == 0
