"""The threads the engine runs on for attempts that no request's thread serves: an ``async
def`` tool's call, an ``async def`` task's delivery (``_http.run_to_the_end(own_thread=True)``).

Never a thread of the event loop's default executor, which the body's own
``asyncio.to_thread`` (or a DNS lookup) waits for, and which as many engines waiting for
their bodies would fill for good: each attempt has a thread to itself while it runs, and a
thread is made whenever none is free, so none waits for another. A thread
is kept for the next attempt of its event loop once its own has ended, with the database
connections ``CONN_MAX_AGE`` lets it keep, as a server's thread keeps them from one request
to the next: before and after each attempt, connections past their age or unusable are
closed (given back to Django's pool where ``OPTIONS["pool"]`` sets one), as Django does at
a request's start and end. A thread idle for ``IDLE_SECONDS`` ends; every thread of a loop
ends, its connections closed, when the loop shuts down (``asyncio.run``, ``anyio.run``, a
server stopping), or within ``POLL_SECONDS`` of the loop's stopping where nothing shut it
down (``loop.run_until_complete`` returned, the loop closed or left open; nothing runs on
it until it runs again, and then on new threads): nothing of the calls stays on the
database server after them, and nothing here keeps an ended loop in memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django import db

from django_idempotency._autonomous import close_unused_connections

__all__ = ["IDLE_SECONDS", "of_the_running_loop", "watched"]

logger = logging.getLogger("django_idempotency")

#: How long a thread with no attempt waits for the next one before it ends.
IDLE_SECONDS = 10.0

#: How often an idle thread looks whether its event loop still runs.
POLL_SECONDS = 0.1

#: Each event loop's threads, made when the loop's first attempt needs one.
_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Threads] = weakref.WeakKeyDictionary()
_LOOPS_LOCK = threading.Lock()


async def of_the_running_loop() -> concurrent.futures.Executor:
    """The running event loop's threads (made, and tied to the loop's end, on first use)."""
    loop = asyncio.get_running_loop()
    with _LOOPS_LOCK:
        # A loop closed without its shutdown (no shutdown_asyncgens) is let go of here: its
        # threads have ended or are ending (_Thread.run), and the watch below refers to it.
        for other in [other for other in _LOOPS if other.is_closed()]:
            _LOOPS.pop(other).shutdown(wait=False)
        threads = _LOOPS.get(loop)
        if threads is not None and not threads.ended:
            return threads
        threads = _LOOPS[loop] = _Threads(loop)
    # An async generator that the loop's shutdown closes (asyncio.run and anyio.run call
    # shutdown_asyncgens, as servers do when they stop): its finally ends the threads.
    threads.watch = _until_the_loop_ends(loop, threads)
    await threads.watch.asend(None)
    return threads


async def _until_the_loop_ends(
    loop: asyncio.AbstractEventLoop, threads: _Threads
) -> AsyncIterator[None]:
    try:
        yield
    finally:
        threads.shutdown()
        # The generator's finalizer (the loop's own hook) refers to the loop: the entry
        # goes, else the loop would never be freed.
        with _LOOPS_LOCK:
            if _LOOPS.get(loop) is threads:
                del _LOOPS[loop]


class _Threads(concurrent.futures.Executor):
    """One event loop's engine threads: an idle one runs the next attempt, or a new one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)
        self.lock = threading.Lock()
        self.idle: list[_Thread] = []
        self.ended = False
        self.watch: Any = None  # the loop's shutdown closes it (of_the_running_loop)

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            thread = self.idle.pop() if self.idle and not self.ended else None
        if thread is None:
            thread = _Thread(self)
        thread.jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End the idle threads now, each closing its connections, and the busy ones when
        their attempts end."""
        with self.lock:
            self.ended = True
            idle, self.idle = self.idle, []
        for thread in idle:
            thread.jobs.put(None)
        if wait:
            for thread in idle:
                thread.join(IDLE_SECONDS)

    def stopped(self) -> bool:
        """Whether the loop no longer runs (stopped, closed or gone), shut down or not."""
        loop = self.loop()
        return loop is None or not loop.is_running()

    def retire(self, thread: _Thread) -> bool:
        """Whether ``thread``, idle for long enough, may end: no attempt has taken it."""
        with self.lock:
            if thread in self.idle:
                self.idle.remove(thread)
                return True
            return self.ended

    def release(self, thread: _Thread) -> bool:
        """``thread``'s attempt has ended: kept for the next, or ``False`` to end it."""
        with self.lock:
            if self.ended or self.stopped():
                return False
            self.idle.append(thread)
            return True


