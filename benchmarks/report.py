# ruff: noqa: RUF001 (the multiplication sign and the en dash are printed into Markdown)
"""Render ``benchmarks/RESULTS.md`` from the figures ``run.py`` collected."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Any

LABELS = {
    "plain": "plain DRF, no idempotency",
    "floor": "the floor: claim and completion by hand",
    "ours": "django-idempotency (IdempotencyMixin)",
    "unprepared": "django-idempotency, prepared statements off (Django's default)",
    "sealed": "django-idempotency, ENCRYPTION_KEYS set",
    "patched": "django-idempotency + proposed cuts",
    "dik": "django-idempotency-key 1.3.0",
    "dfi": "drf-idempotency 1.0.0",
}
EXPERIMENTS = Path(__file__).resolve().parent / "EXPERIMENTS.md"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(value: float) -> str:
    return f"{value:.2f} ms"


def ratio(value: float) -> str:
    return f"{value:.2f}×"


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if values else "–"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def statement_kind(sql: str) -> str:
    """A short name for one statement: ``claim``, ``INSERT benchsite_charge``, ``BEGIN``..."""
    text = sql.strip().rstrip(";")
    upper = text.upper()
    if upper.startswith("WITH LIVE AS"):
        return "claim (read, or INSERT … ON CONFLICT DO UPDATE … RETURNING)"
    if upper.startswith("WITH CLAIM AS"):
        return "claim (INSERT … ON CONFLICT DO NOTHING RETURNING, or the row in the way)"
    if upper.startswith("SELECT * FROM DJANGO_IDEMPOTENCY_RECORD_CLAIM("):
        return "claim (the same statement in its function, planned once per connection)"
    if upper.startswith("UPDATE") and ("COMPLETED_AT" in upper or "'COMPLETED'" in upper):
        return "fenced completion UPDATE"
    for word in ("BEGIN", "COMMIT", "ROLLBACK", "RELEASE SAVEPOINT", "SAVEPOINT"):
        if upper.startswith(word):
            return word
    verb = upper.split(None, 1)[0] if upper else "?"
    pattern = {
        "SELECT": r'FROM\s+"?(\w+)',
        "INSERT": r'INTO\s+"?(\w+)',
        "DELETE": r'FROM\s+"?(\w+)',
    }
    match = re.search(pattern.get(verb, r'^\w+\s+"?(\w+)'), text, re.IGNORECASE)
    return f"{verb} {match.group(1)}" if match else verb


def describe(statements: list[str], times: list[float]) -> str:
    """Each statement's short name and its median round trip in milliseconds."""
    named = [f"{statement_kind(s)} {t:.2f}" for s, t in zip(statements, times, strict=False)]
    return ", ".join(named) or "none"


def render(results: dict[str, Any]) -> str:
    out: list[str] = []
    add = out.append
    if results.get("patched_label"):
        LABELS["patched"] = results["patched_label"]
    machine, versions = results["machine"], results["versions"]
    add("# Benchmark results\n")
    add(
        f"Written by `make bench` (`{results['command']}`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(results.get('finished_at')))} in "
        f"{results['seconds'] / 60:.1f} minutes."
        + (
            " **Quick mode: a smoke run, too short to judge by.**"
            if results["plan"]["quick"]
            else ""
        )
    )
    if results.get("patched"):
        add(
            f'\n"{LABELS["patched"]}" is the mixin with `django_idempotency` imported from '
            f"`{results['patched']}` (a scratch copy of another version of the package)."
        )
    # A path, not a link: the docs site includes this file, where README.md is not a page.
    add("\nSee `benchmarks/README.md` for what each part measures and how.\n")
    add("## Machine and versions\n")
    main, alt = versions["main"], versions.get("alternatives") or {}
    rows = [
        ["cores", machine["cores"]],
        ["CPU", machine["cpu"]],
        ["memory", machine["memory"]],
        ["OS", machine["os"]],
        ["Python", main["Python"]],
        ["Django", main["Django"]],
        ["Django REST framework", main["djangorestframework"]],
        ["psycopg", main["psycopg"]],
        ["PostgreSQL", main["PostgreSQL"]],
        ["gunicorn", main["gunicorn"]],
        ["load generator", results.get("load_generator", "?")],
    ]
    rows += [[tool, version] for tool, version in versions.get("tools", {}).items()]
    if alt:
        rows.append(
            [
                "alternatives' venv",
                ", ".join(f"{name} {version}" for name, version in alt.items()),
            ]
        )
    add(table(["", ""], rows))
    add(
        f"\n**Noise.** Load average {fmt_load(machine['load_average_start'])} at the start and "
        f"{fmt_load(machine['load_average_end'])} at the end, on {machine['cores']} cores that "
        "other engineers' test suites share with this run. Absolute figures move with that "
        "load; the ratios are taken within one interleaved run (every round runs every "
        "variant, in a rotating order), and each table shows how far the per-round ratios "
        "spread."
    )
    for variant, why in results.get("skipped", {}).items():
        add(f"\n**{LABELS[variant]} skipped:** {why}.")
    add("\n## Targets\n")
    add(targets(results))
    if "inprocess" in results:
        add(inprocess(results["inprocess"], results["plan"]))
        if "sealed.create" in results["inprocess"]["median_ms"]:
            add(encryption(results["inprocess"], results["plan"], results["machine"]))
        add(sql(results["inprocess"]["sql"]))
        if {"ours", "floor"} <= set(results["inprocess"]["sql"]):
            add(statements(results["inprocess"]["sql"]))
        if results["inprocess"].get("writes"):
            add(writes_section(results["inprocess"]["writes"]))
    if "server" in results:
        add(server(results["server"], results["plan"]))
        add(storm(results["server"]["storm"], results["plan"]))
    if "purge" in results:
        add(purge(results["purge"], results["plan"]))
    if results.get("outbox", {}).get("throughput"):
        add(outbox(results["outbox"]))
    if results.get("steps"):
        add(steps(results["steps"]))
    if results.get("connections"):
        add(connections(results["connections"]))
    if results.get("tasks"):
        add(tasks_relay(results["tasks"]))
    if results.get("entries"):
        add(entries(results["entries"]))
    if "inprocess" in results and results["inprocess"].get("profiles"):
        add(profiles(results["inprocess"]["profiles"]))
    if EXPERIMENTS.exists():
        add("\n" + EXPERIMENTS.read_text().strip())
    return "\n".join(out).rstrip() + "\n"


def fmt_load(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values) + " (1/5/15 min)"


def _inprocess_ratios(data: dict[str, Any]) -> dict[str, float]:
    med = data["median_ms"]
    base = med.get("plain.create")
    if not base:
        return {}
    return {name: value / base for name, value in med.items()}


