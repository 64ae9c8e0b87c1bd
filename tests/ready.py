"""Ready files: the processes of a test say they are set up before the test counts on them.

A test that starts processes to race one another, or that asserts what each of them did,
must not release them after a fixed pause: on a loaded machine a process takes seconds to
import Django, and one that came late would run alone (the race not run, or its share of
the work done by the others). Each process says instead that it is ready, and the test waits
for all of them, bounded, before it gives the signal.

In a process (``tests/outbox_proc.py``, ``tests/tasks_proc.py``): :func:`ready_then_wait`
connects to the database, writes ``<go>.ready.<pid>`` and waits for the go file ``<go>``;
:func:`ready_on_connection` writes a file when a process it does not steer (``db_worker``)
first connects. In the test: :func:`release` waits for every process's ready file, then
writes the go file; :func:`wait_ready` waits for given files.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: How long a ready process waits for the go file: longer than any test waits for the
#: others to be ready, so that a test that gives the signal late still finds it waiting.
GO_WAIT = 180


def ready_file(go: Path, pid: int) -> Path:
    """The file that the process ``pid`` writes once it waits for ``go``."""
    return go.with_name(f"{go.name}.ready.{pid}")


# -- in a process ----------------------------------------------------------------------------------


def ready_then_wait(go: Path, using: str = "default") -> None:
    """Connect to the database ``using``, say so (:func:`ready_file`), then wait for ``go``.

    A process never released exits with an error rather than start on its own."""
    from django.db import connections

    connections[using].ensure_connection()
    ready_file(go, os.getpid()).touch()
    deadline = time.monotonic() + GO_WAIT
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"ready, but no go file {go} within {GO_WAIT} s")
        time.sleep(0.005)


def ready_on_connection(path: Path) -> None:
    """Write ``path`` when this process first connects to a database: for a command that
    the process runs as it is (``db_worker``), whose first query follows its connection."""
    from django.db.backends.signals import connection_created

    def connected(**kwargs: Any) -> None:
        connection_created.disconnect(connected)
        path.touch()

    connection_created.connect(connected, weak=False)


# -- in the test -----------------------------------------------------------------------------------


def wait_ready(files: Mapping[Path, subprocess.Popen[Any]], timeout: float) -> None:
    """Wait until each process has written its file; ``timeout`` seconds at most.

    Fails, with every process killed, when one of them ended first (its error output in
    the message) or when one is still not ready in time."""
    deadline = time.monotonic() + timeout
    while True:
        missing = {path: process for path, process in files.items() if not path.exists()}
        if not missing:
            return
        for process in missing.values():
            if process.poll() is not None:
                _stop(files.values())
                raise AssertionError(
                    f"{_named(process)} ended ({process.returncode}) before it was ready:\n"
                    f"{_errors(process)}"
                )
        if time.monotonic() > deadline:
            _stop(files.values())
            late = ", ".join(_named(process) for process in missing.values())
            raise AssertionError(
                f"{len(missing)} of {len(files)} processes not ready within {timeout} s: {late}"
            )
        time.sleep(0.02)


def release(go: Path, processes: Iterable[subprocess.Popen[Any]], timeout: float) -> None:
    """Write ``go`` once every process waits for it (:func:`ready_then_wait`)."""
    wait_ready({ready_file(go, process.pid): process for process in processes}, timeout)
    go.touch()


def _named(process: subprocess.Popen[Any]) -> str:
    args = process.args if isinstance(process.args, list) else [process.args]
    return f"process {process.pid} ({' '.join(map(str, args))[:160]})"


def _errors(process: subprocess.Popen[Any]) -> str:
    if process.stderr is None:
        return "(its error output is not captured)"
    try:
        _out, err = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return "(its error output did not end)"
    return err.decode(errors="replace") if isinstance(err, bytes) else str(err)


def _stop(processes: Iterable[subprocess.Popen[Any]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
