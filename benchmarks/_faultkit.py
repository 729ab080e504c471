"""The pieces fault runs are built from: a routed NATS cluster on loopback, a box as a subprocess, and a
steady client that checks every answer it gets.

Shared by the long runs (`benchmarks/faults.py`) and their fast versions (`tests/test_nats_faults.py`).
The client is open-loop: it sends at a set rate whatever happens to the fleet, so a fault shows up as
latency and errors rather than as a client that politely slowed down. A request the gateway refused
(429, or 503 while NATS fails over) was never accepted; the client sends it again after Retry-After,
as a well-behaved client does, so in the end every logical request has exactly one final answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nats
import numpy as np
import psutil
from nats.js.api import StorageType, StreamConfig

from appliance.natsd import EmbeddedNats, free_port

ROOT = Path(__file__).resolve().parent.parent
NOOP_VECTOR = np.array([1.0] + [0.0] * 7, dtype=np.float32)  # what the no-op runtime answers for any input
REFUSED = (429, 503)  # not accepted: the client may send it again


def free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


async def wait_until(condition: Callable[[], object], timeout_s: float, what: str, period_s: float = 0.05) -> None:
    """Poll a condition (a plain or async callable) until it holds, bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        await asyncio.sleep(period_s)
    raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")


# -- NATS ------------------------------------------------------------------------------------------


class NatsCluster:
    """`size` nats-server processes with JetStream, routed into one cluster on loopback ports."""

    def __init__(self, base: Path, size: int = 3, name: str = "fbx") -> None:
        ports = free_ports(2 * size)
        client, route = ports[:size], ports[size:]
        self.names = [f"{name}-{i}" for i in range(size)]
        self.servers: list[EmbeddedNats] = []
        for i in range(size):
            routes = ",".join(f"nats://127.0.0.1:{port}" for j, port in enumerate(route) if j != i)
            extra = (
                "--server_name", self.names[i],
                "--cluster_name", name,
                "--cluster", f"nats://127.0.0.1:{route[i]}",
                "--routes", routes,
            )  # fmt: skip
            self.servers.append(EmbeddedNats(store_dir=base / self.names[i], port=client[i], extra_args=extra))

    @property
    def urls(self) -> str:
        """The `--nats` value for a box: every server, so a client fails over by itself."""
        return ",".join(server.url for server in self.servers)

    async def start(self, timeout_s: float = 30.0, *, wait_for_jetstream: bool = True) -> None:
        await asyncio.gather(*(server.start() for server in self.servers))
        if wait_for_jetstream:
            await self._wait_for_jetstream(timeout_s)

    async def _wait_for_jetstream(self, timeout_s: float) -> None:
        """Listening is not enough: wait until the cluster places a stream with a replica on every server."""
        nc = await nats.connect(servers=self.urls.split(","))
        js = nc.jetstream()
        probe = StreamConfig(
            name="FBX_PROBE", subjects=["fbx-probe"], storage=StorageType.MEMORY, num_replicas=len(self.servers)
        )

        async def placed() -> bool:
            try:
                await js.add_stream(probe)
                await js.delete_stream(probe.name)
                return True
            except Exception:  # not yet: no meta leader, or too few servers known
                return False

        try:
            await wait_until(placed, timeout_s, "the NATS cluster to place a replicated stream", period_s=0.25)
        finally:
            await nc.close()

    async def leader_of(self, stream: str) -> int:
        """Which server leads a stream (its index): the one whose death forces an election."""
        nc = await nats.connect(servers=self.urls.split(","))
        try:
            info = await nc.jetstream().stream_info(stream)
        finally:
            await nc.close()
        assert info.cluster is not None and info.cluster.leader is not None
        return self.names.index(info.cluster.leader)

    async def kill(self, index: int) -> None:
        """SIGKILL one server: no goodbye to its clients or its routes."""
        server = self.servers[index]
        process, server.process = server.process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

    async def stop(self) -> None:
        await asyncio.gather(*(server.stop() for server in self.servers))


# -- a box as a subprocess ---------------------------------------------------------------------