def _server_ratio(runs: dict[str, list[dict[str, Any]]], name: str, key: str) -> list[float]:
    base = runs.get("plain.create", [])
    mine = runs.get(name, [])
    return [m[key] / b[key] for m, b in zip(mine, base, strict=False) if b[key]]


def _median_writes(batches: list[dict[str, Any]], key: str) -> float:
    return statistics.median(b[key] for b in batches)


def hot_ratio(batches: list[dict[str, Any]], table_name: str) -> float | None:
    """HOT updates / updates of ``table_name`` over every batch; ``None`` without updates."""
    updates = sum(b["tables"].get(table_name, {}).get("updates", 0) for b in batches)
    hot = sum(b["tables"].get(table_name, {}).get("hot_updates", 0) for b in batches)
    return hot / updates if updates else None


def targets(results: dict[str, Any]) -> str:
    rows = []
    if "inprocess" in results and "ours.create" in results["inprocess"]["median_ms"]:
        ratios = _inprocess_ratios(results["inprocess"])
        first = ratios.get("ours.create", float("nan"))
        rows.append(
            [
                "first request median latency ≤ 1.4× plain (in-process; stretch 1.3×)",
                ratio(first),
                verdict(first <= 1.4) + (" (stretch met)" if first <= 1.3 else ""),
            ]
        )
        replay = ratios.get("ours.replay", float("nan"))
        rows.append(
            [
                "replay median latency ≤ 0.7× a plain create (in-process)",
                ratio(replay),
                verdict(replay <= 0.7),
            ]
        )
        noop = ratios.get("plain.noop", float("nan"))
        rows.append(
            [
                "replay within 0.2× (of a plain create) of the authenticated no-op",
                f"{ratio(replay)} vs {ratio(noop)}: {replay - noop:+.2f}",
                verdict(replay - noop <= 0.2),
            ]
        )
    if "inprocess" in results:
        rows += floor_targets_inprocess(results["inprocess"])
    writes = results.get("inprocess", {}).get("writes", {})
    if "ours" in writes:
        ours = writes["ours"]
        hot = hot_ratio(ours["create"], "django_idempotency_record")
        rows.append(
            [
                "HOT ratio of the completions ≥ 0.9 (PostgreSQL)",
                "no updates" if hot is None else f"{hot:.2f}",
                verdict(hot is not None and hot >= 0.9),
            ]
        )
        replay_wal = _median_writes(ours["replay"], "wal_bytes_per_request")
        rows.append(["no WAL per replay", f"{replay_wal:.0f} bytes", verdict(replay_wal == 0)])
        if "patched" in writes:
            mine = _median_writes(ours["create"], "wal_bytes_per_request")
            before = _median_writes(writes["patched"]["create"], "wal_bytes_per_request")
            rows.append(
                [
                    f"WAL per first request lower than {LABELS['patched']}'s (median of batches)",
                    f"{mine:.0f} vs {before:.0f} bytes",
                    verdict(mine < before),
                ]
            )
    if "server" in results:
        runs = results["server"]["runs"]
        through = _server_ratio(runs, "ours.create", "rps")
        if through:
            value = statistics.median(through)
            rows.append(
                [
                    "first request throughput ≥ 0.75× plain (real server; stretch 0.8×)",
                    ratio(value),
                    verdict(value >= 0.75) + (" (stretch met)" if value >= 0.8 else ""),
                ]
            )
        versus = _floor_ratios(runs, "ours.create", "rps")
        if versus:
            value = statistics.median(versus)
            rows.append(
                [
                    "first request throughput ≥ 0.9× the floor (real server)",
                    f"{ratio(value)} ({spread(versus)})",
                    verdict(value >= 0.9),
                ]
            )
        ours = results["server"]["storm"].get("ours")
        if ours:
            effects = ours["side_effects"]
            exact = sum(1 for e in effects if e == 1)
            rows.append(
                [
                    "storm: exactly one side effect per key, every round",
                    f"{exact}/{len(effects)} rounds with exactly 1 (max {max(effects)})",
                    verdict(exact == len(effects)),
                ]
            )
    if results.get("purge"):
        p = next(p for p in results["purge"] if p.get("variant", "ours") == "ours")
        rows.append(
            [
                f"purge ≥ 50,000 rows/s (batches of {p['batch_size']})",
                f"{p['rows_per_second']:,.0f} rows/s",
                verdict(p["rows_per_second"] >= 50_000),
            ]
        )
        rows.append(
            [
                "purge: no batch longer than 100 ms",
                ms(p["longest_batch_ms"]),
                verdict(p["longest_batch_ms"] <= 100),
            ]
        )
        claim = p["claims_during_purge"]["all"]["p99_ms"] / p["claims_no_purge"]["all"]["p99_ms"]
        rows.append(
            ["purge: concurrent claim p99 within 2× of no purge", ratio(claim), verdict(claim <= 2)]
        )
    if results.get("outbox", {}).get("throughput"):
        rows += outbox_targets(results["outbox"])
    if results.get("steps"):
        rows.append(steps_target(results["steps"]))
    if results.get("connections"):
        rows += connections_targets(results["connections"])
    if results.get("tasks"):
        rows += tasks_targets(results["tasks"])
    if results.get("entries"):
        rows += entries_targets(results["entries"])
    return table(["target", "measured", ""], rows)


def _floor_ratios(runs: dict[str, list[dict[str, Any]]], name: str, key: str) -> list[float]:
    """``name``'s figure over the floor's of the same kind, round by round."""
    floor = runs.get(f"floor.{name.split('.')[1]}", [])
    mine = runs.get(name, [])
    return [m[key] / f[key] for m, f in zip(mine, floor, strict=False) if f[key]]


def _processes(plan: dict[str, Any]) -> str:
    count = plan.get("inprocess_processes", 1)
    if count <= 1:
        return ""
    return (
        f"Each variant runs in {count} worker processes that take the rounds in turn (round r "
        f"in process r mod {count}): the same code runs up to 3 % faster or slower in one "
        "process than in another, which one process per variant would put into every ratio. "
    )


def floor_ratio(data: dict[str, Any], name: str) -> tuple[float, list[float]] | None:
    """In-process: ``name``'s median over the floor's median of the same kind of request,
    and the same ratio round by round; ``None`` without the floor."""
    med, rounds = data["median_ms"], data["round_medians_ms"]
    floor = f"floor.{name.split('.')[1]}"
    if floor not in med or name not in med:
        return None
    per_round = [m / f for m, f in zip(rounds[name], rounds[floor], strict=False) if f]
    return med[name] / med[floor], per_round


