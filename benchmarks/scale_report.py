# ruff: noqa: RUF001 (the multiplication sign is printed into Markdown)
"""Render the "Scale" section of ``benchmarks/RESULTS.md`` from ``benchmarks.scale`` figures."""

from __future__ import annotations

from typing import Any


def _ms(value: float) -> str:
    return f"{value:.2f} ms"


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def _targets(figures: dict[str, Any]) -> list[str]:
    sizes = figures["sizes"]
    lines = ["| target | measured |  |", "|---|---|---|"]
    small, large = sizes[0], sizes[-1]
    for kind in ("claim", "replay"):
        ratio = large[kind]["p99_ms"] / small[kind]["p99_ms"]
        lines.append(
            f"| {kind} p99 at {large['rows']:,} rows within 1.5× of {small['rows']:,} "
            f"| {_ms(large[kind]['p99_ms'])} / {_ms(small[kind]['p99_ms'])} = {ratio:.2f}× "
            f"| {_met(ratio <= 1.5)} |"
        )
    purge = figures.get("purge")
    if purge:
        ratio = purge["claims_during_purge"]["p99_ms"] / purge["claims_no_purge"]["p99_ms"]
        ingest = large["first_requests_per_second"]
        lines += [
            f"| every purge batch ≤ 100 ms | longest {_ms(purge['longest_batch_ms'])}, "
            f"{purge['batches_over_100ms']} of {purge['batches']} over | "
            f"{_met(purge['longest_batch_ms'] <= 100)} |",
            f"| claim p99 during the purge ≤ 2× without | {ratio:.2f}× | {_met(ratio <= 2)} |",
            f"| purge ≥ 10× the ingest rate ({ingest:,.0f} first requests/s, one connection) "
            f"| {purge['rows_per_second']:,.0f} rows/s = "
            f"{purge['rows_per_second'] / ingest:.1f}× | "
            f"{_met(purge['rows_per_second'] >= 10 * ingest)} |",
        ]
    return lines


def _sizes(figures: dict[str, Any]) -> list[str]:
    lines = [
        "| rows | claim p50 | claim p99 | first request p50 | first request p99 "
        "| replay p50 | replay p99 | WAL per first request | fill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in figures["sizes"]:
        lines.append(
            f"| {size['rows']:,} | {_ms(size['claim']['p50_ms'])} | "
            f"{_ms(size['claim']['p99_ms'])} | {_ms(size['first_request']['p50_ms'])} | "
            f"{_ms(size['first_request']['p99_ms'])} | {_ms(size['replay']['p50_ms'])} | "
            f"{_ms(size['replay']['p99_ms'])} | {size['wal_bytes_per_first_request']:,.0f} B | "
            f"{size['fill_seconds']:.0f} s |"
        )
    lines += [
        "",
        "| rows | table | indexes | total | per million rows: table | indexes | total |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in figures["sizes"]:
        lines.append(
            f"| {size['rows']:,} | {size['table_mb']:,.1f} MiB | {size['indexes_mb']:,.1f} MiB | "
            f"{size['total_mb']:,.1f} MiB | {size['table_mb_per_million']:,.0f} MiB | "
            f"{size['indexes_mb_per_million']:,.0f} MiB | {size['total_mb_per_million']:,.0f} MiB |"
        )
    largest = figures["sizes"][-1]
    lines += ["", f"Each index at {largest['rows']:,} rows, per million rows:", ""]
    lines += ["| index | MiB per million rows |", "|---|---|"]
    for name, mb in sorted(largest["index_mb_per_million"].items()):
        lines.append(f"| `{name}` | {mb:,.1f} |")
    return lines


def _purge(purge: dict[str, Any]) -> list[str]:
    before, after = purge["table_before"], purge["table_after_purge"]
    watched = purge["table_watched"]
    last = watched[-1] if watched else after
    vacuumed = last["autovacuums"] > after["autovacuums"]
    settings = ", ".join(f"`{k}` = {v}" for k, v in sorted(purge["autovacuum_settings"].items()))
    return [
        f"{purge['deleted']:,} expired records deleted from {purge['rows']:,} in "
        f"{purge['batches']:,} batches (ceiling {purge['batch_size']:,} rows) in "
        f"{purge['purge_seconds']:.1f} s: **{purge['rows_per_second']:,.0f} rows/s**, batch "
        f"p50 {_ms(purge['batch_p50_ms'])}, p99 {_ms(purge['batch_p99_ms'])}, longest "
        f"{_ms(purge['longest_batch_ms'])}; {purge['wal_mb']:,.0f} MiB of WAL (the whole "
        "server's).",
        "",
        f"A claimer at {purge['claim_rate']:.0f} claims/s (each then completed) ran beside it:",
        "",
        "| | claims | p50 | p99 | max |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {s['n']} | {_ms(s['p50_ms'])} | {_ms(s['p99_ms'])} | {_ms(s['max_ms'])} |"
            for label, s in (
                ("no purge", purge["claims_no_purge"]),
                ("during the purge", purge["claims_during_purge"]),
            )
        ),
        "",
        f"Dead tuples: {before['dead']:,} before, {after['dead']:,} right after the purge "
        f"(live {after['live']:,}); "
        + (
            "autovacuum is **off** on this machine's server, so what it would do was not observed."
            if not purge["autovacuum"]
            else f"autovacuum ran at {last['last_autovacuum']} and left {last['dead']:,}."
            if vacuumed
            else f"autovacuum had not run {10 * len(watched)} s later ({last['dead']:,} dead)."
        )
        + f" A manual `VACUUM` then took {purge['vacuum_seconds']:.1f} s and left "
        f"{purge['table_after_vacuum']['dead']:,} dead tuples; the table stays "
        f"{purge['sizes_after_vacuum']['table_mb']:,.0f} MiB (its freed space is reused by "
        "new records, not returned to the disk).",
        f"Server settings: {settings}.",
    ]


def render(figures: dict[str, Any]) -> str:
    machine = figures["machine"]
    lines = [
        "## Scale",
        "",
        f"Written by `make bench-scale` (`{figures['command']}`) on {figures['date']} in "
        f"{figures['minutes']:.0f} minutes; PostgreSQL {machine['postgresql']}, Django "
        f"{machine['django']}, psycopg {machine['psycopg']}, {machine['cores']} cores. Load "
        f"average {machine['load_at_start']} at the start, {machine['load_at_end']} at the "
        "end (other engineers' suites share the machine). What is measured and how: the "
        "docstring of `benchmarks/scale.py`; what it means for a deployment: `docs/scaling.md`.",
        "",
        "### Targets",
        "",
        *_targets(figures),
        "",
        "### Latency and size by table size",
        "",
        *_sizes(figures),
    ]
    if figures.get("purge"):
        lines += ["", "### Purge beside live traffic", "", *_purge(figures["purge"])]
    return "\n".join(lines) + "\n"
