"""Which models are loaded on this box, and loading them once.

Loads are single-flight: any number of concurrent `ensure_loaded` calls for one cold model cause
one load, in a thread, and all of them get the same runtime. Each resident model carries its
measured bytes (weights plus the warm-up activation peak), the figure eviction will budget by.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass

from appliance.catalog import ModelSpec
from appliance.metrics import Metrics
from runtimes import Runtime, load_runtime

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Resident:
    spec: ModelSpec
    runtime: Runtime
    loaded_at: float
    last_used: float

    @property
    def nbytes(self) -> int:
        return self.runtime.info.nbytes


class Residency:
    def __init__(self, device: str, threads: int | None, metrics: Metrics, executor: Executor) -> None:
        self.device = device
        self._threads = threads
        self._metrics = metrics
        self._executor = executor
        self._resident: dict[str, Resident] = {}
        self._loading: dict[str, asyncio.Future[Runtime]] = {}

    def get(self, name: str) -> Resident | None:
        return self._resident.get(name)

    def residents(self) -> list[Resident]:
        return list(self._resident.values())

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    async def ensure_loaded(self, spec: ModelSpec) -> Runtime:
        resident = self._resident.get(spec.name)
        if resident is not None:
            resident.last_used = time.monotonic()
            return resident.runtime
        pending = self._loading.get(spec.name)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Runtime] = asyncio.get_running_loop().create_future()
        self._loading[spec.name] = future
        try:
            runtime = await self._load(spec)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: the caller re-raises it
            raise
        finally:
            self._loading.pop(spec.name, None)
        future.set_result(runtime)
        return runtime

    async def _load(self, spec: ModelSpec) -> Runtime:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        log.info("loading model", extra={"model": spec.name, "device": self.device})
        runtime = await loop.run_in_executor(self._executor, load_runtime, spec.source(self.device, self._threads))
        seconds = time.perf_counter() - started
        now = time.monotonic()
        self._resident[spec.name] = Resident(spec, runtime, loaded_at=now, last_used=now)
        self._metrics.loads.labels(spec.name).inc()
        self._metrics.load_seconds.labels(spec.name).observe(seconds)
        self._metrics.resident_bytes.labels(spec.name).set(runtime.info.nbytes)
        log.info(
            "model resident",
            extra={"model": spec.name, "bytes": runtime.info.nbytes, "seconds": round(seconds, 2)},
        )
        return runtime

    async def evict(self, name: str) -> bool:
        resident = self._resident.pop(name, None)
        if resident is None:
            return False
        await asyncio.get_running_loop().run_in_executor(self._executor, resident.runtime.close)
        self._metrics.resident_bytes.remove(name)
        log.info("model evicted", extra={"model": name})
        return True

    async def close(self) -> None:
        for name in list(self._resident):
            await self.evict(name)