def floor_targets_inprocess(data: dict[str, Any]) -> list[list[str]]:
    """Ours against the floor; and the same without prepared statements (Django's default)."""
    rows = []
    # On Django's defaults a first request and a replay within 1.05x the floor; a first
    # request, with the round trips the design merges (the claim's function), at most the
    # floor (DESIGN.md, "Performance budget").
    bounds = {"create": 1.0, "replay": 1.05}
    for variant, condition in (("ours", ""), ("unprepared", ", prepared statements off")):
        for kind, what in (("create", "first request"), ("replay", "replay")):
            found = floor_ratio(data, f"{variant}.{kind}")
            if found is None:
                continue
            value, per_round = found
            bound = bounds[kind]
            rows.append(
                [
                    f"{what} median latency ≤ {bound:g}× the floor (in-process{condition})",
                    f"{ratio(value)} (per round {spread(per_round)})",
                    verdict(value <= bound),
                ]
            )
    return rows


def outbox_targets(data: dict[str, Any]) -> list[list[str]]:
    """The outbox's two targets: relay throughput, and commit-to-consumer latency."""
    rows = []
    for relays in sorted({t.get("relays", 1) for t in data["throughput"]}):
        runs = [t for t in data["throughput"] if t.get("relays", 1) == relays]
        best = max(runs, key=lambda t: t["messages_per_second"])
        rows.append(
            [
                f"outbox: ≥ 2,000 messages/s relayed into Redis ({relays} relay"
                + ("s)" if relays > 1 else ")"),
                f"{best['messages_per_second']:,.0f} messages/s (batches of {best['batch_size']})",
                verdict(best["messages_per_second"] >= 2000),
            ]
        )
    for run in data["latency"]:
        if run["mode"] == "notify":
            rows.append(
                [
                    "outbox: commit → consumer start p50 ≤ 50 ms with NOTIFY",
                    ms(run["p50_ms"]),
                    verdict(run["p50_ms"] <= 50),
                ]
            )
    return rows


def outbox(data: dict[str, Any]) -> str:
    """The "Outbox" section: ``benchmarks/outbox_bench.py``."""
    out = ["\n## Outbox\n"]
    load = data.get("load_average")
    out.append(
        "`benchmarks/outbox_bench.py`, on its own database and a private Redis."
        " Throughput: a backlog of pending messages, one relay (`outbox.drain`, what"
        " `relay_outbox --once` runs) with the default Celery sender, then two relay"
        " processes at once; nothing consumes, and every message was counted in Redis"
        " afterwards. Latency: when the consumer (a Celery worker, solo pool) started, minus"
        " when the producer's `COMMIT` returned; one message per transaction at a steady"
        " rate, with a relay process listening for `NOTIFY`, then with one polling every"
        " `OUTBOX_POLL_INTERVAL` (1 s) only."
        + (f" Load average at the end: {fmt_load(load)}." if load else "")
        + "\n"
    )
    out.append(
        table(
            ["relays", "batch size", "messages", "seconds", "messages/s", "all in Redis"],
            [
                [
                    t.get("relays", 1),
                    t["batch_size"],
                    f"{t['messages']:,}",
                    f"{t['seconds']:.2f}",
                    f"{t['messages_per_second']:,.0f}",
                    "yes" if t["in_redis"] == t["sent"] == t["messages"] else "NO",
                ]
                for t in data["throughput"]
            ],
        )
    )
    out.append("")
    out.append(
        table(
            ["wake-up", "messages", "rate", "p50", "p99", "max"],
            [
                [
                    "LISTEN/NOTIFY" if run["mode"] == "notify" else "polling only",
                    run["messages"],
                    f"{run['rate']:.0f}/s",
                    ms(run["p50_ms"]),
                    ms(run["p99_ms"]),
                    ms(run["max_ms"]),
                ]
                for run in data["latency"]
            ],
        )
    )
    out.append("\n" + table(["target", "measured", ""], outbox_targets(data)))
    return "\n".join(out)


def inprocess(data: dict[str, Any], plan: dict[str, Any]) -> str:
    med, p90, rounds = data["median_ms"], data["p90_ms"], data["round_medians_ms"]
    base = med.get("plain.create")
    rows = []
    for name in sorted(med, key=lambda n: (n.split(".")[1] != "create", n)):
        variant, kind = name.split(".")
        base_rounds = rounds.get("plain.create", [])
        per_round = [m / b for m, b in zip(rounds[name], base_rounds, strict=False)]
        what = {"create": "first request", "replay": "replay", "noop": "authenticated no-op"}[kind]
        versus = floor_ratio(data, name)
        rows.append(
            [
                LABELS[variant],
                what,
                ms(med[name]),
                ms(p90[name]),
                ratio(med[name] / base) if base else "–",
                spread(per_round),
                f"{ratio(versus[0])} ({spread(versus[1])})" if versus else "–",
                data["requests"][name],
                ", ".join(f"{k}: {v}" for k, v in sorted(data["statuses"][name].items())),
            ]
        )
    return (
        "\n## Overhead in-process (Django's test client)\n\n"
        f"{plan['inprocess_rounds']} rounds; in each, every variant serves "
        f"{plan['inprocess_batch']} first requests (new keys), then every protected variant "
        f"{plan['inprocess_batch']} replays (a pool of 200 keys created beforehand), in a rotating "
        f"order. {_processes(plan)}"
        'Ratios are to the plain endpoint\'s first-request median; "per-round" is the '
        "spread of the same ratio computed round by round. The authenticated no-op endpoint "
        "(token authentication, permission check, a constant answer) is the floor of any "
        "replay: a replay is answered only after authentication, because keys are scoped by "
        'the caller. "vs the floor" divides by the floor\'s median of the same kind of '
        "request (the claim and the completion written by hand in the view, "
        "`benchmarks/benchsite/floor.py`), with the spread of that ratio round by round.\n\n"
        + table(
            [
                "variant",
                "request",
                "median",
                "p90",
                "ratio to plain create",
                "per-round",
                "vs the floor",
                "requests",
                "statuses",
            ],
            rows,
        )
    )


