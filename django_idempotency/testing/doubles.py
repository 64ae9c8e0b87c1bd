"""Side effects and queues: a provider that counts, and a message delivered twice."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Task


@dataclass(frozen=True)
class Call:
    """One call that reached a `FakeProvider`: its arguments, its key, and its answer."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str | None
    answer: Any


class FakeProvider:
    """A stand-in for an external API that honours idempotency keys, as payment providers
    do; it counts every call and every effect.

    Put it where the view calls the provider (``monkeypatch.setattr(payments, "charge",
    provider)``, ``unittest.mock.patch``). Each call is recorded in `calls`. A call whose
    ``key_argument`` (a keyword, ``idempotency_key`` by default, or a position: ``0`` for
    the first argument) carries a key already seen gets that key's first answer again; any
    other call makes a new effect, recorded in `effects`, whose answer is ``answer(n)`` for
    the n-th effect (by default ``{"id": "fake_<n>"}``). It lives in memory, so, like a
    remote system, it keeps what a database rollback undoes. Safe to call from a live
    server's threads.
    """

    def __init__(
        self,
        *,
        key_argument: str | int = "idempotency_key",
        answer: Callable[[int], Any] | None = None,
    ) -> None:
        self.key_argument = key_argument
        self.answer = answer or (lambda n: {"id": f"fake_{n}"})
        #: Every call, in order.
        self.calls: list[Call] = []
        #: The answer of every effect made, in order (repeated keys make none).
        self.effects: list[Any] = []
        self._by_key: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One call: the key's first answer, or a new effect's."""
        where = self.key_argument
        if isinstance(where, int):
            key = args[where] if len(args) > where else None
        else:
            key = kwargs.get(where)
        with self._lock:
            if key is not None and key in self._by_key:
                answer = self._by_key[key]
            else:
                answer = self.answer(len(self.effects) + 1)
                self.effects.append(answer)
                if key is not None:
                    self._by_key[key] = answer
            self.calls.append(Call(args, dict(kwargs), key, answer))
        return answer


def redeliver(
    task: Task[Any, Any],
    *args: Any,
    task_id: str | None = None,
    times: int = 2,
    **kwargs: Any,
) -> list[Any]:
    """Deliver one Celery message ``times`` times, as a broker does after a lost
    acknowledgement; returns each delivery's result.

    Each delivery runs the task in this process (``task.apply``) with the same task id
    (``task_id``, or a new one), which is what ``@idempotent_task()`` deduplicates by: its
    body runs once and later deliveries return the stored result. An outbox message is
    delivered with ``task_id=str(message.id)``, as the relay sends it. A delivery that
    raises fails the test with its exception.
    """
    if times < 1:
        raise ValueError(f"times must be at least 1, not {times}")
    task_id = task_id or str(uuid.uuid4())
    return [task.apply(args=args, kwargs=kwargs, task_id=task_id).get() for _ in range(times)]