@dataclass(slots=True)
class BoxProcess:
    """`fleetbox serve` in its own process: the box a fault run can SIGKILL, or weigh (RSS)."""

    box_id: str
    http_port: int
    log_file: Path
    process: subprocess.Popen[bytes]

    @classmethod
    async def start(
        cls,
        state_dir: Path,
        box_id: str,
        config: str,
        *,
        nats_urls: str | None = None,
        role: str = "all",
        ready_timeout_s: float = 120.0,
    ) -> BoxProcess:
        """Start a box with `config` (TOML) and wait until its `/readyz` says ready."""
        box = cls.spawn(state_dir, box_id, config, nats_urls=nats_urls, role=role)
        try:
            await box.wait_ready(ready_timeout_s)
        except BaseException:
            box.kill()
            raise
        return box

    @classmethod
    def spawn(
        cls,
        state_dir: Path,
        box_id: str,
        config: str,
        *,
        nats_urls: str | None,
        role: str,
        env: dict[str, str] | None = None,
    ) -> BoxProcess:
        """Start `fleetbox serve`; `env` adds to (or overrides) the box's environment (quiet logs by default)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        config_file = state_dir / "box.toml"
        config_file.write_text(config)
        http_port = free_port()
        args = [
            sys.executable, "-m", "appliance.cli", "serve",
            "--box-id", box_id, "--role", role, "--port", str(http_port),
            "--state-dir", str(state_dir), "--config", str(config_file),
        ]  # fmt: skip
        args += ["--nats", nats_urls] if nats_urls else ["--nats-port", str(free_port())]
        log_file = state_dir / "box.log"
        box_env = {**os.environ, "FBX_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with log_file.open("wb") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env={**box_env, **(env or {})}, cwd=ROOT
            )
        return cls(box_id, http_port, log_file, process)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def wait_ready(self, timeout_s: float) -> None:
        """Until `/readyz` says ready; raises (with the log's tail) if the box exits or is not ready in time."""
        try:
            await wait_until(self._ready, timeout_s, f"box {self.box_id} to be ready", period_s=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_file.read_text(errors="replace")[-chars:]

    async def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"box {self.box_id} exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{self.url}/readyz") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    def kill(self) -> None:
        """SIGKILL: the box gets no chance to hand anything back (its embedded NATS, if any, lives on)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the box holds what it pulled and can neither answer nor ack it."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def terminate(self, timeout_s: float = 20.0) -> None:
        """SIGTERM and wait: the box stops as an operator's would, its embedded NATS too; SIGKILL past `timeout_s`."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    async def stop(self, timeout_s: float = 20.0) -> None:
        await asyncio.to_thread(self.terminate, timeout_s)

    def rss_bytes(self) -> int:
        """Resident memory of the box and its children (the embedded nats-server)."""
        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    async def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample of the box's Prometheus metrics (0 when absent)."""
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/metrics") as response:
            text = await response.text()
        return metric_value(text, name, labels)


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    wanted = [f'{key}="{value}"' for key, value in (labels or {}).items()]
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the client --------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One logical request, from its first attempt to its final answer."""

    index: int
    model: str
    text: str
    sent_at: float = 0.0  # loop time of the first attempt
    status: int = 0  # the final answer's HTTP status; 0: no answer (connection error)
    latency_s: float = 0.0  # first attempt to final answer
    refused: int = 0  # 429/503 answers before the final one
    retry_after: list[int] = field(default_factory=list)  # the Retry-After of each 429
    box: str = ""
    code: str = ""  # a non-200 answer's error code
    vector: np.ndarray | None = None


class SteadyLoad:
    """Sends one request every 1/rate s to a gateway, each with its own input, and keeps every outcome."""

    def __init__(
        self,
        base_url: str,
        rate_per_s: float,
        *,
        model: str | Callable[[int], str] = "noop",
        timeout_s: float = 30.0,
        retry_refused: bool = True,
    ) -> None:
        self._url = f"{base_url}/v1/embeddings"
        self._interval = 1.0 / rate_per_s
        self._model = model if callable(model) else (lambda _i: model)
        self._timeout_s = timeout_s
        self._retry = retry_refused
        self.outcomes: list[Outcome] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self.sent_all = asyncio.Event()  # set when the last request has been sent (answers may still come)
        self._session: aiohttp.ClientSession | None = None

    async def run(self, duration_s: float) -> list[Outcome]:
        """Send for `duration_s` (or until `stop()`), then wait for every answer."""
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self._timeout_s + 30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as self._session:
            loop = asyncio.get_running_loop()
            started = loop.time()
            index = 0
            while not self._stop.is_set() and loop.time() - started < duration_s:
                outcome = Outcome(index, self._model(index), f"request {index}: {sentence(index)}")
                self.outcomes.append(outcome)
                self._tasks.append(asyncio.create_task(self._one(outcome)))
                index += 1
                pause = started + index * self._interval - loop.time()
                if pause > 0:
                    try:  # pace the sends; a stop ends the wait early
                        async with asyncio.timeout(pause):
                            await self._stop.wait()
                    except TimeoutError:
                        pass
            self.sent_all.set()
            await asyncio.gather(*self._tasks)
        return self.outcomes

    def stop(self) -> None:
        self._stop.set()

    async def _one(self, outcome: Outcome) -> None:
        assert self._session is not None
        loop = asyncio.get_running_loop()
        outcome.sent_at = loop.time()
        body = {"model": outcome.model, "input": outcome.text, "timeout": self._timeout_s}
        while True:
            try:
                async with self._session.post(self._url, json=body) as response:
                    outcome.status = response.status
                    outcome.box = response.headers.get("Fbx-Box", "")
                    payload = await response.json(content_type=None)
                    retry_after = int(response.headers.get("Retry-After", "0") or 0)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                outcome.status, outcome.code = 0, type(exc).__name__
                break
            if response.status == 200:
                outcome.vector = np.asarray(payload["data"][0]["embedding"], dtype=np.float32)
                outcome.code = ""
                break
            outcome.code = str((payload.get("error") or {}).get("code", "")) if isinstance(payload, dict) else ""
            if response.status == 429:
                outcome.retry_after.append(retry_after)
            spent = loop.time() - outcome.sent_at
            if not (self._retry and response.status in REFUSED and spent < self._timeout_s):
                break
            outcome.refused += 1
            await asyncio.sleep(min(max(retry_after, 0.1), 1.0))
        outcome.latency_s = loop.time() - outcome.sent_at


def sentence(index: int) -> str:
    """A distinct, deterministic input per request index."""
    words = ("queue", "box", "fleet", "vector", "reply", "batch", "model", "river", "garden", "signal", "stone")
    return " ".join(words[(index * (k + 3) + k * k) % len(words)] for k in range(6 + index % 9))


# -- judging the answers -------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Tally:
    """What happened to every logical request of a run."""

    requests: int
    ok: int  # answered 200 with the right vector
    wrong: int  # answered 200 with a wrong vector
    lost: int  # accepted, and then no 200 (a deadline, an error, no answer)
    refused_attempts: int  # 429/503 answers the client retried (never accepted)
    p50_s: float  # latency from first attempt to final answer, over every request
    p99_s: float
    max_s: float
    statuses: dict[int, int]


def tally(outcomes: list[Outcome], expected: Callable[[Outcome], np.ndarray]) -> Tally:
    ok = wrong = lost = 0
    statuses: dict[int, int] = {}
    for outcome in outcomes:
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
        if outcome.status != 200:
            lost += 1
        elif outcome.vector is not None and cosine(outcome.vector, expected(outcome)) >= 0.9999:
            ok += 1
        else:
            wrong += 1
    latencies = sorted(o.latency_s for o in outcomes) or [0.0]  # every final answer, a lost one's too
    return Tally(
        requests=len(outcomes),
        ok=ok,
        wrong=wrong,
        lost=lost,
        refused_attempts=sum(o.refused for o in outcomes),
        p50_s=percentile(latencies, 0.50),
        p99_s=percentile(latencies, 0.99),
        max_s=latencies[-1],
        statuses=statuses,
    )


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return -1.0
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) or 1.0))


def noop_expected(_outcome: Outcome) -> np.ndarray:
    return NOOP_VECTOR
