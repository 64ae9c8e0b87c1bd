"""cProfile of first requests and replays of the mixin, end to end, in one process.

``.venv/bin/python -m benchmarks.profile_hot_path [--requests N] [--top N] [--out DIR]``
on the PostgreSQL at 127.0.0.1 (the benchmark site's ``ours`` database). Prints, for each
kind of request, the functions by cumulative time per request, and writes the raw profiles
(``first.prof``, ``replay.prof``) for snakeviz or ``python -m pstats``. ``make bench`` runs the
same profiles inside its interleaved run; this script is for looking at one change quickly.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

from benchmarks import inprocess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/.results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    worker = inprocess.Worker("ours")
    worker.replay(200)  # warm: the replay pool, the statements' caches
    for kind, run in (("first", worker.create), ("replay", worker.replay)):
        profiler = cProfile.Profile()
        profiler.enable()
        run(args.requests)
        profiler.disable()
        profiler.dump_stats(args.out / f"{kind}.prof")
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(f"== {args.requests} {kind} requests ==")
        print(text.getvalue())


if __name__ == "__main__":
    main()
