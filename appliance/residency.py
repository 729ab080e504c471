"""Which models are loaded on this box's device, within a byte budget, and loading them once.

The eviction rule: before a load, estimate the newcomer's bytes (the weight files it reads, scaled
by dtype) and evict unpinned models until it fits: idle ones before those with requests in hand, and
among them first the one whose bytes will wait longest for their next request (`eviction.py`:
how long since it was last used, or the gap between requests its demand says, if longer); none in its
turn: a model loaded for requests serves for a while before it may go, the load waiting for that. When
the loads in flight hold the room that evicting every unpinned model could not free, the load waits
for them to land rather than evict for nothing. A model that cannot fit even with every unpinned
model gone is refused (507).
Once loaded, a model's bytes are the measured ones: weights plus the activation peak seen at
warm-up. The estimate can be far off (float16 weight files loaded as float32, a long context's
activations), so the measured bytes are judged again by the same rule before the model becomes
resident: evict for them, or unload the model and refuse it (507), remembering its measured size
so the next try is refused unloaded. Loads are single-flight: any number of concurrent
`ensure_loaded` calls for one cold model cause one load, in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.adapters import AdapterHold, BaseAdapters
from appliance.catalog import ModelSpec
from appliance.errors import InsufficientMemory, reason_of
from appliance.eviction import Demand, EvictionOrder
from appliance.metrics import Metrics
from appliance.model_bytes import estimate_bytes, size_text
from runtimes import Runtime, RuntimeKind, UnsupportedModel, load_runtime, released_together
from runtimes.base import AdapterHost

log = logging.getLogger(__name__)

_PROTECTION_POLL_S = 0.1  # a load waiting for a model's turn to end looks again this often (one may go idle sooner)
_LANDING_POLL_S = 1.0  # a load waiting for loads in flight to land looks again this often (an eviction may free room)


@dataclass(slots=True)
class Resident:
    spec: ModelSpec
    runtime: Runtime
    loaded_at: float
    last_used: float
    adapters: BaseAdapters | None = None  # its LoRA adapters, once one was asked for
    load_s: float = 0.0  # how long its load took
    first_used: float | None = None  # its first answer (`touch`) since it was loaded

    @property
    def nbytes(self) -> int:
        return self.runtime.info.nbytes


class Residency:
    def __init__(
        self,
        device: str,
        threads: int | None,
        budget_bytes: int,
        metrics: Metrics,
        executor: Executor,
        before_evict: Callable[[str], Awaitable[None]] | None = None,
        in_use: Callable[[str], bool] | None = None,
        max_adapters: int = 8,
        onnx_cache: Path | None = None,
        min_serve_s: float = 2.0,
        first_answer_s: float = 10.0,
    ) -> None:
        self.device = device
        self.budget_bytes = budget_bytes
        self._threads = threads
        self._metrics = metrics
        self._executor = executor
        self._before_evict = before_evict
        self._order = EvictionOrder(in_use or (lambda name: False), min_serve_s, first_answer_s)
        self._resident: dict[str, Resident] = {}
        self._loading: dict[str, asyncio.Future[Runtime]] = {}
        self._loading_specs: dict[str, ModelSpec] = {}  # what each load in `_loading` loads
        self._evicting: dict[str, asyncio.Event] = {}  # set once the model is gone
        self._room_lock = asyncio.Lock()
        self._reserved: dict[str, int] = {}  # estimated bytes of models being loaded
        self._max_adapters = max_adapters
        self._onnx_cache = onnx_cache
        # model -> why its last load on this box failed, what that load depended on (`ModelSpec.load_key`), and when
        # (unix s: the heartbeat says it, so the fleet's readers see a load that failed between two beats)
        self._load_errors: dict[str, tuple[str, tuple[object, ...], float]] = {}
        # model -> the bytes a load of it measured when that was refused, and what that load depended on
        self._measured: dict[str, tuple[int, tuple[object, ...]]] = {}
        self.pinned: set[str] = set()

    def get(self, name: str) -> Resident | None:
        return self._resident.get(name)

    def residents(self) -> list[Resident]:
        return list(self._resident.values())

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def is_loading(self, name: str) -> bool:
        return name in self._loading

    def load_error(self, name: str) -> str | None:
        """Why the last load of `name` on this box failed; None when it succeeded or none was tried."""
        failed = self._load_errors.get(name)
        return failed[0] if failed is not None else None

    def _load_failed(self, name: str, why: str, load_key: tuple[object, ...]) -> None:
        """The same failure again (a pinned model's load retried each 30 s) keeps its first time: restamped, the
        heartbeat's newest-16 cut took turns over more, each back as news to the TUI (review h219)."""
        failed = self._load_errors.get(name)
        at = failed[2] if failed is not None and failed[:2] == (why, load_key) else time.time()
        self._load_errors[name] = (why, load_key, at)

    def load_failures(self) -> list[tuple[str, str, float]]:
        """(model, why, when) of each model whose last load on this box failed, newest first."""
        failures = [(name, why, at) for name, (why, _, at) in self._load_errors.items()]
        return sorted(failures, key=lambda failure: -failure[2])

    def forget_load_error(self, name: str, spec: ModelSpec | None) -> None:
        """The catalog says `name` is now `spec` (None: deleted): a failed load of another `load_key` is not its."""
        failed = self._load_errors.get(name)
        if failed is not None and (spec is None or spec.load_key() != failed[1]):
            del self._load_errors[name]
        measured = self._measured.get(name)
        if measured is not None and (spec is None or spec.load_key() != measured[1]):
            del self._measured[name]
        if spec is None:
            self._order.forget(name)

    @property
    def used_bytes(self) -> int:
        """Bytes of resident models plus the estimates of those loading."""
        return sum(r.nbytes for r in self._resident.values()) + sum(self._reserved.values())

    def _pinned_bytes(self) -> int:
        """Bytes of the resident pinned models: what no eviction frees."""
        return sum(r.nbytes for r in self._resident.values() if r.spec.name in self.pinned)

    def touch(self, name: str, answered: int = 0) -> None:
        """`name` was used now (a decode step, an answer), for its turn and the eviction's order; `answered`: the
        requests it finished, its demand (a decode step is not one more request)."""
        resident = self._resident.get(name)
        if resident is not None:
            now = time.monotonic()
            resident.last_used = now
            if resident.first_used is None:
                resident.first_used = now
            if answered:
                self._order.answered(name, answered, now)

    def demand(self, name: str) -> Demand | None:
        return self._order.demand(name)

    async def check_fits(self, spec: ModelSpec) -> None:
        """Refuse (507) a model that could never fit, even with every unpinned model evicted, beside the pinned
        models loading here too (by their estimates): counting the resident ones only, a second pinned model
        registered while the first loaded was let in and never loaded (regression tester h53)."""
        loading = [s for name, s in self._loading_specs.items() if name in self.pinned and name != spec.name]
        estimates = {other.name: await self._estimate(other) for other in loading}
        need = await self._estimate(spec)
        # Read after the awaits: a model that became resident meanwhile is counted among the resident pinned, and
        # was counted twice (review h178: a pin refused on a box with room for both).
        pending = sum(
            estimate
            for name, estimate in estimates.items()
            if name in self._loading_specs and name not in self._resident and name in self.pinned
        )
        self._check_fits(spec, need, pending=pending)

    async def _estimate(self, spec: ModelSpec) -> int:
        """The bytes a load of `spec` is judged by: its estimate, or what a refused load of it measured, if more."""
        estimate = await asyncio.get_running_loop().run_in_executor(None, estimate_bytes, spec)  # a walk of its folder
        measured = self._measured.get(spec.name)
        if measured is not None and measured[1] == spec.load_key():
            return max(estimate, measured[0])
        return estimate

    def _check_fits(self, spec: ModelSpec, need: int, *, measured: bool = False, pending: int = 0) -> None:
        held = self._pinned_bytes() + pending
        if need > self.budget_bytes - held:
            size = (
                f"measured {size_text(need)} loaded (weights and warm-up activations)"
                if measured
                else f"needs about {size_text(need)}"
            )
            budget = f"this box's budget is {size_text(self.budget_bytes)} with {size_text(held)} pinned"
            raise InsufficientMemory(
                f"model {spec.name} {size}; {budget}",
                need_bytes=need,
            )

    async def ensure_loaded(self, spec: ModelSpec) -> Runtime:
        while (evicting := self._evicting.get(spec.name)) is not None:
            await evicting.wait()  # a runtime being closed must not be handed out: load it afresh after
        resident = self._resident.get(spec.name)
        if resident is not None:
            resident.last_used = time.monotonic()
            return resident.runtime
        pending = self._loading.get(spec.name)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Runtime] = asyncio.get_running_loop().create_future()
        self._loading[spec.name] = future
        self._loading_specs[spec.name] = spec
        try:
            runtime = await self._load(spec)
        except BaseException as exc:
            if isinstance(exc, Exception):
                self._load_failed(spec.name, reason_of(exc), spec.load_key())
            future.set_exception(exc)
            future.exception()  # retrieved here: each waiter re-raises it
            raise
        finally:
            self._loading.pop(spec.name, None)
            self._loading_specs.pop(spec.name, None)
        # The last failure stands until a load succeeds: a try again after it is no news yet (cleared as it began,
        # a pin during it named no failure, and `/readyz` counted the model as not resident yet while it ran).
        self._load_errors.pop(spec.name, None)
        future.set_result(runtime)
        return runtime

    async def _load(self, spec: ModelSpec) -> Runtime:
        estimate = await self._estimate(spec)
        while True:
            async with self._room_lock:
                self._check_fits(spec, estimate)
                landing = self._landing(estimate)
                if not landing:
                    await self._make_room(estimate, keep=spec.name)
                    # Reserved until it lands, so a second load in flight makes room for this one too.
                    self._reserved[spec.name] = estimate
                    break
            # Not under the lock: they take it to land.
            await asyncio.wait(landing, timeout=_LANDING_POLL_S, return_when=asyncio.FIRST_COMPLETED)
        try:
            started = time.perf_counter()
            runtime = await self._load_runtime(spec)
            load_s = time.perf_counter() - started  # not the wait for the room lock below: another load's turn
            try:
                async with self._room_lock:
                    await self._room_for_loaded(spec, runtime, load_s)
            except BaseException:
                # Shielded: a load cancelled while it waited for room still frees what it loaded.
                await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, runtime.close))
                raise
        finally:
            self._reserved.pop(spec.name, None)
        log.info(
            "model resident",
            extra={
                "model": spec.name,
                "bytes": runtime.info.nbytes,
                "seconds": round(time.perf_counter() - started, 2),
            },
        )
        return runtime

    async def _load_runtime(self, spec: ModelSpec) -> Runtime:
        """Load and warm up `spec`'s runtime in a thread; it is not resident yet (`_room_for_loaded`)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        log.info("loading model", extra={"model": spec.name, "device": self.device})
        source = spec.source(self.device, self._threads)
        if spec.runtime is RuntimeKind.ONNX and self._onnx_cache is not None and "cache_dir" not in source.options:
            source = replace(source, options={**source.options, "cache_dir": str(self._onnx_cache)})
        runtime = await loop.run_in_executor(self._executor, load_runtime, source)
        self._metrics.loads.labels(spec.name).inc()
        self._metrics.load_seconds.labels(spec.name).observe(time.perf_counter() - started)
        return runtime

    async def _room_for_loaded(self, spec: ModelSpec, runtime: Runtime, load_s: float) -> None:
        """Judge a loaded model's measured bytes as its estimate was judged, then make it resident (under the room
        lock). Evict for them; or, when even every unpinned model gone would leave too little room, refuse it (507,
        and the caller unloads it): its size is remembered, so the next try is refused before anything is loaded.
        Until this returns, `ensure_loaded` callers wait on the load: none is handed a runtime that may be closed."""
        measured = runtime.info.nbytes
        self._reserved[spec.name] = measured
        try:
            self._check_fits(spec, measured, measured=True)
        except InsufficientMemory:
            self._measured[spec.name] = (measured, spec.load_key())
            log.warning("loaded model refused: over the memory budget", extra={"model": spec.name, "bytes": measured})
            raise
        await self._make_room(0, keep=spec.name)
        now = time.monotonic()
        self._resident[spec.name] = Resident(spec, runtime, loaded_at=now, last_used=now, load_s=load_s)
        self._reserved.pop(spec.name, None)  # with the entry: its bytes are counted once
        self._measured.pop(spec.name, None)
        self._metrics.resident_bytes.labels(spec.name).set(measured)

    def _landing(self, need: int) -> set[asyncio.Future[Runtime]]:
        """The loads in flight to wait for before making room for `need` bytes: all of them, when the room they
        hold is what keeps it out even with every unpinned model evicted; none otherwise. Evicting then was for
        nothing (the load went ahead over the budget all the same): a 0.4 MiB generator answering most requests was
        evicted 20 times so, beside a pinned model alone (tester h98)."""
        if not self._reserved:
            return set()
        if self._pinned_bytes() + sum(self._reserved.values()) + need <= self.budget_bytes:
            return set()
        return {self._loading[name] for name in self._reserved if name in self._loading}

    async def _make_room(self, need: int, keep: str) -> None:
        """Evict unpinned models (`_victim`) until `need` more bytes fit in the budget.

        Models already on their way out (an evict asked meanwhile) still count until closed; when their
        leaving is enough, wait for it rather than evict one more model.
        """
        while self.used_bytes + need > self.budget_bytes:
            leaving = {name: gone for name, gone in self._evicting.items() if name in self._resident}
            freed = sum(self._resident[name].nbytes for name in leaving)
            if leaving and self.used_bytes - freed + need <= self.budget_bytes:
                await asyncio.gather(*(gone.wait() for gone in leaving.values()))
                continue
            victim = self._victim(keep, shortfall=self.used_bytes - freed + need - self.budget_bytes)
            if victim is None:
                return  # check_fits left room beside the pinned models; loads in flight hold the rest for now
            now = time.monotonic()
            if self._order.in_its_turn(victim, now):  # so is every other: wait for one's turn to end, not evict it
                await asyncio.sleep(min(_PROTECTION_POLL_S, self._order.turn_ends(victim) - now))
                continue
            await self.evict(victim.spec.name, reason="budget")

    def _victim(self, keep: str, shortfall: int = 0) -> Resident | None:
        """The model that may be evicted for `keep` (not pinned, not already on its way out) that goes first, to free
        `shortfall` bytes (`EvictionOrder.first`)."""
        candidates = [
            r
            for r in self._resident.values()
            if r.spec.name not in self.pinned and r.spec.name != keep and r.spec.name not in self._evicting
        ]
        return self._order.first(candidates, shortfall)

    async def hold_adapter(self, base: str, adapter: ModelSpec) -> AdapterHold:
        """A LoRA adapter's registration loaded onto its resident base (once), and kept loaded until the hold is
        released (appliance/adapters.py); `hold.key` is its name in the runtime."""
        table = self._adapters(base)
        try:
            hold = AdapterHold(table, await table.acquire(adapter, hold=True))
        except UnsupportedModel as exc:  # its folder does not load onto the base: its record says why (h102)
            self._load_failed(adapter.name, str(exc), adapter.load_key())
            raise
        self._load_errors.pop(adapter.name, None)
        return hold

    def retire_adapter(self, name: str, keep: ModelSpec | None = None) -> None:
        """Adapter `name` was deleted (or `keep` is its registration now): unload the old one wherever it is."""
        for resident in self._resident.values():
            if resident.adapters is not None:
                resident.adapters.retire(name, keep)

    def adapter_names(self, base: str) -> list[str]:
        """The adapters loaded and servable on a resident base."""
        resident = self._resident.get(base)
        return resident.adapters.names() if resident is not None and resident.adapters is not None else []

    def _adapters(self, base: str) -> BaseAdapters:
        resident = self._resident.get(base)
        if resident is None:
            raise KeyError(base)
        if resident.adapters is None:
            host = resident.runtime
            if not isinstance(host, AdapterHost):
                raise UnsupportedModel(
                    f"model {base} runs on the {resident.spec.runtime} runtime, which takes no LoRA adapters"
                )
            resident.adapters = BaseAdapters(base, host, self._max_adapters, self._executor, self._metrics)
        resident.last_used = time.monotonic()
        return resident.adapters

    async def evict_for_oom(self, keep: str) -> bool:
        """Free memory after an out-of-memory error: evict the unpinned model other than `keep` that a load would evict
        first (`_victim`).

        Not while `keep` is itself being evicted: its eviction waits for this very batch, and two
        models each evicting the other for a failing batch would wait on each other for ever.
        """
        victim = None if keep in self._evicting else self._victim(keep)
        if victim is None:
            return False
        await self.evict(victim.spec.name, reason="oom")
        return True

    async def evict(self, name: str, reason: str = "request") -> bool:
        """Unload a model (its worker drained first); True once it is gone, also when another eviction took it."""
        ongoing = self._evicting.get(name)
        if ongoing is not None:
            await ongoing.wait()
            return name not in self._resident
        if name not in self._resident:
            return False
        self._evicting[name] = gone = asyncio.Event()
        try:
            if self._before_evict is not None:
                await self._before_evict(name)
            resident = self._resident.pop(name, None)
            if resident is None:
                return False
            self._metrics.resident_bytes.remove(name)  # with the entry: the gauge and is_resident never disagree
            if resident.adapters is not None:
                resident.adapters.close()
            await asyncio.get_running_loop().run_in_executor(self._executor, resident.runtime.close)
        finally:
            del self._evicting[name]
            gone.set()
        self._metrics.evictions.labels(name, reason).inc()
        log.info("model evicted", extra={"model": name, "reason": reason, "bytes": resident.nbytes})
        return True

    async def close(self) -> None:
        """The box stopping: every model unloaded, their memory collected once after the last."""
        with released_together():
            for name in list(self._resident):
                await self.evict(name, reason="shutdown")