def encryption(data: dict[str, Any], plan: dict[str, Any], machine: dict[str, Any]) -> str:
    """The cost of ENCRYPTION_KEYS: the sealed mixin against the same mixin, round by round."""
    med, rounds = data["median_ms"], data["round_medians_ms"]
    writes = data.get("writes", {})
    rows = []
    for kind, what in (("create", "first request"), ("replay", "replay")):
        clear, sealed = f"ours.{kind}", f"sealed.{kind}"
        if clear not in med or sealed not in med:
            continue
        per_round = [s / c for s, c in zip(rounds[sealed], rounds[clear], strict=False) if c]
        wal = [
            f"{_median_writes(writes[v][kind], 'wal_bytes_per_request'):.0f}"
            if writes.get(v, {}).get(kind)
            else "–"
            for v in ("ours", "sealed")
        ]
        rows.append(
            [
                what,
                ms(med[clear]),
                ms(med[sealed]),
                ratio(statistics.median(per_round)) if per_round else "–",
                spread(per_round),
                f"{wal[0]} / {wal[1]} bytes",
            ]
        )
    sealing = [
        [
            f"{int(size):,} bytes",
            f"{timing['seal_us']:.1f} µs",
            f"{timing['open_us']:.1f} µs",
            f"{timing['clear_bytes']:,} → {timing['stored_bytes']:,} bytes",
        ]
        for size, timing in (data.get("sealing") or {}).items()
    ]
    alone = (
        "\n\nSealing and opening alone (2000 times each in the sealed worker: a response with "
        "`Content-Type` and `Location`, random bytes as its body):\n\n"
        + table(["body", "seal", "open", "stored (headers and body)"], sealing)
        if sealing
        else ""
    )
    sql = data.get("sql", {})
    counts = {
        v: tuple(len(sql[v][k]["wire"]) for k in ("create", "replay"))
        for v in ("ours", "sealed")
        if v in sql
    }
    statements = (
        f"the protocol trace counts {counts['ours'][0]} statements per first request and "
        f"{counts['ours'][1]} per replay for both"
        if len(counts) == 2 and counts["ours"] == counts["sealed"]
        else f"statements per first request and replay: {counts}"
    )
    return (
        "\n## Stored responses encrypted\n\n"
        f"{LABELS['sealed']} (one Fernet key) against {LABELS['ours']} without it, in one "
        "interleaved run: every round serves both back to back, in a rotating order. With "
        "keys set, each completion seals the body and the stored headers and each replay "
        f"opens them; {statements}. The ratio is the median of the per-round ratios "
        "(sealed median over the unsealed median of the same round); "
        "WAL per request is the median over the write batches. "
        f"{plan['inprocess_rounds']} rounds of {plan['inprocess_batch']} requests of each kind; "
        f"load average {fmt_load(machine['load_average_start'])} at the start and "
        f"{fmt_load(machine.get('load_average_end', []))} at the end, on {machine['cores']} "
        "shared cores: the absolute figures are noisy, the ratios less so.\n\n"
        + table(
            [
                "request",
                "median without",
                "median with ENCRYPTION_KEYS",
                "ratio",
                "per-round",
                "WAL per request (without / with)",
            ],
            rows,
        )
        + alone
    )


def replace_section(text: str, rendered: str, title: str) -> str:
    """``text`` with its section ``## title`` replaced by the one of ``rendered``.

    A section ``text`` does not have yet goes after the section that precedes it in
    ``rendered``, or at the end.
    """
    pattern = re.compile(r"^## ([^\n]+)\n.*?(?=^## |\Z)", re.S | re.M)
    sections = {m.group(1): m for m in pattern.finditer(rendered)}
    if title not in sections:
        raise KeyError(f"the report has no section {title!r}")
    block = sections[title].group(0).rstrip() + "\n\n"
    present = {m.group(1): m for m in pattern.finditer(text)}
    if title in present:
        old = present[title]
        return (text[: old.start()] + block + text[old.end() :]).rstrip() + "\n"
    names = list(sections)
    before = names[names.index(title) - 1] if names.index(title) else None
    if before in present:
        end = present[before].end()
        return (text[:end] + block + text[end:]).rstrip() + "\n"
    return text.rstrip() + "\n\n" + block.rstrip() + "\n"


def sql(data: dict[str, Any]) -> str:
    rows = []
    for variant, calls in data.items():
        for kind in ("create", "replay"):
            if variant == "plain" and kind == "replay":
                continue
            call = calls[kind]
            wire = call["wire"]
            control = [s for s in wire if statement_kind(s) in ("BEGIN", "COMMIT", "ROLLBACK")]
            savepoints = [s for s in wire if "SAVEPOINT" in statement_kind(s)]
            work = len(wire) - len(control) - len(savepoints)
            rows.append(
                [
                    LABELS[variant],
                    "first request" if kind == "create" else "replay",
                    call["status"],
                    work,
                    len(control),
                    len(savepoints),
                    len(wire),
                    f"{sum(call['round_trip_ms']):.2f} ms",
                    describe(wire, call["round_trip_ms"]),
                ]
            )
    return (
        "\n## SQL per request\n\n"
        "What one request sends to PostgreSQL, read from the libpq protocol trace (so "
        "psycopg's own `BEGIN` and `COMMIT` count too; Django's `execute_wrapper` sees only "
        "the statements). Every statement is one round trip. A plain create needs two: the "
        "token lookup and the INSERT. The times are the median round trip of each statement "
        "(from sending it to the server's ReadyForQuery) over 30 traced requests of each "
        "kind, in milliseconds.\n\n"
        + table(
            [
                "variant",
                "request",
                "status",
                "statements",
                "BEGIN/COMMIT",
                "SAVEPOINT/RELEASE",
                "round trips",
                "time in the database",
                "in order, with each round trip (ms)",
            ],
            rows,
        )
    )


def statements(data: dict[str, Any]) -> str:
    """Ours against the floor, statement by statement: round trip and values bound."""
    rows = []
    for kind in ("create", "replay"):
        for variant in ("floor", "ours", "unprepared"):
            if variant not in data:
                continue
            call = data[variant][kind]
            bound = call.get("parameters") or [0] * len(call["wire"])
            for number, (statement, took, values) in enumerate(
                zip(call["wire"], call["round_trip_ms"], bound, strict=False), start=1
            ):
                rows.append(
                    [
                        "first request" if kind == "create" else "replay",
                        LABELS[variant],
                        number,
                        statement_kind(statement),
                        f"{took * 1000:.0f} µs",
                        values,
                        len(statement),
                    ]
                )
            total = sum(call["round_trip_ms"]) * 1000
            rows.append(["", f"**{LABELS[variant]}: total**", "", "", f"{total:.0f} µs", "", ""])
    return (
        "\n## Statement by statement: ours and the floor\n\n"
        "The same traces as above: each statement of one first request and of one replay, "
        "its median round trip (µs, from sending it to the server's `ReadyForQuery`), the "
        "values bound to it and the length of its text, in characters. Django's cursors, "
        "and so the floor's statements and ours with prepared statements off, bind "
        "client-side: the values are written into the text, which is sent and parsed on "
        'every request. With prepared statements allowed (`OPTIONS["prepare_threshold"]`'
        ", as in this run), ours sends the text once per connection and then only the "
        "prepared statement's name and its values.\n\n"
        + table(
            ["request", "variant", "#", "statement", "round trip", "values bound", "characters"],
            rows,
        )
    )


