"""A progress line for runs whose output goes to logs, so that ``make test`` is never silent.

``python -m tests.progress [--every SECONDS] LOG...`` prints, every ``SECONDS`` (default 30),
one line: the time since it started and, for each log, pytest's latest percentage (or the
log's last line, cut short). It runs until it is stopped (``make test`` stops it when the
runs are done).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

_PERCENT = re.compile(rb"\[\s*(\d+%)\]")


def state(log: Path) -> str:
    """Where the run writing ``log`` is: its latest ``[ NN%]``, else its last line."""
    try:
        with log.open("rb") as file:
            file.seek(0, 2)
            size = file.tell()
            file.seek(max(0, size - 4096))
            tail = file.read()
    except FileNotFoundError:
        return "not started"
    found = _PERCENT.findall(tail)
    if found:
        return found[-1].decode()
    lines = tail.decode(errors="replace").strip().splitlines()
    return lines[-1][:40] if lines else "started"


def main(argv: list[str]) -> int:
    every = 30.0
    if argv[:1] == ["--every"]:
        every, argv = float(argv[1]), argv[2:]
    logs = [Path(name) for name in argv]
    started = time.monotonic()
    while True:
        time.sleep(every)
        minutes, seconds = divmod(int(time.monotonic() - started), 60)
        parts = "  ".join(f"{log.stem.removeprefix('pytest-')}: {state(log)}" for log in logs)
        print(f"    {minutes:3d}:{seconds:02d}  {parts}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
