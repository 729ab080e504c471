"""The LoRA adapters loaded on one resident base model: which are loaded, which requests hold, which to unload.

The eviction rule: past `max_adapters`, the least recently used adapter no request holds is unloaded to
make room; when every loaded adapter is held, the newcomer loads anyway (the cap counts idle adapters
only), so a valid request never fails because other requests keep their adapters busy, and an adapter
is never unloaded under a request that will run with it.

An adapter is known by its registration, name and folder: a name deleted from the catalog, or
registered again on another folder, retires the loaded one, which is unloaded once nothing holds it.
A registration loaded while an older one of its name is still held loads beside it. The runtime knows each
load by a key of its own (`fbx-adapter-N`, never reused on a base), not by the adapter's name: `name#2` was
also a name another adapter may have, whose weights it was then served. `acquire` hands the key back.
A loaded adapter whose folder is gone from the box is not listed servable: its requests are refused (503) before
they reach it, so the heartbeat and the model list said it was there while each request failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass

from appliance.catalog import ModelSpec
from appliance.errors import ServiceUnavailable
from appliance.metrics import Metrics
from runtimes import UnknownAdapter
from runtimes.base import AdapterConflict, AdapterHost, AdapterInUse

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.25  # a retired adapter the runtime refused to unload (a generation runs with it) is tried again
RETRY_MOST_S = 5.0  # ... after this long, doubling up to this: a generation ends nothing tells this table


@dataclass(slots=True, eq=False)
class LoadedAdapter:
    spec: ModelSpec  # the registration it was loaded from
    key: str  # its name in the runtime, unique to this load
    last_used: float
    holders: int = 0
    retired: bool = False  # deleted or registered again elsewhere: unloaded once nothing holds it


class AdapterHold:
    """A request's claim on a loaded adapter: not unloaded until released (once) or its base goes."""

    __slots__ = ("_adapters", "_entry")

    def __init__(self, adapters: BaseAdapters, entry: LoadedAdapter) -> None:
        self._adapters: BaseAdapters | None = adapters
        self._entry = entry

    @property
    def key(self) -> str:
        return self._entry.key

    @property
    def loaded(self) -> LoadedAdapter:
        """The load held: `retired` once the adapter is deleted or registered again on another folder."""
        return self._entry

    def release(self) -> None:
        if self._adapters is not None:
            self._adapters.release(self._entry)
            self._adapters = None