class _Thread(threading.Thread):
    def __init__(self, threads: _Threads) -> None:
        super().__init__(name="django-idempotency", daemon=True)
        self.threads = threads
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        try:
            idle_until = time.monotonic() + IDLE_SECONDS
            while True:
                try:
                    job = self.jobs.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if time.monotonic() < idle_until and not self.threads.stopped():
                        continue
                    if self.threads.retire(self):
                        return
                    continue  # an attempt took this thread as it was ending: its job comes
                if job is None:
                    return
                future, fn, args, kwargs = job
                del job
                if not future.set_running_or_notify_cancel():
                    kept = self.threads.release(self)
                else:
                    failed: BaseException | None = None
                    try:
                        # As Django does at a request's start and end: connections past
                        # CONN_MAX_AGE, or unusable, are closed (given back to the pool).
                        close_unused_connections()
                        result = fn(*args, **kwargs)
                    except BaseException as exc:
                        failed, result = exc, None
                    try:
                        close_unused_connections()
                    except Exception:
                        logger.exception("an engine thread could not close its connections")
                        kept = False  # it ends, closing them
                    else:
                        # Kept (or told to end) before its caller hears the outcome: a loop
                        # that shuts down once it has every answer finds it idle, to end now.
                        kept = self.threads.release(self)
                    if failed is None:
                        future.set_result(result)
                    else:
                        future.set_exception(failed)
                    del failed, result
                del future, fn, args, kwargs  # nothing of the attempt outlives it here
                if not kept:
                    return
                idle_until = time.monotonic() + IDLE_SECONDS
        finally:
            db.connections.close_all()


#: The bodies running on a loop for an engine thread that waits for them (``watched``).
_BODIES: set[asyncio.Task[Any]] = set()
_BODIES_LOCK = threading.Lock()
_WATCHING: list[threading.Thread] = []  # the one thread that looks at their loops, if any


def watched(func: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """``func``, an ``async def`` body that an engine thread runs on the caller's loop
    (``async_to_sync``) and waits for, watched while it runs: were its loop closed with the
    body still awaiting on it (``loop.run_until_complete`` given up on the call, then
    ``loop.close()``), nothing would ever run it again, and its engine thread would wait
    for good in an open transaction holding the record's row. The body is then cancelled
    where it awaits, on the watching thread, and its attempt ends as a crash ends it."""

    @functools.wraps(func)
    async def body(*args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        if task is None:
            return await func(*args, **kwargs)
        with _BODIES_LOCK:
            _BODIES.add(task)
            if not _WATCHING:
                _WATCHING.append(
                    threading.Thread(target=_watch, name="django-idempotency", daemon=True)
                )
                _WATCHING[0].start()
        try:
            return await func(*args, **kwargs)
        finally:
            with _BODIES_LOCK:
                _BODIES.discard(task)

    return body


def _watch() -> None:
    while True:
        time.sleep(POLL_SECONDS)
        with _BODIES_LOCK:
            if not _BODIES:
                _WATCHING.clear()
                return
            ended = [task for task in _BODIES if task.get_loop().is_closed()]
            _BODIES.difference_update(ended)
        for task in ended:
            _cancel_on_a_closed_loop(task)


def _cancel_on_a_closed_loop(task: asyncio.Task[Any]) -> None:
    """Cancel ``task``, whose loop has closed (so nothing else runs its coroutine), where it
    awaits: asgiref's wrapper hands the ``CancelledError`` to the engine thread."""
    coroutine: Any = task.get_coro()
    logger.warning(
        "the event loop of a protected async call closed while its body still ran: the "
        "attempt ends as a crash would end it"
    )
    try:
        coroutine.throw(asyncio.CancelledError())
    except BaseException:  # it ended (asgiref's wrapper returns): the engine has its error
        return
    # Its cleanup awaited again, on the closed loop: end it there.
    try:
        coroutine.close()
    except RuntimeError:
        logger.exception("the body of a protected async call could not be ended")