def writes_section(data: dict[str, Any]) -> str:
    rows = []
    detail = []
    for variant, kinds in data.items():
        for kind, batches in kinds.items():
            per_request = [b["wal_bytes_per_request"] for b in batches]
            fpi = [b["fpi_bytes_per_request"] for b in batches]
            record = "django_idempotency_record"
            hot = hot_ratio(batches, record)
            n = sum(b["n"] for b in batches)
            counters = {
                k: sum(b["tables"].get(record, {}).get(k, 0) for b in batches) / n
                for k in ("inserts", "updates", "deletes")
            }
            rows.append(
                [
                    LABELS[variant],
                    kind,
                    f"{statistics.median(per_request):.0f}",
                    spread(per_request).replace("–", " – "),
                    f"{statistics.median(fpi):.0f}",
                    "–" if hot is None else f"{hot:.2f}",
                    " / ".join(f"{counters[k]:.2f}" for k in ("inserts", "updates", "deletes")),
                ]
            )
            if kind == "create":
                relations: dict[str, list[float]] = {}
                for b in batches:
                    for name, figures in b["wal_by_relation"].items():
                        relations.setdefault(name, []).append(figures["bytes"] / b["n"])
                detail.append(
                    f"\n{LABELS[variant]}, first requests, WAL bytes per request by relation "
                    "(median of batches): "
                    + ", ".join(
                        f"`{name}` {statistics.median(values):.0f}"
                        for name, values in sorted(
                            relations.items(), key=lambda item: -statistics.median(item[1])
                        )
                    )
                )
    return (
        "\n## Writes per request\n\n"
        "WAL per request, read back with `pg_walinspect` between two LSNs around a batch of "
        "requests: only records that touch the variant's own database (by the OID in their "
        "block references) and the commit records of those transactions, so the other "
        "databases on the server do not count. Full-page images (FPI) make single batches "
        "noisy: the median of the batches is the figure, the range beside it. Row counters "
        "(per request: inserts / updates / deletes of the record table) and the HOT ratio "
        "come from `pg_stat_user_tables`, reset before each batch.\n\n"
        + table(
            [
                "variant",
                "requests",
                "WAL bytes / request (median)",
                "range over batches",
                "of which FPI",
                "HOT ratio (record table)",
                "record ins / upd / del per request",
            ],
            rows,
        )
        + "\n"
        + "\n".join(detail)
    )


def server(data: dict[str, Any], plan: dict[str, Any]) -> str:
    runs = data["runs"]
    rows = []
    for name in sorted(runs, key=lambda n: (n.split(".")[1] != "create", n)):
        variant, kind = name.split(".")
        rps = [r["rps"] for r in runs[name]]
        p50 = [r["p50_ms"] for r in runs[name]]
        through = _server_ratio(runs, name, "rps")
        latency = _server_ratio(runs, name, "p50_ms")
        floor_through = _floor_ratios(runs, name, "rps")
        floor_latency = _floor_ratios(runs, name, "p50_ms")
        rows.append(
            [
                LABELS[variant],
                "first request" if kind == "create" else "replay",
                f"{statistics.median(rps):,.0f}",
                f"{statistics.median(through):.0%} ({spread(through)})" if through else "–",
                f"{statistics.median(floor_through):.2f}× ({spread(floor_through)})"
                if floor_through
                else "–",
                ms(statistics.median(p50)),
                f"{statistics.median(latency):.2f}× ({spread(latency)})" if latency else "–",
                f"{statistics.median(floor_latency):.2f}× ({spread(floor_latency)})"
                if floor_latency
                else "–",
                ms(statistics.median(r["p99_ms"] for r in runs[name])),
                sum(r["non_2xx_3xx"] for r in runs[name]),
                sum(r["errors"] for r in runs[name]),
            ]
        )
    return (
        "\n## Overhead through a real server (gunicorn)\n\n"
        f"One gunicorn per variant on 127.0.0.1, {plan['workers']} sync workers each, all "
        f"running at once; a closed loop of {plan['concurrency']} connections for "
        f"{plan['server_seconds']} s per run, {plan['server_rounds']} rounds of every variant "
        "(rotating order) after a warm-up. Replays cycle through "
        f"{plan['replay_keys']} keys created beforehand. Ratios are to the plain endpoint's "
        "first requests of the same round, and to the floor's of the same kind of request; the "
        "median ratio is shown with the spread of the rounds. Requests per second count only "
        "2xx answers (the median of the rounds); "
        '"non-2xx" are the other answers of all rounds together (django-idempotency-key '
        "answers 423 Locked when its global Redis lock is busy for 0.1 s).\n\n"
        + table(
            [
                "variant",
                "request",
                "req/s",
                "throughput vs plain",
                "throughput vs the floor",
                "median latency",
                "latency vs plain",
                "latency vs the floor",
                "p99",
                "non-2xx",
                "socket errors",
            ],
            rows,
        )
    )


def storm(data: dict[str, Any], plan: dict[str, Any]) -> str:
    rows = []
    for variant, s in data.items():
        effects = s["side_effects"]
        times = sorted(s["seconds_to_last_answer"])
        rows.append(
            [
                LABELS[variant],
                s["rounds"],
                sum(1 for e in effects if e == 1),
                sum(effects),
                sum(max(e - 1, 0) for e in effects),
                max(effects),
                ms(statistics.median(times) * 1000),
                ms(times[min(len(times) - 1, int(0.95 * len(times)))] * 1000),
                ms(times[-1] * 1000),
                ", ".join(f"{k}: {v}" for k, v in s["statuses"].items()),
            ]
        )
    return (
        "\n## Retry storm\n\n"
        f"{plan['storm_size']} identical requests (same key, same body) sent at the same "
        f"instant on connections opened beforehand, {plan['storm_rounds']} rounds per variant "
        "(interleaved), through the same gunicorns. The endpoint here waits 20 ms before its "
        "INSERT (a payment provider's call), so the duplicates arrive while the first request "
        "is running. Side effects are the rows the round's key created, counted in the "
        "database after the last answer. Status 0 is a connection the server closed without "
        "an answer.\n\n"
        + table(
            [
                "variant",
                "rounds",
                "rounds with exactly 1 effect",
                "side effects",
                "duplicates",
                "most in one round",
                "time to last answer (median)",
                "p95",
                "max",
                "statuses",
            ],
            rows,
        )
    )


