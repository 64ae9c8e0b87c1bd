"""A pytest run in two halves, side by side.

``python -m tests.halves NAME COMMAND [ARGS...]`` runs ``COMMAND`` twice at once, with
``TEST_SHARD=1/2`` and ``TEST_SHARD=2/2`` in its environment (``tests/conftest.py`` then keeps
the test files of that half); ``PARTS=3`` in the environment runs it three times, in thirds.
Each part writes to ``$REPORTS/pytest-NAME-K.log`` (``REPORTS`` defaults to
``.venv/reports``); when all are done, their logs are printed, then each part's closing
line. The exit status is 1 when any part failed.

A suite on a database server spends much of its time waiting (on the server, on the
workers and processes it starts, on leases running out). In ``make test`` beside the SQLite
run, the two PostgreSQL halves took 366 and 449 s on a 2-core machine. When the cores are
already busy (CI's group of side-by-side steps) halves save little: each half of the
MariaDB and PostgreSQL 16 suites then took about as long as the whole run had.
``make test`` runs its PostgreSQL suite this way, and ``make test-mysql`` and
``make test-pg16`` theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.live import ROOT


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m tests.halves NAME COMMAND [ARGS...]", file=sys.stderr)
        return 2
    name, command = argv[0], argv[1:]
    reports = Path(os.environ.get("REPORTS", ROOT / ".venv" / "reports"))
    reports.mkdir(parents=True, exist_ok=True)
    parts = int(os.environ.get("PARTS", "2"))
    runs: list[tuple[Path, subprocess.Popen[bytes]]] = []
    for part in range(1, parts + 1):
        log = reports / f"pytest-{name}-{part}.log"
        with log.open("wb") as out:
            env = {**os.environ, "TEST_SHARD": f"{part}/{parts}"}
            runs.append((log, subprocess.Popen(command, stdout=out, stderr=out, env=env)))
    failed = [process.wait() != 0 for _, process in runs]
    for log, _ in runs:
        print(f"==> pytest run {log.stem.removeprefix('pytest-')}", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    for log, _ in runs:
        lines = log.read_text(errors="replace").splitlines() or [""]
        print(f"  {log.stem.removeprefix('pytest-') + ':':<14} {lines[-1]}")
    sys.stdout.flush()
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
