"""A MariaDB Galera Cluster of three nodes (tests/galera.py), an app server on each node.

Galera is multi-primary: two nodes may accept an insert of the same key at once, and the
one whose transaction is certified second is rolled back with error 1213 (a deadlock, as
InnoDB calls it). Storms send the 16 attempts of each key at once, split across the three
app servers (so across the three nodes), as clients behind a load balancer that retry a
``409``, a ``503`` and a lost connection, each time on the next server. Every answer seen
is counted: never a ``500``, every ``503`` with ``Retry-After``. Then the effects, read on
one node (``wsrep_sync_wait=1``: after every commit of the cluster): one local charge and
one provider charge per key, and, without a crash, one call to the provider per key.

Run by ``make test-galera`` (``RUN_GALERA=1``): about a minute, most of it the cluster's
start and the storms on two cores.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest

from tests import galera
from tests.helpers import FAULTS_CHARGE as CHARGE
from tests.helpers import RETRY_PATH, Caller, sleep_past_lease
from tests.live import Answer, gunicorn, request

pytestmark = [
    pytest.mark.servers,  # three mariadbd and three gunicorn
    pytest.mark.skipif(
        os.environ.get("RUN_GALERA") != "1", reason="make test-galera runs it (RUN_GALERA=1)"
    ),
]

KEYS, PER_KEY = 50, 16
#: Keys whose attempts are released together: a wave of 64 requests across three servers.
WAVE = 4
#: The view with the default lease (60 s): no attempt is taken over while it runs, so each
#: key calls the provider exactly once. The crash test uses RETRY_PATH (a 2 s lease).
LONG_LEASE_PATH = "/charges/tenant/"
#: How long one client keeps retrying one attempt.
CLIENT_PATIENCE = 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[galera.GaleraCluster]:
    assert galera.available(), "mariadbd, galera-4 and rsync are needed (Debian's packages)"
    with galera.galera_cluster() as running:
        yield running


@pytest.fixture(scope="module")
def servers(cluster: galera.GaleraCluster) -> Iterator[list[str]]:
    """One gunicorn (2 workers x 4 threads) per node."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(gunicorn(workers=2, threads=4, extra_env=node.server_env()))
            for node in cluster.nodes
        ]


