"""HTTP load from Python (asyncio, raw sockets): the retry storm, and a stand-in for wrk.

Every request goes on its own connection, as gunicorn's sync workers close each one after
the response anyway. Only the standard library: the coordinator runs it in the main venv.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


def raw_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode() + body


def _status(data: bytes) -> int:
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


async def _exchange(
    port: int, payload: bytes, opened: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None
) -> int:
    reader, writer = opened or await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        data = await reader.read()  # the server closes the connection after the response
    except (ConnectionError, OSError):
        return 0
    finally:
        writer.close()
    return _status(data)


@dataclass
class StormRound:
    statuses: Counter[int] = field(default_factory=Counter)
    seconds_to_last_answer: float = 0.0


def storm(port: int, payload: bytes, concurrency: int) -> StormRound:
    """``concurrency`` identical requests sent at the same instant on connections opened first."""

    async def run() -> StormRound:
        connections = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency))
        )
        started = time.perf_counter()
        statuses = await asyncio.gather(*(_exchange(port, payload, c) for c in connections))
        return StormRound(Counter(statuses), time.perf_counter() - started)

    return asyncio.run(run())


def load(
    port: int,
    make_payload: Callable[[int], bytes],
    concurrency: int,
    seconds: float,
) -> dict[str, float]:
    """Closed-loop load (``concurrency`` requests in flight) for ``seconds``; wrk's summary."""

    async def run() -> tuple[list[float], Counter[int], float]:
        latencies: list[float] = []
        statuses: Counter[int] = Counter()
        counter = 0
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal counter
            while time.perf_counter() < deadline:
                counter += 1
                payload = make_payload(counter)
                started = time.perf_counter()
                status = await _exchange(port, payload, None)
                latencies.append(time.perf_counter() - started)
                statuses[status] += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return latencies, statuses, time.perf_counter() - started

    latencies, statuses, elapsed = asyncio.run(run())
    latencies.sort()
    ok = sum(n for status, n in statuses.items() if 200 <= status < 400)
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "rps": ok / elapsed,  # only 2xx/3xx answers count
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "non_2xx_3xx": len(latencies) - ok,
        "errors": statuses.get(0, 0),
    }
