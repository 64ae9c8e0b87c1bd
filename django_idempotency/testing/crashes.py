"""Crashes and pauses at a point the test chooses: a call the view makes is patched to die
(or wait) right before or after it runs."""

from __future__ import annotations

import asyncio
import functools
import inspect
import pkgutil
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from django_idempotency.exceptions import SimulatedCrash


def crash() -> None:
    """End the running attempt as a killed process would: raise `SimulatedCrash`.

    Call it from a test double at the point where the process should die. The protected
    body's database work rolls back, and its claim stays in progress under its lease,
    never released: after `expire_lease`, the next retry meets the recovery policy
    (``"retry"``, ``"fail"``, a callable; resumable steps resume). Wrap the request in
    `expect_crash`.
    """
    raise SimulatedCrash("simulated crash")


@contextmanager
def expect_crash() -> Iterator[None]:
    """The block must end with a `SimulatedCrash`, which is swallowed, as a killed
    process ends its request: the test goes on with what the crash left behind."""
    try:
        yield
    except SimulatedCrash:
        return
    raise AssertionError("the block ended without the expected simulated crash")


def _owner_and_name(target: str) -> tuple[Any, str]:
    owner_name, dot, name = target.rpartition(".")
    if not dot:
        raise ValueError(f"{target!r} is not a dotted path such as 'myapp.payments.charge'")
    return pkgutil.resolve_name(owner_name), name


@contextmanager
def _wrapped(
    target: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    owner, name = _owner_and_name(target)
    wrapper: Any = wrap(getattr(owner, name))
    if isinstance(inspect.getattr_static(owner, name), (staticmethod, classmethod)):
        # getattr gave the function or the class's bound method: called as it is.
        wrapper = staticmethod(wrapper)
    with mock.patch.object(owner, name, wrapper):
        yield


@dataclass
class CrashPoint:
    """Where `crash_after` or `crash_before` ends the attempt, and what happened there."""

    target: str
    after: bool
    on_call: int
    #: How often the target was called in the block.
    calls: int = 0
    #: Whether the crash happened.
    crashed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _due(self) -> bool:
        with self._lock:
            self.calls += 1
            due = self.calls == self.on_call
            self.crashed = self.crashed or due
        return due

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(original):
            # An async target "returns" when its coroutine is done, not when it is made.
            @functools.wraps(original)
            async def crashing_async(*args: Any, **kwargs: Any) -> Any:
                due = self._due()
                if due and not self.after:
                    crash()
                result = await original(*args, **kwargs)
                if due:
                    crash()
                return result

            return crashing_async

        def crashing(*args: Any, **kwargs: Any) -> Any:
            due = self._due()
            if due and not self.after:
                crash()
            result = original(*args, **kwargs)
            if due:
                crash()
            return result

        return crashing

    def _missed(self) -> str:
        # Why no crash came out of the block.
        if self.crashed:
            return (
                f"the simulated crash at {self.target} was caught inside the block: "
                "something catches BaseException there, which a killed process never allows "
                "(a live server's handler does: crash requests of the test client)"
            )
        if not self.calls:
            return f"{self.target} was never called in the block, so nothing crashed"
        return f"{self.target} was called {self.calls} times, fewer than {self.on_call}"


@contextmanager
def _crash_point(target: str, *, after: bool, on_call: int) -> Iterator[CrashPoint]:
    if on_call < 1:
        raise ValueError(f"on_call counts calls from 1, not {on_call}")
    point = CrashPoint(target, after, on_call)
    with _wrapped(target, point._wrap):
        try:
            yield point
        except SimulatedCrash:
            if point.crashed:
                return
            raise
    raise AssertionError(point._missed())


def crash_after(target: str, *, on_call: int = 1) -> AbstractContextManager[CrashPoint]:
    """A context manager: the process "dies" right after ``target`` returns.

    ``target`` is the dotted path of what the view calls, as ``unittest.mock.patch`` takes
    it (``"myapp.payments.charge"``: patch it where the view looks it up). Within the
    block, its ``on_call``-th call runs and then raises `SimulatedCrash`: the external call
    happened, the view's database work rolls back, and the claim stays in progress under
    its lease. An ``async def`` target crashes once its coroutine has run to its end,
    when the view awaits it. The crash propagates out of the test client and is swallowed when it
    leaves the block; the test fails when no crash happened (the target was not called,
    or something caught the crash).

    For requests in the test's own thread (Django's or DRF's test client, ``run_once``,
    a task's ``apply()``); a live server's handler answers a crash with a 500 instead.
    Yields a `CrashPoint`.
    """
    return _crash_point(target, after=True, on_call=on_call)


def crash_before(target: str, *, on_call: int = 1) -> AbstractContextManager[CrashPoint]:
    """Like `crash_after`, but the process "dies" just before ``target`` is called: the
    external call never happened."""
    return _crash_point(target, after=False, on_call=on_call)


class Pause:
    """Holds the calls of a target until the test resumes them (see `pause_after`)."""

    def __init__(self, target: str, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        #: How often the target was called.
        self.calls = 0
        self._lock = threading.Lock()
        self._reached = threading.Event()
        self._resumed = threading.Event()

    def _returned(self) -> None:
        with self._lock:
            self.calls += 1
        self._reached.set()

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(original):
            # Held after its coroutine is done, without blocking the event loop.
            @functools.wraps(original)
            async def pausing_async(*args: Any, **kwargs: Any) -> Any:
                result = await original(*args, **kwargs)
                self._returned()
                await asyncio.to_thread(self._resumed.wait, self.timeout)
                return result

            return pausing_async

        def pausing(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._returned()
            self._resumed.wait(self.timeout)
            return result

        return pausing

    def wait(self, timeout: float = 10.0) -> None:
        """Wait (at most ``timeout`` seconds) until a call of the target has returned and
        is held; fails the test otherwise."""
        assert self._reached.wait(timeout), f"{self.target} was not called within {timeout} s"

    def resume(self) -> None:
        """Let every held call, and every later one, go on."""
        self._resumed.set()


@contextmanager
def pause_after(target: str, *, timeout: float = 10.0) -> Iterator[Pause]:
    """Hold each call of ``target`` right after it returns, until `Pause.resume` or the end
    of the block (never longer than ``timeout`` seconds).

    For a live server: the external call succeeded and the request is still running, so the
    test can give up waiting (``send(..., timeout=0.5)``), retry while the original holds
    its claim, and then let it finish. ``target`` is a dotted path as for `crash_after`;
    an ``async def`` target is held once awaited to its end, without blocking its event
    loop.
    """
    pause = Pause(target, timeout)
    with _wrapped(target, pause._wrap):
        try:
            yield pause
        finally:
            pause.resume()