def purge(data: list[dict[str, Any]], plan: dict[str, Any]) -> str:
    rows = []
    for p in data:
        none, during = p["claims_no_purge"], p["claims_during_purge"]
        rows.append(
            [
                LABELS[p.get("variant", "ours")],
                p["batch_size"],
                f"{p['deleted']:,}",
                f"{p['purge_seconds']:.1f} s",
                f"{p['rows_per_second']:,.0f}",
                ms(p["batch_p50_ms"]),
                ms(p["batch_p99_ms"]),
                ms(p["longest_batch_ms"]),
                f"{ms(none['all']['p50_ms'])} / {ms(during['all']['p50_ms'])}",
                f"{ms(none['all']['p99_ms'])} / {ms(during['all']['p99_ms'])} "
                f"({ratio(during['all']['p99_ms'] / none['all']['p99_ms'])})",
                f"{ms(none['new']['p99_ms'])} / {ms(during['new']['p99_ms'])}",
                f"{ms(none['expired']['p99_ms'])} / {ms(during['expired']['p99_ms'])}",
                f"{none['all']['n']} / {during['all']['n']}",
                ", ".join(f"#{n}: {ms(t)}" for n, t in p.get("slow_batches", [])) or "none",
                f"{p['wal_mb']:,.0f} MB, {p['checkpoints']}" if "wal_mb" in p else "–",
            ]
        )
    return (
        "\n## Purge\n\n"
        f"`maintenance.purge_expired` on a table filled with {plan['purge_rows']:,} expired "
        "completed records (bodies of ~270 bytes, `VACUUM ANALYZE`d). A separate process "
        f"claims at a steady {plan['purge_rate']:.0f}/s through `store.claim` "
        f"({plan['purge_baseline']:.0f} s without a purge, then during it): every other "
        "claim is a new key, the rest are keys of expired records, which the purge may hold "
        "locked in its current batch. Claims: without purge / during purge.\n\n"
        + table(
            [
                "package",
                "batch size",
                "deleted",
                "time",
                "rows/s",
                "batch p50",
                "batch p99",
                "longest batch",
                "claim p50",
                "claim p99",
                "p99 new keys",
                "p99 expired keys",
                "claims",
                "batches over 100 ms",
                "WAL written, checkpoints (whole server)",
            ],
            rows,
        )
    )


def profiles(data: dict[str, Any]) -> str:
    parts = [
        "\n## Profile of the hot path (cProfile)\n",
        "Milliseconds per request under cProfile (which roughly doubles Python's share), "
        'in-process. "Driver wait" is the time psycopg spends sending a statement and '
        "waiting for PostgreSQL's answer. The raw profiles are in `benchmarks/.results/`.\n",
    ]
    summary = [
        [name, ms(p["total_ms_per_request"]), ms(p["driver_wait_ms_per_request"])]
        for name, p in data.items()
    ]
    parts.append(table(["requests", "total per request", "driver wait"], summary))
    for name, p in data.items():
        if not name.startswith(("ours", "patched")):
            continue
        parts.append(f"\n`{name}`, the package's functions by cumulative time:\n")
        parts.append(
            table(
                ["function", "cumulative", "own"],
                [[f"`{t['function']}`", ms(t["cum_ms"]), ms(t["own_ms"])] for t in p["top"]],
            )
        )
    return "\n".join(parts)


def _per_unit(data: dict[str, Any], way: str) -> dict[str, Any]:
    """What one more unit of work costs ``way``: half the difference between 3 and 1 units."""
    sql = data["sql"]
    one, three = f"{way}.1", f"{way}.3"
    rounds = data["round_medians_ms"]
    per_round = [(b - a) / 2 for a, b in zip(rounds[one], rounds[three], strict=False)]
    return {
        "statements": (sql[three]["statements"] - sql[one]["statements"]) / 2,
        "transactions": (sql[three]["transactions"] - sql[one]["transactions"]) / 2,
        "ms": (data["median_ms"][three] - data["median_ms"][one]) / 2,
        "per_round": per_round,
    }


def steps_target(data: dict[str, Any]) -> list[str]:
    """The target of the steps: one fenced write more per step than a unit in one block."""
    extra = _per_unit(data, "resume")["statements"] - _per_unit(data, "retry")["statements"]
    return [
        "steps: one fenced write more per step than the same work in one atomic() block",
        f"{extra:+.0f} statement per step",
        verdict(extra == 1),
    ]


def steps(data: dict[str, Any]) -> str:
    """The "Recovery points" section: ``benchmarks/steps_bench.py``."""
    labels = {
        "plain": "`atomic()`, no idempotency",
        "retry": '`run_once`, `"retry"`: one transaction',
        "resume": '`run_once`, `"resume"`: one step per INSERT',
    }
    sql, med, rounds = data["sql"], data["median_ms"], data["round_medians_ms"]
    rows = []
    for kind in sql:
        way, units = kind.split(".")
        # "claim (INSERT … ON CONFLICT …)" is "claim" here: one statement either way.
        shown = ", ".join(f"{n}× {name.split(' (')[0]}" for name, n in sql[kind]["by_kind"].items())
        rows.append(
            [
                labels[way],
                units,
                f"{sql[kind]['statements']} ({shown})",
                sql[kind]["transactions"],
                ms(med[kind]),
                f"{min(rounds[kind]):.2f}–{max(rounds[kind]):.2f} ms",
            ]
        )
    per_unit = {way: _per_unit(data, way) for way in ("plain", "retry", "resume")}
    unit_rows = [
        [
            labels[way],
            f"{cost['statements']:+.0f}",
            f"{cost['transactions']:+.0f}",
            f"{cost['ms']:+.2f} ms",
            f"{min(cost['per_round']):+.2f} to {max(cost['per_round']):+.2f} ms",
        ]
        for way, cost in per_unit.items()
    ]
    step, block = per_unit["resume"], per_unit["retry"]
    load = " / ".join(f"{v:.2f}" for v in data["load_average"])
    return (
        f"\n## {SECTION_STEPS}\n\n"
        "`benchmarks/steps_bench.py`, in one process on its own database: operations of 1 and "
        "3 units of work, one `INSERT` each, done three ways and interleaved (every round runs "
        "a batch of every kind, in an order that rotates). Statements are those Django sends "
        "(`CaptureQueriesContext`), without `BEGIN` and `COMMIT`; transactions are the "
        "commits of `atomic()` blocks and the statements outside any, each its own. "
        f"{data['rounds']} rounds of {data['batch']} operations of each kind; load average "
        f"{load} at the end, on shared cores.\n\n"
        + table(
            [
                "operation",
                "units",
                "statements",
                "transactions",
                "median",
                "per-round medians",
            ],
            rows,
        )
        + "\n\nOne more unit of work (the difference between 3 and 1 units, halved):\n\n"
        + table(
            ["operation", "statements", "transactions", "latency", "per round"],
            unit_rows,
        )
        + "\n\nA step costs "
        f"{step['statements'] - block['statements']:+.0f} statement (its fenced record, an "
        "`INSERT … SELECT` of the owner's row `FOR SHARE`) and "
        f"{step['transactions'] - block['transactions']:+.0f} transaction more than the same "
        "`INSERT` in "
        f'the one transaction of `"retry"`: {step["ms"] - block["ms"]:+.2f} ms per step '
        "here, for the statement, the transaction's `BEGIN` and its `COMMIT`, which waits for "
        "the write-ahead log to be flushed. Once per attempt, the resumable operation also "
        "reads its recorded steps, and it stores its outcome in a transaction of its own.\n\n"
        + table(["target", "measured", ""], [steps_target(data)])
    )


SECTION_STEPS = "Recovery points: the cost of a step"