class Seen:
    """Every answer of a storm, intermediate ones included."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.bad: list[str] = []

    def add(self, answer: Answer) -> None:
        with self.lock:
            self.statuses[answer.status] += 1
            if answer.status >= 500 and (
                answer.status != 503 or "retry-after" not in answer.headers
            ):
                self.bad.append(f"{answer.status} {answer.body[:300]!r}")


def attempt(urls: list[str], first: int, path: str, caller: Caller, seen: Seen) -> Answer:
    """One client's attempt, retried until its outcome is known: on the next server after a
    ``503`` or a lost connection, on the same after a ``409``."""
    index = first
    deadline = time.monotonic() + CLIENT_PATIENCE
    while time.monotonic() < deadline:
        answer = request(urls[index], "POST", path, CHARGE, caller.headers(), timeout=30)
        seen.add(answer)
        if answer.status not in (0, 409, 503):
            return answer
        if answer.status != 409:
            index = (index + 1) % len(urls)
        time.sleep(random.uniform(0.05, 0.2))
    raise AssertionError(f"no outcome for {caller} within {CLIENT_PATIENCE} s")


def storm(
    urls: list[str], path: str, during: Any = None
) -> tuple[dict[Caller, list[Answer]], Seen]:
    """KEYS callers, PER_KEY attempts each split across the servers, WAVE keys at a time
    released together; ``during(wave)`` runs beside each wave."""
    callers = [Caller.new() for _ in range(KEYS)]
    answers: dict[Caller, list[Answer]] = {caller: [] for caller in callers}
    seen = Seen()
    with ThreadPoolExecutor(max_workers=WAVE * PER_KEY) as pool:
        for wave, start in enumerate(range(0, KEYS, WAVE)):
            batch = callers[start : start + WAVE]
            barrier = threading.Barrier(len(batch) * PER_KEY, timeout=30)

            def one(
                caller: Caller, n: int, barrier: threading.Barrier = barrier
            ) -> tuple[Caller, Answer]:
                barrier.wait()
                return caller, attempt(urls, n % len(urls), path, caller, seen)

            futures = [pool.submit(one, c, n) for c in batch for n in range(PER_KEY)]
            if during is not None:
                during(wave)
            for future in futures:
                caller, answer = future.result(timeout=CLIENT_PATIENCE + 30)
                answers[caller].append(answer)
    return answers, seen


def effects(node: galera.Node, caller: Caller) -> tuple[int, int, int]:
    """(local charges, provider charges, provider calls) of one caller, read on ``node``."""
    conn = node.connect()
    try:
        cursor = conn.cursor()
        cursor.execute(
            "SELECT operation FROM django_idempotency_record WHERE account = %s", [caller.tenant]
        )
        downstream = caller.downstream_key(cursor.fetchone()[0])
        counts = []
        for sql, arg in (
            ("SELECT COUNT(*) FROM testapp_charge WHERE account = %s", caller.tenant),
            ("SELECT COUNT(*) FROM testapp_providercharge WHERE `key` = %s", downstream),
            ("SELECT COUNT(*) FROM testapp_providercall WHERE `key` = %s", downstream),
        ):
            cursor.execute(sql, [arg])
            counts.append(int(cursor.fetchone()[0]))
        return counts[0], counts[1], counts[2]
    finally:
        conn.close()


def in_progress(node: galera.Node) -> int:
    conn = node.connect()
    try:
        cursor = conn.cursor()
        cursor.execute(
            "SELECT COUNT(*) FROM django_idempotency_record WHERE status = 'in_progress'"
        )
        return int(cursor.fetchone()[0])
    finally:
        conn.close()


def judge(answers: dict[Caller, list[Answer]], seen: Seen) -> None:
    """Every key: PER_KEY answers of one outcome, one of them the original."""
    listing = ", ".join(f"{s} x{n}" for s, n in sorted(seen.statuses.items()))
    assert not seen.bad, f"{listing}; {seen.bad[:5]}"
    for caller, got in answers.items():
        assert len(got) == PER_KEY
        assert {a.status for a in got} == {201}, (caller, [a.status for a in got])
        assert len({json.loads(a.body)["id"] for a in got}) == 1, caller
        originals = [a for a in got if a.headers.get("idempotent-replayed") != "true"]
        assert len(originals) == 1, (caller, len(originals))
    print(f"\n{KEYS} keys x {PER_KEY} attempts over 3 nodes: every answer seen: {listing}")


def test_storms_split_across_the_nodes(cluster, servers):
    answers, seen = storm(servers, LONG_LEASE_PATH)
    judge(answers, seen)
    counting = cluster.nodes[0]
    for caller in answers:
        assert effects(counting, caller) == (1, 1, 1), caller
    assert in_progress(counting) == 0
    conflicts = {
        name: sum(int(node.status(f"wsrep_local_{name}") or 0) for node in cluster.nodes)
        for name in ("cert_failures", "bf_aborts")
    }
    print(f"certification conflicts on the nodes: {conflicts}")


def test_a_certification_conflict_at_the_completion(cluster, servers, tmp_path):
    """The original, on node 1, has run its view and its fenced completion, and waits before
    its COMMIT past its 2 s lease; a retry on node 2 takes the record over and commits
    first. Galera aborts the original's transaction (its commit fails with error 1213):
    the original answers 503 with Retry-After, its work rolled back; the retry's outcome is
    the one stored and replayed. One local charge, one provider charge."""
    caller = Caller.new()
    reached, go = tmp_path / "reached", tmp_path / "go"
    with ThreadPoolExecutor(max_workers=1) as pool:
        original = pool.submit(
            request,
            servers[0],
            "POST",
            RETRY_PATH,
            CHARGE,
            caller.headers(f"touch-completion:{reached},wait-completion:{go}"),
            30,
        )
        # Not a fixed pause from the start: a loaded node may take seconds to get there, and
        # a retry sent before would be the one to claim.
        deadline = time.monotonic() + 30
        while not reached.exists():
            assert time.monotonic() < deadline, "the original never ran its completion"
            time.sleep(0.02)
        sleep_past_lease()  # claimed before its completion: its lease has run out
        seen = Seen()
        taken_over = attempt(servers, 1, RETRY_PATH, caller, seen)
        go.touch()
        first = original.result(timeout=40)
    assert taken_over.status == 201, taken_over.body[:300]
    assert first.status == 503, (first.status, first.body[:300])
    assert "retry-after" in first.headers
    assert first.json()["code"] == "idempotency_store_unavailable"
    replay = attempt(servers, 0, RETRY_PATH, caller, seen)
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.body == taken_over.body
    assert not seen.bad, seen.bad
    charges, provider_charges, provider_calls = effects(cluster.nodes[0], caller)
    assert (charges, provider_charges, provider_calls) == (1, 1, 2)
    assert cluster.nodes[0].status("wsrep_local_bf_aborts") != "0"


def test_a_node_killed_mid_storm(cluster, servers):
    """Node 3 is SIGKILLed 0.3 s into the fourth wave, its app server left running (it
    answers 503 until a client moves on). A claim or a completion in flight there is lost or
    committed whole: a key whose original died with its node is taken over after its 2 s
    lease and runs again ("retry"), its local charge and its provider charge still one."""
    victim = cluster.nodes[2]

    def kill_in_wave_four(wave: int) -> None:
        if wave == 3:
            threading.Timer(0.3, victim.kill).start()

    answers, seen = storm(servers, RETRY_PATH, during=kill_in_wave_four)
    assert victim.process is not None
    assert victim.process.poll() is not None, "never killed"
    judge(answers, seen)
    counting = cluster.nodes[0]
    calls: Counter[int] = Counter()
    for caller in answers:
        charges, provider_charges, provider_calls = effects(counting, caller)
        assert (charges, provider_charges) == (1, 1), caller
        calls[provider_calls] += 1
    assert in_progress(counting) == 0
    print(f"provider calls per key: {dict(calls)}")
