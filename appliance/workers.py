"""The workers of one box: one `ModelWorker` (or `GenerateWorker`) per model resident here, by name.

The one idea: the table holds a model's worker exactly while it may pull. The entry is made before
the worker starts, so a second caller finds it rather than starting another, and is taken out before
anything lets the model go (a start that failed, the eviction that frees it, the box stopping), so
nothing finds a worker whose runtime is gone. Everything else asks through methods: placement and the
heartbeat whether a model has a worker and how it is doing, `fbx.cancel` which requests to forget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, ValuesView
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeAlias

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from appliance import bus
from appliance.blobs import Blobs
from appliance.catalog import DEFAULT_MODEL_NAME, Catalog, ModelSpec
from appliance.deadletter import DeadLetters
from appliance.delivery import CANCEL_WHYS, Cancellations, GatewayGone, LocalReply, QueueEpoch, never_gone
from appliance.errors import Conflict, NotFound, ServiceUnavailable, UnloadedWhileStarting
from appliance.metrics import Metrics
from appliance.profiles import ProfileBook
from appliance.residency import Residency
from appliance.settings import Settings
from appliance.worker import ModelWorker
from runtimes import Runtime, RuntimeKind
from runtimes.base import Task

if TYPE_CHECKING:
    from appliance.generation import GenerateWorker

    Worker: TypeAlias = ModelWorker | GenerateWorker

log = logging.getLogger(__name__)


class Workers:
    """The box's worker table: serve a model (load it once, start its worker), stop one before its
    eviction, fan a cancel out to all, drain them all as the box stops."""

    def __init__(
        self,
        box_id: str,
        settings: Settings,
        metrics: Metrics,
        catalog: Catalog,
        residency: Residency,
        profiles: ProfileBook | None,
        device_executor: Executor,
        cpu_executor: Executor,
        local_reply: LocalReply,
        announce: Callable[[], Awaitable[None]],
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._box_id = box_id
        self._settings = settings
        self._metrics = metrics
        self._catalog = catalog
        self._residency = residency
        self._profiles = profiles
        self._device_executor = device_executor
        self._cpu_executor = cpu_executor
        self._local_reply = local_reply
        self._announce = announce  # tells the fleet at once (a heartbeat) that a model came or went
        self._gateway_gone = gateway_gone  # a request whose gateway's box is gone is cancelled (`Fleet.gateway_gone`)
        self._table: dict[str, Worker] = {}
        self._may_pull = asyncio.Event()  # set once the box holds its id (`id_held`)
        self._terms_said: set[tuple[str, tuple[tuple[str, float], ...]]] = set()  # (model, values) warned of once
        self.stopping = False  # the box drains its workers (`drain_all`): none starts after that
        self._cancelled = Cancellations()
        self.queue_epoch = QueueEpoch()  # when the request stream was made, as the box last saw it
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._blobs: Blobs | None = None

    def attach(self, nc: NATS, js: JetStreamContext, blobs: Blobs) -> None:
        """The box's connection, once it has one: every worker pulls and answers through it."""
        self._nc, self._js, self._blobs = nc, js, blobs

    # -- asked by others -------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __getitem__(self, name: str) -> Worker:
        return self._table[name]

    def get(self, name: str) -> Worker | None:
        return self._table.get(name)

    def values(self) -> ValuesView[Worker]:
        return self._table.values()

    def stats(self, name: str) -> dict[str, float]:
        """How a model's worker is doing, for the heartbeat; nothing for a model without one."""
        worker = self._table.get(name)
        return worker.stats() if worker is not None else {}

    # -- serve and stop --------------------------------------------------------------------------

    async def serve_pinned(self) -> None:
        """Load the pinned models at start. One that fails (a corrupt folder pinned through the API, say)
        must not keep every new box of the fleet from starting: it is logged and shown as `load_error`,
        and the box serves the rest. Without the packaged default model a box cannot be ready at all."""
        for spec in self._catalog:
            if not spec.pinned or spec.adapter_of is not None:
                continue
            try:
                await self.serve(spec)
            except Exception as exc:
                if spec.name == DEFAULT_MODEL_NAME:
                    raise
                log.error(
                    "pinned model failed to load; serving the others", extra={"model": spec.name, "error": repr(exc)}
                )

    def id_held(self) -> None:
        """The box's fleet holds its id (`Fleet.start`): its workers may pull. Before, a request on the box's own
        reply subject of another run could not be judged (a twin refused at start, or a restart under its id whose
        last run's backlog waits: `Fleet.gateway_gone`), and was computed, for nobody in the second case."""
        self._may_pull.set()

    async def serve(self, spec: ModelSpec) -> Worker:
        """Load a model (once) and start pulling its requests, once the box holds its id (`id_held`)."""
        await self._may_pull.wait()
        if spec.adapter_of is not None:
            raise Conflict(f"{spec.name} is an adapter; load its base model {spec.adapter_of}")
        if spec.pinned:
            self._residency.pinned.add(spec.name)
        worker = self._table.get(spec.name)
        if worker is not None:
            self._residency.touch(spec.name)
            return await self._started(spec.name, worker)
        registered = spec
        spec = await self._profiled(spec)
        terms = await self._queue_terms(spec)  # before the load: what is judged after it stands until the start
        runtime = await self._residency.ensure_loaded(spec)
        current = self._catalog.get(spec.name)
        resident = self._residency.get(spec.name)
        if resident is None or resident.runtime is not runtime:  # evicted since (by a delete, say)
            if current is None:
                raise _deleted(spec.name)
            return await self.serve(current)  # never a worker on a runtime being closed
        if current is None or not current.same_source(resident.spec) or self._needs_torch(current, resident.spec):
            return await self._undo_load(spec.name, current)
        worker = self._table.get(spec.name)  # another caller may have started it while we loaded
        if worker is not None:
            return await self._started(spec.name, worker)
        if self.stopping:  # a load that began before the drain: a worker started now would pull, never drained
            raise ServiceUnavailable(f"this box is stopping; load {spec.name} on another box", retry_after_s=1)
        worker = self._new_worker(spec, runtime, terms)
        self._table[spec.name] = worker  # before it starts: a caller meanwhile finds it rather than start another
        try:
            await worker.start()
            if self._table.get(spec.name) is not worker:  # taken out (and drained) by an eviction as it started
                raise UnloadedWhileStarting(f"model {spec.name} was unloaded while it started on this box")
        except BaseException:
            worker.pulling.set()  # callers waiting on it go on (and find it gone)
            if self._table.get(spec.name) is worker:  # not taken out (and drained) by an eviction meanwhile
                del self._table[spec.name]  # not pulling: placement must be free to try again
                await worker.drain()
            raise
        await self._announce()
        latest = self._catalog.get(spec.name)  # as it is now: a change heard while the worker started is in it
        if latest is not None and latest.batching != registered.batching:  # changed while it loaded or started
            await self.retune(latest)
        return worker

    async def _started(self, name: str, worker: Worker) -> Worker:
        """A worker another caller starts (it warms up), once it pulls; it may have been unloaded meanwhile (its start
        failed, or an eviction took it out): then it is not this box's worker, and not served (review r51)."""
        await worker.pulling.wait()
        if self._table.get(name) is not worker:
            raise UnloadedWhileStarting(f"model {name} was unloaded while it started on this box")
        return worker

    async def _profiled(self, spec: ModelSpec) -> ModelSpec:
        """The spec with this hardware's tuned settings (appliance/profiles.py): a profile's batching wins."""
        if self._profiles is None:
            return spec
        has_adapters = bool(self._catalog.adapters_of(spec.name))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu_executor, self._profiles.apply, spec, has_adapters)

    async def retune(self, spec: ModelSpec) -> None:
        """The catalog's entry for a model changed (a PATCH of its batching, say): its worker here takes the
        batching a load would give it now (this box's profile applied to the new entry), without a reload.
        A generator's decode batch is set at its load (the catalog refuses it batching knobs).

        Retunes run side by side (two changes heard close together, or one heard while the worker started) and
        finish in any order, so one applies only if its entry is still the catalog's when it is done: an older
        one finishing last would undo the newer, whose own retune applies it."""
        if not isinstance(self._table.get(spec.name), ModelWorker):
            return
        batching = (await self._profiled(spec)).batching
        current = self._catalog.get(spec.name)
        if current is None or current.batching != spec.batching:
            return  # stale: the catalog holds a newer entry (or none) by now
        worker = self._table.get(spec.name)  # looked up again: it may have gone while the profile was read
        if isinstance(worker, ModelWorker) and worker.spec.same_source(spec):
            worker.retune(batching)

    async def _undo_load(self, name: str, current: ModelSpec | None) -> Worker:
        """The model was deleted (or registered again on another folder) while it loaded: the catalog's
        watch found nothing resident to evict then, so the load is undone here, or it would be served
        for ever (and under its name, if registered again). Also a load on ONNX that its first adapter,
        registered meanwhile, cannot use: loaded again, on torch."""
        log.info("model loaded is not the catalog's now; unloading it", extra={"model": name})
        self._residency.pinned.discard(name)
        await self._residency.evict(name, reason="request")
        await self._announce()
        if current is None:
            raise _deleted(name)
        return await self.serve(current)

    async def reload_for_adapters(self, base: str) -> None:
        """A base that a profile runs on ONNX here is loaded again on torch once it has an adapter (adapters
        need torch; a load chooses torch for a model with adapters, this one was loaded before them)."""
        resident, current = self._residency.get(base), self._catalog.get(base)
        if resident is None or current is None or not self._needs_torch(current, resident.spec):
            return
        log.info("loading model again on torch for its LoRA adapters", extra={"model": base})
        await self._residency.evict(base, reason="request")
        await self._announce()
        await self.serve(current)

    def _needs_torch(self, registered: ModelSpec, loaded: ModelSpec) -> bool:
        """Loaded on another runtime by a profile, while the catalog now holds adapters for it."""
        return (
            loaded.runtime is not RuntimeKind.TORCH
            and registered.runtime is RuntimeKind.TORCH
            and bool(self._catalog.adapters_of(registered.name))
        )

    async def _queue_terms(self, spec: ModelSpec) -> Settings:
        """This box's settings with the ack wait and deliveries of the model's consumer, which keeps the values it
        was made with (configuration.md): a worker counting deliveries by a `max_deliver` raised since answered a
        failing request 'each box holding it stopped answering' (tester h73), and one keeping requests alive by a
        longer `ack_wait_s` would have them redelivered while it computes them."""
        if self._js is None:
            return self._settings
        try:
            config = (await self._js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(spec.slug))).config
        except Exception as exc:  # NATS away, or the consumer being made again: the box's own settings
            log.debug("model's queue terms not read", extra={"model": spec.name, "error": repr(exc)})
            return self._settings
        kept = {"ack_wait_s": config.ack_wait, "max_deliver": config.max_deliver}
        differing = {
            key: value for key, value in kept.items() if value and value > 0 and value != getattr(self._settings, key)
        }
        if not differing:
            return self._settings
        said = (spec.name, tuple(sorted(differing.items())))
        if said in self._terms_said:  # two loads at once (the start's and a request's), or loaded again
            return self._settings.model_copy(update=differing)
        self._terms_said.add(said)
        log.warning(
            "the model's queue was made with other values than this box's settings; its worker follows the queue"
            " (configuration.md: a changed value applies once its consumers are made again)",
            extra={"model": spec.name, **{f"queue_{key}": value for key, value in differing.items()}},
        )
        return self._settings.model_copy(update=differing)

    def _new_worker(self, spec: ModelSpec, runtime: Runtime, settings: Settings) -> Worker:
        assert self._nc is not None
        dead_letters = DeadLetters(
            self._box_id,
            self._nc,
            self._js,
            self._blobs,
            settings.max_deliver,
            self._metrics.dead_lettered.labels(spec.name),
            gateway_gone=self._gateway_gone,
        )
        if spec.task is Task.GENERATE:
            from appliance.generation import GenerateWorker  # torch and transformers: only a box that generates

            return GenerateWorker(
                self._box_id,
                self._nc,
                spec,
                runtime,  # type: ignore[arg-type]
                settings,
                self._metrics,
                self._device_executor,
                self._residency,
                self._catalog,
                self._blobs,
                dead_letters,
                self._cancelled,
                local_reply=self._local_reply,
                queue_epoch=self.queue_epoch,
                gateway_gone=self._gateway_gone,
            )
        return ModelWorker(
            self._box_id,
            self._nc,
            spec,
            runtime,
            settings,
            self._metrics,
            self._device_executor,
            self._cpu_executor,
            self._residency,
            self._catalog,
            self._blobs,
            dead_letters,
            self._cancelled,
            local_reply=self._local_reply,
            queue_epoch=self.queue_epoch,
            gateway_gone=self._gateway_gone,
        )

    async def evict(self, name: str) -> bool:
        """Let a model go from this box (its worker stopped first, by `stop`) and tell the fleet."""
        evicted = await self._residency.evict(name)
        await self._announce()
        return evicted

    async def stop(self, name: str) -> None:
        """Before an eviction: stop pulling, finish what is in flight, hand the rest back."""
        worker = self._table.pop(name, None)
        if worker is not None:
            await worker.drain()

    def drain_all(self) -> asyncio.Future[list[Any]]:
        """The box stopping: every worker drains at once; one that fails does not stop the others."""
        self.stopping = True
        return asyncio.gather(*(w.drain() for w in self._table.values()), return_exceptions=True)

    def clear(self) -> None:
        """After the box's drain: whatever did not finish in time is no longer this box's to find."""
        self._table.clear()

    # -- cancels ---------------------------------------------------------------------------------

    def queue_lost(self) -> None:
        """The request stream was made anew: generators let go of what they hold from the old one and have sent
        nothing of (`GenerateWorker.queue_lost`)."""
        for worker in self._table.values():
            if not isinstance(worker, ModelWorker):  # a generator (its module loads torch: not imported here)
                worker.queue_lost()

    def adapters_retired(self) -> None:
        """An adapter left the catalog or was registered again on another folder: generators answer or hand back the
        requests for it still waiting for a decode slot (`GenerateWorker.adapters_retired`); an encoder looks its
        adapter up at each batch."""
        for worker in self._table.values():
            if not isinstance(worker, ModelWorker):
                worker.adapters_retired()

    def pull_again(self) -> None:
        """The NATS server restarted and its consumers are made again: every worker asks for work anew."""
        for worker in self._table.values():
            worker.puller.pull_again()
            worker.bulk_puller.pull_again()

    async def on_cancel(self, msg: Msg) -> None:
        """A gateway's client went away (`fbx.cancel`): forget its request wherever it waits on this box."""
        try:
            cancel = orjson.loads(msg.data)
            request_id, box = str(cancel["id"]), cancel.get("box")
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return
        if box is not None:  # "stop your answer: another box's is taken" (`Dispatcher.take`), for that box alone
            if box == self._box_id:
                if cancel.get("again") is True:  # "...and hand it back": a chunk of it was lost (`Dispatcher.take`)
                    generators = [worker for worker in self._table.values() if not isinstance(worker, ModelWorker)]
                    # From a request stream lost since: the gateway publishes it again, where a nak brought nothing
                    # back and the client had a 503 `chunk_lost` after 20 s (tester h85).
                    lost = any(worker.from_lost_queue(request_id) for worker in generators)
                    handed_back = any(worker.hand_back(request_id) for worker in generators)
                    if msg.reply:
                        await msg.respond(orjson.dumps({"handed_back": handed_back, "publish_again": lost}))
                    return
                for worker in self._table.values():
                    worker.cancel(request_id, settle=False)
            return
        why = next((why for why in CANCEL_WHYS if why == cancel.get("why")), "gone")  # as it is counted
        self._cancelled.add(request_id, why=why)
        for worker in self._table.values():
            worker.cancel(request_id, why=why)


def _deleted(name: str) -> NotFound:
    return NotFound(f"model {name!r} was deleted while it loaded", code="model_not_found")