def connections(data: dict[str, Any]) -> str:
    """The "ATOMIC_REQUESTS" section: ``benchmarks/connections_bench.py``."""
    names = {
        "decorator": "`@idempotent` (function view)",
        "mixin": "`IdempotencyMixin` (DRF `APIView`)",
        "api-view": "`@api_view` over `@idempotent`",
        "ninja": "django-ninja `@idempotent`",
    }
    med, opened, ratios = data["median_us"], data["connections_per_request"], data["ratios"]
    rows = []
    for entry, name in names.items():
        for age in (0, 600):
            off, on = f"{entry}|plain|{age}", f"{entry}|atomic|{age}"
            ratio = ratios[f"{entry}|{age}"]
            rows.append(
                [
                    name,
                    str(age),
                    f"{med[off]:,.0f} µs",
                    f"{med[on]:,.0f} µs",
                    f"**{ratio['ratio']:.2f}×** ({ratio['min']:.2f}–{ratio['max']:.2f})",
                    f"{opened[off]:g} / {opened[on]:g}",
                ]
            )
    load = " / ".join(f"{v:.2f}" for v in data["load_average"])
    return (
        f"\n## {SECTION_CONNECTIONS}\n\n"
        "`benchmarks/connections_bench.py`, in one process on its own database, through "
        "Django's WSGI handler (so connections are closed or kept as a server's are): a "
        "protected first request writing one row, for each entry point, with "
        "`ATOMIC_REQUESTS` off and on, with `CONN_MAX_AGE = 0` (a connection per request) "
        "and `600`. Every (entry point, configuration) batch runs in every round, in an order "
        f"that rotates. {data['rounds']} rounds of {data['batch']} requests; the ratio is on "
        "to off, with the spread of the per-round ratios; connections: opened per request, "
        f"off / on. Load average {load} at the end, on shared cores.\n\n"
        + table(
            [
                "entry point",
                "`CONN_MAX_AGE`",
                "off",
                "`ATOMIC_REQUESTS`",
                "on ÷ off",
                "connections",
            ],
            rows,
        )
        + "\n"
    )


SECTION_CONNECTIONS = "ATOMIC_REQUESTS: one connection, the same cost"


def connections_targets(data: dict[str, Any]) -> list[list[str]]:
    """Under ATOMIC_REQUESTS a protected request opens no connection more, and costs what it
    costs without (at most 1.1x, the run's noise)."""
    opened = data["connections_per_request"]
    extra = 0.0
    for kind in data["ratios"]:
        entry, age = kind.rsplit("|", 1)
        extra = max(extra, opened[f"{entry}|atomic|{age}"] - opened[f"{entry}|plain|{age}"])
    worst = max(r["ratio"] for r in data["ratios"].values())
    return [
        [
            "ATOMIC_REQUESTS: no connection more per protected request",
            f"{extra:+g} at most",
            verdict(extra <= 0),
        ],
        [
            "ATOMIC_REQUESTS: a protected request within 1.1× of the same without",
            f"{worst:.2f}× at most",
            verdict(worst <= 1.1),
        ],
    ]


UNIQUE_KINDS = {
    "plain": "`enqueue` (no key)",
    "once_new_key": "`enqueue_once`, a free key (the key written with the message)",
    "once_held_key": "`enqueue_once`, a key a live message holds (nothing written)",
}


def unique_enqueues(data: dict[str, Any]) -> str:
    """The "Unique enqueues" section: ``outbox_bench.py --enqueue-costs``."""
    out = ["\n## Unique enqueues\n"]
    load = data.get("load_average")
    out.append(
        "`python -m benchmarks.outbox_bench --enqueue-costs --write`, on PostgreSQL: one"
        " enqueue per transaction (`BEGIN`, the enqueue, `COMMIT`), timed in blocks of"
        f" {data['block']} and interleaved over {data['rounds']} rounds in a shuffled order;"
        " the median block per enqueue. Statements: one transaction of each, `BEGIN` and"
        " `COMMIT` included."
        + (f" Load average at the end: {fmt_load(load)}." if load else "")
        + "\n"
    )
    out.append("| enqueue | median | over plain | fastest block | statements |")
    out.append("|---|---|---|---|---|")
    for kind, label in UNIQUE_KINDS.items():
        row = data["kinds"][kind]
        out.append(
            f"| {label} | {row['median_us']:,.0f} µs | {row['over_plain_us']:+,.0f} µs"
            f" | {row['min_us']:,.0f} µs | {row['statements']} |"
        )
    out.append(
        "\nA key a live message holds (the periodic job's every tick but one) costs less than"
        ' a plain enqueue: it reads the key (and, under `"started"`/`"finished"`, its'
        " message and its run's record) and writes nothing, so its `COMMIT` flushes no WAL."
        " A free key costs a read of the key and one statement that inserts the key and the"
        " message together (`WITH k AS (INSERT ... ON CONFLICT DO NOTHING RETURNING 1)"
        " INSERT ... SELECT ... FROM k`, in place of the plain enqueue's `INSERT`); its"
        " `COMMIT` flushes the key's row too (three index entries, and the lock its foreign"
        " key takes on the new message's row). MariaDB and SQLite insert both in a savepoint."
    )
    return "\n".join(out) + "\n"


def outbox_placeholder() -> str:
    """A bare "Outbox" heading: where "Unique enqueues" goes when it is new."""
    return "\n## Outbox\n"


ENTRY_NAMES = {
    "drf": "DRF `APIView` with `IdempotencyMixin` / plain (the yardstick)",
    "django-view": "Django view under `@idempotent` / plain",
    "async-view": "`async def` view under `@idempotent` / plain, uvicorn",
    "async-view-pool": 'the same, uvicorn with Django\'s pool (`OPTIONS["pool"]`)',
    "ninja": "django-ninja operation under `ninja.idempotent` / plain",
    "run-once": "`run_once(write, ...)` / `write()`",
    "celery-task": "Celery task under `@idempotent_task()` / plain (`apply`)",
    "django-task": "Django task under `@idempotent_task()` / plain (`ImmediateBackend`)",
    "mcp": "MCP tool under `@idempotent_tool` / plain (`MCPServer`)",
    "mcp-async": "the same, an `async def` tool (`MCPServer`)",
    "fastmcp": "MCP tool under `@idempotent_tool` / plain (FastMCP)",
}


def _entry_ratio(r: dict[str, float]) -> str:
    return f"**{r['ratio']:.2f}×** ({r['min']:.2f}–{r['max']:.2f})"


