"""What `fleetbox serve --tui` costs the box it runs in: serving throughput with the TUI and without.

Each run starts `fleetbox serve` as a subprocess on an 80×24 pseudo-terminal (a thread reads it,
as a terminal emulator would), with only a no-op model, so the serving path (HTTP, gateway, queue,
worker, batcher) is all there is to slow down. A closed-loop HTTP load (one input per request,
`--concurrency` in flight) runs for `--seconds` after a warm-up; the box's CPU time over the same
window is read from /proc. Runs alternate plain / `--tui` for `--rounds` rounds, a fresh box each
time, so drift on a shared machine falls on both sides; the ratio is of the medians.

The TUI is left on `--screen` (fleet, models, queue or events), refreshing once a second, as an
operator watching it would. Target: with the TUI, throughput within 10% of without.

    python benchmarks/tui_overhead.py [--rounds 3] [--seconds 10] [--concurrency 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import fcntl
import os
import platform
import pty
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from appliance.natsd import free_port  # noqa: E402 - after the path set-up above

FLEETBOX = str(Path(sys.executable).with_name("fleetbox"))
CONFIG = """
default_model = false
[[models]]
name = "noop"
runtime = "noop"
pinned = true
"""
SCREEN_KEYS = {"fleet": "1", "models": "2", "queue": "3", "events": "4"}
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class Run:
    mode: str  # plain | tui
    round: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    box_cpu_s: float

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.box_cpu_s / max(1, self.requests)


class BoxInTerminal:
    """`fleetbox serve` on a pseudo-terminal of 80×24 whose output is read and dropped."""

    def __init__(self, state: Path, tui: bool) -> None:
        (state / "noop.toml").write_text(CONFIG)
        self.port = free_port()
        args = [FLEETBOX, "serve", "--config", "noop.toml", "--device", "cpu", "--state-dir", "state"]
        args += ["--port", str(self.port), "--nats-port", str(free_port()), "--log-level", "WARNING"]
        if tui:
            args.append("--tui")
        self._master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color"}
        self.process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=state, env=env)
        os.close(slave)
        self.drawn_bytes = 0
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:
                return
            if not data:
                return
            self.drawn_bytes += len(data)

    def type(self, keys: str) -> None:
        os.write(self._master, keys.encode())

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        os.close(self._master)


async def wait_ready(http: aiohttp.ClientSession, port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the box on port {port} was not ready within {timeout_s:g}s")


async def load(
    http: aiohttp.ClientSession, port: int, concurrency: int, seconds: float
) -> tuple[list[float], int, float]:
    """Closed loop: `concurrency` clients, each sending its next request when the last is answered."""
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    body = orjson.dumps({"model": "noop", "input": "the quick brown fox jumps over the lazy dog"})
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                async with http.post(url, data=body, headers=headers) as response:
                    await response.read()
                    ok = response.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                errors += 1

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - began


async def one_run(mode: str, index: int, args: argparse.Namespace) -> Run:
    with tempfile.TemporaryDirectory(prefix="fbx-tui-bench-") as tmp:
        box = BoxInTerminal(Path(tmp), tui=mode == "tui")
        try:
            connector = aiohttp.TCPConnector(limit=args.concurrency)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
                await wait_ready(http, box.port)
                if mode == "tui":
                    box.type(SCREEN_KEYS[args.screen])
                await load(http, box.port, args.concurrency, args.warmup)
                cpu_before = box.cpu_s()
                latencies, errors, seconds = await load(http, box.port, args.concurrency, args.seconds)
                cpu = box.cpu_s() - cpu_before
        finally:
            box.stop()
    latencies.sort()
    return Run(
        mode=mode,
        round=index,
        requests=len(latencies),
        errors=errors,
        seconds=round(seconds, 2),
        rps=round(len(latencies) / seconds, 1),
        p50_ms=round(latencies[len(latencies) // 2], 2) if latencies else 0.0,
        p99_ms=round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 2) if latencies else 0.0,
        box_cpu_s=round(cpu, 2),
    )


def report(runs: list[Run], args: argparse.Namespace) -> dict:
    console = Console()
    table = Table(title=f"serve vs serve --tui ({args.screen} screen): no-op model, HTTP, c={args.concurrency}")
    for column in ("round", "mode", "req/s", "p50 ms", "p99 ms", "errors", "box CPU µs/req"):
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            str(run.round),
            run.mode,
            f"{run.rps:.0f}",
            f"{run.p50_ms:.1f}",
            f"{run.p99_ms:.1f}",
            str(run.errors),
            f"{run.cpu_us_per_request:.0f}",
        )
    console.print(table)
    plain = [r for r in runs if r.mode == "plain"]
    tui = [r for r in runs if r.mode == "tui"]
    summary = {
        "plain_rps_median": statistics.median(r.rps for r in plain),
        "tui_rps_median": statistics.median(r.rps for r in tui),
        "plain_cpu_us_per_request_median": statistics.median(r.cpu_us_per_request for r in plain),
        "tui_cpu_us_per_request_median": statistics.median(r.cpu_us_per_request for r in tui),
    }
    summary["throughput_ratio"] = round(summary["tui_rps_median"] / summary["plain_rps_median"], 3)
    summary["cpu_per_request_ratio"] = round(
        summary["tui_cpu_us_per_request_median"] / summary["plain_cpu_us_per_request_median"], 3
    )
    verdict = "within" if summary["throughput_ratio"] >= 0.9 else "NOT within"
    console.print(
        f"median req/s: plain {summary['plain_rps_median']:.0f}, --tui {summary['tui_rps_median']:.0f}; "
        f"ratio [bold]{summary['throughput_ratio']:.3f}[/] ({verdict} the 10% target); "
        f"box CPU per request ratio {summary['cpu_per_request_ratio']:.3f}"
    )
    return summary


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--screen", choices=sorted(SCREEN_KEYS), default="fleet")
    parser.add_argument("--json", type=Path, help="write the runs and the summary here")
    args = parser.parse_args()
    runs = []
    for index in range(1, args.rounds + 1):
        order = ("plain", "tui") if index % 2 else ("tui", "plain")  # alternate who goes first
        for mode in order:
            runs.append(await one_run(mode, index, args))
    summary = report(runs, args)
    if args.json:
        machine = f"{platform.node()} · {platform.processor() or platform.machine()} · {os.cpu_count()} cpus"
        record = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine,
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": [asdict(r) | {"cpu_us_per_request": r.cpu_us_per_request} for r in runs],
            "summary": summary,
        }
        args.json.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    asyncio.run(main())
