"""Helpers for a project's own tests of its idempotent endpoints.

Happy-path tests prove little. These helpers make the tests that matter short: a retry that
must replay byte for byte, a key reused with another payload, two requests at the same
instant, a timeout after the provider answered, a process that dies midway, a lease or a
TTL that runs out, a key shared by two accounts, a queue that delivers twice. Each test
then counts the project's own side effects (rows, provider calls, e-mails), not statuses.

They work in pytest (with pytest-django's fixtures) and in Django's ``TestCase`` and
``TransactionTestCase`` alike: nothing here needs a fixture of its own. Requests go
through Django's or DRF's test client (in-process) or, for the races, through a live
server (pytest-django's ``live_server``, Django's ``LiveServerTestCase``), each request on
a connection of its own.

- Replays: `assert_idempotent`, `assert_replay`, `assert_problem`,
  `assert_accounts_isolated`.
- Races over HTTP: `storm`, `assert_single_execution`, `send`, `settle` (their options:
  `RequestOptions`), `login_headers`.
- Time, without sleeping: `expire_lease`, `expire_ttl`, `record_for`.
- Crashes and pauses at a point the test chooses: `crash_after`, `crash_before`, `crash`,
  `expect_crash`, `pause_after`.
- Side effects: `FakeProvider`; queues: `redeliver`.
"""

from __future__ import annotations

from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.testing.answers import (
    Answer,
    ReplayCheck,
    RequestClient,
    assert_accounts_isolated,
    assert_idempotent,
    assert_problem,
    assert_replay,
    new_key,
)
from django_idempotency.testing.crashes import (
    CrashPoint,
    Pause,
    crash,
    crash_after,
    crash_before,
    expect_crash,
    pause_after,
)
from django_idempotency.testing.doubles import (
    Call,
    FakeProvider,
    redeliver,
)
from django_idempotency.testing.live import (
    RequestOptions,
    assert_single_execution,
    login_headers,
    send,
    settle,
    storm,
)
from django_idempotency.testing.records import (
    expire_lease,
    expire_ttl,
    record_for,
)

__all__ = [
    "Answer",
    "Call",
    "CrashPoint",
    "FakeProvider",
    "Pause",
    "ReplayCheck",
    "RequestClient",
    "RequestOptions",
    "SimulatedCrash",
    "assert_accounts_isolated",
    "assert_idempotent",
    "assert_problem",
    "assert_replay",
    "assert_single_execution",
    "crash",
    "crash_after",
    "crash_before",
    "expect_crash",
    "expire_lease",
    "expire_ttl",
    "login_headers",
    "new_key",
    "pause_after",
    "record_for",
    "redeliver",
    "send",
    "settle",
    "storm",
]