class BaseAdapters:
    """The adapter table of one resident base; loads and unloads on it run one at a time."""

    def __init__(self, base: str, host: AdapterHost, max_adapters: int, executor: Executor, metrics: Metrics) -> None:
        self._base = base
        self._host = host
        self._max = max_adapters
        self._executor = executor
        self._metrics = metrics
        self._entries: dict[str, LoadedAdapter] = {}  # runtime key -> entry
        self._in_flight: set[LoadedAdapter] = set()  # loading, or out of `_entries` while being unloaded
        # Per adapter name: how many times it was retired, and the registration the last retirement kept. A load
        # that waited for the lock while its adapter was deleted is marked retired by it too.
        self._retirements: dict[str, tuple[int, ModelSpec | None]] = {}
        self._lock = asyncio.Lock()
        self._keys = itertools.count(1)
        self._sweeps: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._retry_s = RETRY_FIRST_S
        self._closed = False

    def names(self) -> list[str]:
        """The registrations loaded here and servable (for the heartbeat): not retired, their folder still here."""
        return sorted({e.spec.name for e in self._entries.values() if not e.retired and missing_folder(e.spec) is None})

    async def acquire(self, spec: ModelSpec, hold: bool) -> LoadedAdapter:
        """The loaded entry for this registration (loaded now if need be); with `hold`, held until released."""
        entry = self._current(spec)
        if entry is None:
            seen = self._retirements.get(spec.name, (0, None))[0]
            async with self._lock:
                entry = self._current(spec) or await self._load(spec, seen)
                self._use(entry, hold)  # under the lock: no eviction can come between
                return entry
        self._use(entry, hold)
        return entry

    def _use(self, entry: LoadedAdapter, hold: bool) -> None:
        entry.last_used = time.monotonic()
        if hold:
            entry.holders += 1

    def release(self, entry: LoadedAdapter) -> None:
        entry.holders -= 1
        if entry.retired and entry.holders == 0:
            self._sweep_soon()

    def retire(self, name: str, keep: ModelSpec | None = None) -> None:
        """Adapter `name` left the catalog (or `keep` is its registration now): unload what else was loaded."""
        count = self._retirements.get(name, (0, None))[0]
        self._retirements[name] = (count + 1, keep)
        for entry in [*self._entries.values(), *self._in_flight]:  # in flight too: marked for when it is back
            if entry.spec.name == name and (keep is None or not _same_registration(entry.spec, keep)):
                entry.retired = True
        self._sweep_soon()

    def close(self) -> None:
        """The base is going: its runtime takes its adapters with it, so nothing more is unloaded here."""
        self._closed = True
        for sweep in self._sweeps:
            sweep.cancel()
        if self._retry is not None:
            self._retry.cancel()

    def _current(self, spec: ModelSpec) -> LoadedAdapter | None:
        for entry in self._entries.values():
            if not entry.retired and _same_registration(entry.spec, spec):
                return entry
        return None

    async def _load(self, spec: ModelSpec, seen: int) -> LoadedAdapter:
        """Load a registration; `seen`: its name's retirements when the request asked (before the lock)."""
        await self._make_room()
        key = self._new_key()
        entry = LoadedAdapter(spec, key, last_used=time.monotonic())
        count, keep = self._retirements.get(spec.name, (0, None))
        if count != seen and (keep is None or not _same_registration(spec, keep)):
            entry.retired = True  # deleted while this request waited for another load: it has it, then it goes
        self._in_flight.add(entry)
        try:
            await self._load_beside_others(entry)
        finally:
            self._in_flight.discard(entry)
        self._entries[key] = entry
        if entry.retired:  # deleted while it loaded: the request that asked has it, then it goes
            self._sweep_soon()
        self._metrics.loads.labels(spec.name).inc()
        log.info("adapter loaded", extra={"model": self._base, "adapter": spec.name})
        return entry

    async def _load_beside_others(self, entry: LoadedAdapter) -> None:
        """Load the entry's adapter; where adapters loaded here are in its way (`AdapterConflict`: peft wraps a module
        one way for them and another for it), unload those no request holds and load it then. One held keeps it
        out for now: a 503 to retry, not the 422 of an adapter trained for another base (h62: two valid adapters
        refused each other, whichever loaded second)."""
        load = self._host.load_adapter
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, load, entry.key, entry.spec.path)
            return
        except AdapterConflict as conflict:
            in_the_way = [self._entries[key] for key in conflict.adapters if key in self._entries]
            if len(in_the_way) < len(conflict.adapters) or any(other.holders for other in in_the_way):
                raise self._kept_out(entry, in_the_way) from None
            for other in in_the_way:
                if not await self._unload(other, "adapter_conflict"):
                    raise self._kept_out(entry, in_the_way) from None
        await loop.run_in_executor(self._executor, load, entry.key, entry.spec.path)

    def _kept_out(self, entry: LoadedAdapter, in_the_way: list[LoadedAdapter]) -> ServiceUnavailable:
        names = ", ".join(sorted({other.spec.name for other in in_the_way})) or "another adapter"
        return ServiceUnavailable(
            f"LoRA adapter {entry.spec.name} cannot be loaded on {self._base} beside {names}, which requests are "
            "using now (peft wraps a module they share one way for them and another for it); try again once they end",
            retry_after_s=1,
        )

    def _new_key(self) -> str:
        """A runtime name no load on this base had: not the adapter's name, which another load may still use."""
        taken = {*self._entries, *(e.key for e in self._in_flight), *self._host.adapters}
        return next(key for key in (f"fbx-adapter-{n}" for n in self._keys) if key not in taken)

    async def _make_room(self) -> None:
        """Unload retired adapters nothing holds, then idle ones, least recently used first, down to the cap."""
        for entry in [e for e in self._entries.values() if e.retired and e.holders == 0]:
            await self._unload(entry, "request")
        busy: set[str] = set()  # held by a generating request, as only the runtime knows
        while len(self._entries) >= self._max:
            idle = [e for e in self._entries.values() if e.holders == 0 and e.key not in busy]
            if not idle:
                return  # every one is in use: the newcomer loads past the cap
            victim = min(idle, key=lambda e: (not e.retired, e.last_used))
            if not await self._unload(victim, "adapter_lru"):
                busy.add(victim.key)

    async def _unload(self, entry: LoadedAdapter, reason: str) -> bool:
        """Unload one adapter (under the lock); False when the runtime refuses because a request runs with it."""
        del self._entries[entry.key]  # before the wait: no request may find it while it goes
        self._in_flight.add(entry)
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._host.evict_adapter, entry.key)
        except AdapterInUse:
            self._entries[entry.key] = entry
            if entry.retired:
                self._retry_later()
            return False
        except UnknownAdapter:
            pass  # gone with a closed runtime
        except Exception as exc:  # not a refusal to wait out: the runtime holds it no more, as far as it can tell
            log.warning(
                "adapter unload failed; forgotten",
                extra={"model": self._base, "adapter": entry.spec.name, "error": repr(exc)},
            )
        finally:
            self._in_flight.discard(entry)
        self._metrics.evictions.labels(entry.spec.name, reason).inc()
        log.info("adapter unloaded", extra={"model": self._base, "adapter": entry.spec.name, "reason": reason})
        return True

    def _sweep_soon(self) -> None:
        if self._closed:
            return
        sweep = asyncio.get_running_loop().create_task(self._sweep(), name=f"adapters:{self._base}")
        self._sweeps.add(sweep)
        sweep.add_done_callback(self._sweeps.discard)

    def _retry_later(self) -> None:
        """Sweep again later: nothing else would once the generation holding a retired adapter ends."""
        if self._closed or self._retry is not None:
            return
        self._retry = asyncio.get_running_loop().call_later(self._retry_s, self._retried)
        self._retry_s = min(2 * self._retry_s, RETRY_MOST_S)

    def _retried(self) -> None:
        self._retry = None
        self._sweep_soon()

    async def _sweep(self) -> None:
        async with self._lock:
            if self._closed:
                return
            retired = [e for e in self._entries.values() if e.retired and e.holders == 0]
            if all([await self._unload(entry, "request") for entry in retired]):
                self._retry_s = RETRY_FIRST_S


def missing_folder(adapter: ModelSpec) -> str | None:
    """Why an adapter cannot be served on this box for want of its folder (moved or deleted since it was registered),
    or None when the folder is there: the words its record's `load_error` gives, as its requests' 503 does."""
    if adapter.path.is_dir():
        return None
    return (
        f"its folder {adapter.path} does not exist on this box (moved or deleted since it was registered); put it "
        "back, or register the adapter again"
    )


def _same_registration(loaded: ModelSpec, wanted: ModelSpec) -> bool:
    return loaded.name == wanted.name and loaded.path == wanted.path