def entries(data: dict[str, Any]) -> str:
    """The "Every entry point" section: ``benchmarks/entries_bench.py``."""
    med, ratios = data["median_us"], data["ratios"]
    rows = []
    for entry, name in ENTRY_NAMES.items():
        if entry not in ratios:
            continue
        r = ratios[entry]
        rows.append(
            [
                name,
                f"{med[f'{entry}|twin']:,.0f} µs",
                f"{med[f'{entry}|ours']:,.0f} µs",
                _entry_ratio(r["ours"]),
                f"{med[f'{entry}|ours'] - med[f'{entry}|twin']:+,.0f} µs",
                f"{med[f'{entry}|replay']:,.0f} µs",
                _entry_ratio(r["replay"]),
            ]
        )
    load = " / ".join(f"{v:.2f}" for v in data["load_average"])
    return (
        f"\n## {SECTION_ENTRIES}\n\n"
        "`benchmarks/entries_bench.py`, in one process and two uvicorn servers on its own "
        "database, on Django's defaults (no prepared statements, no pooler; connections kept): "
        "each entry point as its unprotected twin, protected with a new key (a first "
        "operation) and protected with a key it has seen (a replay), the work the same single "
        "`INSERT` everywhere (its rows counted every round: one per twin and first operation, "
        "none per replay). The Django, DRF and ninja views go through Django's WSGI handler in "
        "the process; the `async def` view is served by uvicorn and called one request after "
        "another on a kept-alive connection; Celery's task runs on its eager path (`apply`, "
        "the worker's own code without a broker); under ASGI Django opens a PostgreSQL session "
        "per request, so the `async def` views are measured twice: on Django's defaults, and "
        "on a second uvicorn whose Django keeps its sessions in its pool; Django's task is "
        "enqueued on "
        "`ImmediateBackend`, the protected one with the outbox message id a relay hands it; "
        "the tools are called through each framework's in-memory client. Every (entry point, "
        "variant) batch runs in every round, in an order that rotates. "
        f"{data['rounds']} rounds of {data['batch']} operations; a ratio is the protected "
        "median over the twin's, with the spread of the per-round ratios. "
        f"Load average {load} at the end, on shared cores.\n\n"
        + table(
            [
                "entry point",
                "twin",
                "first operation",
                "first ÷ twin",
                "first − twin",
                "replay",
                "replay ÷ twin",
            ],
            rows,
        )
        + "\n\n"
        + table(["target", "measured", ""], entries_targets(data))
        + "\n"
    )


SECTION_ENTRIES = "Every entry point against its unprotected twin"


def entries_targets(data: dict[str, Any]) -> list[list[str]]:
    """No entry point costs more above its twin than a protected DRF create above plain DRF;
    no replay costs more than its twin."""
    ratios = data["ratios"]
    replays = {e: r["replay"]["ratio"] for e, r in ratios.items()}
    dearest = max(replays, key=lambda e: replays[e])
    rows = [
        [
            "every replay ≤ its twin (1.00×)",
            f"{replays[dearest]:.2f}× at most ({dearest})",
            verdict(replays[dearest] <= 1.0),
        ]
    ]
    others = {e: r["ours"]["ratio"] for e, r in ratios.items() if e != "drf"}
    if "drf" not in ratios or not others:  # a run of some entry points only
        return rows
    yardstick = ratios["drf"]["ours"]["ratio"]
    worst = max(others, key=lambda e: others[e])
    med = data["median_us"]
    added = {e: med[f"{e}|ours"] - med[f"{e}|twin"] for e in ratios}
    most = max((e for e in added if e != "drf"), key=lambda e: added[e])
    return [
        [
            f"every entry point's first operation ÷ its twin ≤ the DRF create's ({yardstick:.2f}×)",
            f"{others[worst]:.2f}× at most ({worst})",
            verdict(others[worst] <= yardstick),
        ],
        [
            f"every entry point's time added to its twin ≤ the DRF create's "
            f"({added['drf']:,.0f} µs)",
            f"{added[most]:,.0f} µs at most ({most})",
            verdict(added[most] <= added["drf"]),
        ],
        *rows,
    ]


def tasks_relay(data: dict[str, Any]) -> str:
    """The "Outbox relay: hand-over in batches" section: ``benchmarks/tasks_bench.py``."""
    per_s = data["relay_per_s"]
    rows = [
        ["a sender that does nothing", f"{per_s['noop']:,}", "1.00×", ""],
        [
            "django-tasks-db's `DatabaseBackend` (`OutboxBackend`'s `DELIVER_TO`)",
            f"{per_s['tasks']:,}",
            f"**{data['tasks_vs_noop']:.3f}×**",
            "{:.3f}–{:.3f}".format(*data["tasks_vs_noop_range"]),
        ],
    ]
    brokers = data.get("brokers") or {"celery": data.get("broker", "a broker")}
    for path in (path for path in per_s if path.startswith("celery")):
        rows.append(
            [
                f"the Celery sender into {_broker_name(brokers.get(path, 'a broker'))}",
                f"{per_s[path]:,}",
                f"**{data[f'{path}_vs_noop']:.3f}×**",
                "{:.3f}–{:.3f}".format(*data[f"{path}_vs_noop_range"]),
            ]
        )
    load = " / ".join(f"{v:.2f}" for v in data.get("load_average", []))
    return (
        f"\n## {SECTION_TASKS}\n\n"
        "`benchmarks/tasks_bench.py`, on its own database: per round "
        f"{data['messages']:,} messages per sender, written in blocks of a batch "
        f"({data['batch_size']}) and relayed with `outbox.relay_batch` (one batch of "
        "`outbox.drain`), the senders taking turns batch after batch, so that each meets the "
        "machine's load of the same moment (the order rotating, and reversed every other "
        f"round); {data['rounds']} rounds, medians. Into the database backend a batch is one "
        "multi-row `INSERT` and one `UPDATE` marking it sent, in the batch's transaction; into "
        "Celery, one `apply_async` per message through one producer and the same one "
        "`UPDATE`. Load average "
        f"{load} at the end.\n\n"
        + table(["sender", "messages/s", "÷ no-op", "per-round spread"], rows)
        + "\n\n"
        + table(["target", "measured", ""], tasks_targets(data))
        + "\n"
    )


SECTION_TASKS = "Outbox relay: the hand-over in batches"


def _broker_name(url: str) -> str:
    """A broker as the table names it: RabbitMQ for an AMQP URL, the URL without its
    credentials otherwise."""
    if url.startswith(("amqp:", "pyamqp:")):
        return f"RabbitMQ ({url.split('@')[-1]})"
    return url.split("@")[-1]


def tasks_targets(data: dict[str, Any]) -> list[list[str]]:
    ratio_ = data["tasks_vs_noop"]
    return [
        [
            "relay into django-tasks-db ≥ 0.5× the no-op sender",
            f"{ratio_:.3f}×",
            verdict(ratio_ >= 0.5),
        ]
    ]


def write_section(section: str, title: str) -> None:
    """Put a benchmark's rendered ``section`` (headed ``title``) into RESULTS.md, in place
    of an older one; the rest of the file stays."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(replace_section(text, section, title))
