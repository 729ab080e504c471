"""One fleetbox process, wired: NATS (embedded or joined), the stream, catalog, models, gateway.

Start order follows the request path backwards (queue, catalog, workers, then the HTTP door), and
stop order forwards: close the door, let workers finish what they started and hand back what they
did not, stop answering, then close NATS. Every NATS-facing step is bounded, and `fleetbox serve`
gives the whole stop `shutdown_grace_s` + 4 s (12 s by default), so SIGTERM exits within 15 s; an
embedded nats-server whose stop was cut short still ends with the process (its parent-death signal).
What a change of the catalog does to the models the box holds is `catalog_changes.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.nuid import NUID

from appliance import box_status, bus
from appliance.blobs import Blobs
from appliance.build import build_id
from appliance.catalog import Catalog
from appliance.catalog_changes import on_catalog_change
from appliance.catalog_store import CatalogStore
from appliance.configured import configured_specs
from appliance.connect import (
    NatsInTheClear,
    asks_for_tls,
    in_the_clear,
    refuse_plain_servers,
    shown_url,
    tls_context,
    when_jetstream_answers,
)
from appliance.control import ControlServer
from appliance.deadletter import DeadLetterWatch
from appliance.delivery import GatewayState
from appliance.devices import cpu_cores, hardware_slug, resolve_device
from appliance.envelope import ReplyMeta
from appliance.errors import ServiceUnavailable
from appliance.fleet import Fleet, taking_work
from appliance.gateway.context import GatewayContext
from appliance.gateway.dispatch import Dispatcher
from appliance.gateway.door import HttpDoor
from appliance.logs import FailureStreak
from appliance.metrics import Metrics
from appliance.model_bytes import parse_budget
from appliance.natsd import EmbeddedNats
from appliance.placement import Placement
from appliance.profiles import SHIPPED_PROFILES_DIR, ProfileBook
from appliance.request_queue import RequestQueue
from appliance.residency import Residency
from appliance.settings import MODEL_ROLES, Settings
from appliance.tasks import Background
from appliance.verbs import control_verbs, pin_judge
from appliance.workers import Workers

log = logging.getLogger(__name__)

_STOP_STEP_S = 3.0  # the most one NATS-facing shutdown step may take
# What a stop keeps after its wait for the others' requests (the box hosting the fleet's NATS): the heartbeat, catalog,
# NATS drain and close, and the nats-server's own stop, within `fleetbox serve`'s bound of `shutdown_grace_s` + 4 s.
_STOP_RESERVE_S = 2.5
_QUEUE_POLL_S = 0.1
NATS_ERROR_REMIND_S = 60.0  # while NATS cannot be reached, "nats error" is a warning this often (DEBUG between)
FIRST_PULL_S = 1.0  # a worker whose pullers started this lately counts as starting: its first pulls are coming


def new_box_id() -> str:
    host = socket.gethostname().split(".")[0].lower()
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)[:24] or "box"
    return f"{safe}-{NUID().next().decode()[-6:].lower()}"


class Box:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.box_id = settings.box_id or new_box_id()
        self.catalog = Catalog()
        self.metrics = Metrics()
        self.device = resolve_device(settings.device) if settings.runs_models else "none"
        # One thread per device serialises model work on it; tokenising big bodies and loading use others.
        self._device_executor = ThreadPoolExecutor(1, thread_name_prefix="fbx-device")
        self._cpu_executor = ThreadPoolExecutor(2, thread_name_prefix="fbx-cpu")
        budget = parse_budget(settings.memory_budget, self.device) if settings.runs_models else 0
        self.residency = Residency(
            self.device,
            settings.threads,
            budget,
            self.metrics,
            self._cpu_executor,
            before_evict=lambda name: self.workers.stop(name),  # made below: the workers need the residency
            in_use=self._in_use,
            onnx_cache=settings.state_dir / "onnx",  # a box exports each model once
        )
        roots = [p for p in (settings.profiles_dir, SHIPPED_PROFILES_DIR) if p is not None]
        self.profiles = (
            ProfileBook(hardware_slug(self.device), roots, cpu_cores(), threads=settings.threads)
            if settings.runs_models
            else None
        )
        self.workers = Workers(
            self.box_id,
            settings,
            self.metrics,
            self.catalog,
            self.residency,
            self.profiles,
            self._device_executor,
            self._cpu_executor,
            local_reply=self._local_reply,
            announce=self._beat,
            # The fleet is made below, at start; no worker pulls before it holds this box's id (`Workers.id_held`).
            gateway_gone=lambda meta: self.fleet.gateway_gone(meta) if self.fleet is not None else GatewayState.AWAITS,
        )
        self._dead_letters: DeadLetterWatch | None = None
        self.natsd: EmbeddedNats | None = None
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.store: CatalogStore | None = None
        self.blobs: Blobs | None = None
        self.fleet: Fleet | None = None
        self.dispatcher: Dispatcher | None = None
        self._control: ControlServer | None = None
        self.placement: Placement | None = None
        self._tasks = Background("box")
        self._nats_servers = ""  # the NATS URLs it connects to, for its log
        self._nats_errors = FailureStreak(log, "nats connection", event="nats error", remind_s=NATS_ERROR_REMIND_S)
        self._wants_tls = False  # a TLS option or a tls:// URL given: a server in the clear is refused
        self.queue = RequestQueue(self)
        self.draining = False
        self.stop_requested = asyncio.Event()
        self.failure: str | None = None  # why the box stopped itself, for a non-zero exit
        self.started_at = time.time()
        self.run = secrets.token_hex(4)  # this start's own: its requests (`Fbx-Run`) and heartbeat name it
        self.build = build_id()  # read once here: a git checkout's commit costs a subprocess
        self.ready = False  # its start finished: a box refused at start (a twin of a live box id) never was
        # Its start finished, or `/readyz` said ready: from then a model pinned (or loading) is no reason to leave
        # rotation (`box_status.not_ready_reason`).
        self.was_ready = False
        self.door = HttpDoor(settings.host, settings.port)

    @property
    def http_port(self) -> int | None:
        return self.door.port

    @property
    def nats_url(self) -> str:
        if self.natsd is not None:
            return self.natsd.url
        return self.settings.nats_urls[0]

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._connect()
        assert self.js is not None and self.nc is not None
        s = self.settings
        await when_jetstream_answers(self.queue.ensure)
        self.blobs = Blobs(
            self.js,
            s.blob_threshold,
            self.nc.max_payload,
            ttl_s=s.stream_max_age_s,
            file_storage=s.durable,
            replicas=s.replicas,
        )
        self.workers.attach(self.nc, self.js, self.blobs)
        self.store = CatalogStore(self.js, self.catalog, replicas=s.replicas, file_storage=s.durable, registers=True)
        self.store.on_change(partial(on_catalog_change, self))
        await when_jetstream_answers(lambda: self.store.open(configured_specs(s), judged=True))
        await self.queue.open_catalogued()
        self.fleet = Fleet(
            self.js,
            self.box_id,
            partial(box_status.heartbeat, self),
            period_s=s.heartbeat_s,
            ttl_s=s.heartbeat_ttl_s,
            replicas=s.replicas,
            on_taken=self.id_taken,
            on_lapse=self._heartbeat_lapsed,
            on_held_again=lambda models: self.dispatcher is not None and self.dispatcher.held_again(models),
            run_memory_s=max(s.stream_max_age_s, s.max_timeout_s),  # while an ended run's request may be queued or held
        )
        await when_jetstream_answers(self.fleet.start)
        self.workers.id_held()
        self._control = ControlServer(self.nc, self.box_id, control_verbs(self))
        await self._control.start()
        await self.nc.subscribe(bus.cancel_subject(), cb=self.workers.on_cancel)
        self._dead_letters = DeadLetterWatch(
            self.box_id, self.nc, self.js, self.blobs, self.metrics.dead_lettered, self.fleet.gateway_gone
        )
        await self._dead_letters.start()
        if s.runs_models:
            await self.workers.serve_pinned()
            self.placement = Placement(self)
            self.placement.start()
        await self._start_http()  # a worker serves /healthz, /readyz and /metrics; a gateway serves the API too
        # Everything allocated so far (torch, models) lives for the process: keep it out of the cyclic
        # collector, whose full passes over it stalled the event loop for ~0.3-0.5 s.
        gc.freeze()
        self.spawn(self.queue.watch())
        if self.natsd is not None:
            self.spawn(self.natsd.supervise(self._nats_gone))
        await self.fleet.beat()
        self.ready = True
        self.was_ready = True  # its pinned models loaded and pulling, as `/readyz` asks at first (review h148)
        # The server it is connected to, of those it was given (the first named one said nothing: tester h87).
        nats = shown_url(self.nc.connected_url.geturl() if self.nc.connected_url else self.nats_url)
        log.info("box ready", extra={"box": self.box_id, "nats": nats, "http_port": self.http_port})

    async def _connect(self) -> None:
        urls = self.settings.nats_urls
        if not urls:
            self.natsd = EmbeddedNats(
                store_dir=self.settings.state_dir / "nats",
                port=self.settings.nats_port,
                host=self.settings.nats_host,
            )
            await self.natsd.start()
            urls = [self.natsd.url]
        self._nats_servers = shown_url(",".join(urls))
        tls = tls_context(self.settings)
        self._wants_tls = asks_for_tls(urls, tls)
        await refuse_plain_servers(urls, tls)
        self.nc = await nats.connect(
            servers=urls,
            user_credentials=str(self.settings.creds) if self.settings.creds else None,
            tls=tls,
            name=f"fleetbox-{self.box_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
        )
        if self._in_the_clear():
            server = self._server_url()
            await self.nc.close()
            raise NatsInTheClear(server)
        self.js = self.nc.jetstream()

    def _in_the_clear(self) -> bool:
        return self._wants_tls and self.nc is not None and in_the_clear(self.nc)

    def _server_url(self) -> str:
        url = self.nc.connected_url if self.nc is not None else None
        return shown_url(f"{url.scheme}://{url.netloc}") if url is not None else self._nats_servers

    def _nats_gone(self, why: str) -> None:
        """The embedded nats-server is gone for good: stop, with an error exit (`failure`) for a supervisor."""
        log.error("box stopping: its NATS is gone", extra={"error": why})
        self.failure = why
        self.stop_requested.set()

    def id_taken(self, why: str) -> None:
        """Another box beats under this box's id (it took it while this one was cut off or frozen): this one stops,
        with an error exit, and leaves the id to it."""
        log.error("box stopping: its id is another box's now", extra={"error": why})
        self.failure = f"{why}; this box stops"
        self.stop_requested.set()

    async def _on_nats_error(self, exc: Exception) -> None:
        # Which server: a box that cannot reach it keeps trying, and its log is all an operator sees (no HTTP port
        # before it connects); without the URL a wrong --nats read as a mystery (operator tester h51).
        # Once, then once a minute while it lasts (every 0.5 s a reconnect fails: 7,000 lines an hour, tester h187).
        self._nats_errors.failed(exc, nats=self._nats_servers)

    async def _on_disconnect(self) -> None:
        if self.dispatcher is not None:  # and again once back (`_on_reconnect`): the silence meanwhile is no pace
            self.dispatcher.nats_interrupted()
        if self.draining:  # its own close as the box stops: expected, not a warning
            log.info("nats disconnected")
            return
        log.warning("nats disconnected")

    async def _on_reconnect(self) -> None:
        if self._in_the_clear():  # a server of the cluster without TLS: no more traffic in the clear than came already
            self._nats_gone(str(NatsInTheClear(self._server_url())))
            return
        log.info("nats reconnected")
        self._nats_errors.succeeded()
        if self.dispatcher is not None:
            # Before this callback the client already takes publishes: the rate was also restarted at the disconnect.
            self.dispatcher.nats_interrupted()
        self.queue.restore_soon()

    def _heartbeat_lapsed(self, lapsed_s: float) -> None:
        """No heartbeat of this box written for over a TTL (it was frozen, stalled, or cut off from NATS): the workers
        may have taken its gateway for gone and let its requests go (`Fleet.gateway_gone`); what they let go is
        published again once they have all heard its heartbeat and let go what they were letting go, a TTL on
        (`Resender.lapsed`)."""
        if self.dispatcher is not None:
            self.dispatcher.heartbeat_lapsed(lapsed_s, settle_s=self.settings.heartbeat_ttl_s)

    async def _start_http(self) -> None:
        assert self.nc is not None and self.js is not None and self.store is not None
        if self.settings.serves_http:
            self.dispatcher = Dispatcher(
                self.box_id,
                self.run,
                self.nc,
                self.js,
                self.metrics,
                self.blobs,
                max_waiting=self.settings.max_waiting,
                max_queue_s=self.settings.max_queue_s,
                max_timeout_s=self.settings.max_timeout_s,
                silence_s=self.settings.ack_wait_s,
                holders_per_gateway=self.fleet.holders_per_gateway if self.fleet is not None else None,
                box_round=self.fleet.box_round if self.fleet is not None else None,
                box_round_rows=self.fleet.box_round_rows if self.fleet is not None else None,
                pace=self.fleet.pace_per_gateway if self.fleet is not None else None,
                holders=self.fleet.holders if self.fleet is not None else None,
                hears_fleet=self.fleet.hears_itself if self.fleet is not None else None,
                can_load=self.fleet.can_load if self.fleet is not None else None,
            )
            await self.dispatcher.start()
        context = GatewayContext(
            settings=self.settings,
            catalog=self.catalog,
            store=self.store,
            dispatcher=self.dispatcher,
            metrics=self.metrics,
            nc=self.nc,
            box_id=self.box_id,
            not_ready_reason=partial(box_status.not_ready_reason, self),
            is_draining=lambda: self.draining,
            model_state=partial(box_status.model_state, self),
            live_boxes=self.fleet.live_boxes if self.fleet else list,
            without_workers_s=self.fleet.without_workers_s if self.fleet else float,
            pin_judge=partial(pin_judge, self),
            open_queue=self.queue.open_model,
            delete_model=self.queue.delete_model,
        )
        await self.door.open(context)

    def _local_reply(self, subject: str, meta: ReplyMeta, body: bytes) -> bool:
        """A worker's reply to this box's own gateway skips NATS: no publish, no confirmation, no parsing."""
        if self.dispatcher is None or subject != self.dispatcher.reply_subject:
            return False
        self.dispatcher.take(meta, body)
        return True

    # -- models on this box ----------------------------------------------------------------------

    async def _beat(self) -> None:
        """Tell the fleet now, not at its next period, what this box holds (a model came or went)."""
        if self.fleet is not None:
            await self.fleet.beat()

    # -- control ---------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self._tasks.spawn(coro)

    # -- stop ------------------------------------------------------------------------------------

    def _in_use(self, model: str) -> bool:
        """Whether this box's worker for `model` has requests in hand, or is still starting (an eviction prefers an
        idle model): a model just loaded for waiting requests was evicted for the next load before its worker pulled,
        its largest-model requests starved round after round (residency tester h65). Starting lasts until its pullers
        have had `FIRST_PULL_S` to bring what waits: a generator, marked pulling before its pullers start, looked
        idle until its first requests came, and was evicted for the next load again and again (tester h97: three
        504s under thrashing)."""
        worker = self.workers.get(model)
        if worker is None or worker.pulling_since is None:
            return True
        return worker.held > 0 or time.monotonic() - worker.pulling_since < FIRST_PULL_S

    def _other_workers(self) -> list[str]:
        """Live boxes besides this one that compute (and are not draining): who may answer what it hands back."""
        records = self.fleet.live_boxes() if self.fleet is not None else []
        return [r["box"] for r in taking_work(records, MODEL_ROLES) if r.get("box") != self.box_id]

    def _others_on_this_nats(self) -> list[str]:
        """The live boxes besides this one (from the heartbeats) that use the nats-server this box runs: none
        unless it runs the embedded one."""
        if self.natsd is None or self.fleet is None or self.nc is None or not self.nc.is_connected:
            return []
        return sorted(str(r["box"]) for r in self.fleet.live_boxes() if r.get("box") != self.box_id)

    async def _queue_emptied(self, deadline: float) -> None:
        """Wait till the requests in the stream now have left it (a work queue: a request leaves it once answered,
        acked), or `deadline` (monotonic), while another box that computes is live: the others compute, and load a
        model for, what is in it. Not for what comes after (the others' gateways publish all along: the stream of a
        busy fleet is never empty), nor with none to compute it (a gateway-only box, or the whole fleet stopping):
        either kept box 1 up for its whole budget (review h229)."""
        assert self.js is not None
        last = (await self.js.stream_info(bus.REQUEST_STREAM)).state.last_seq
        while time.monotonic() < deadline and self._other_workers():
            state = (await self.js.stream_info(bus.REQUEST_STREAM)).state
            if state.messages == 0 or state.first_seq > last:
                return
            await asyncio.sleep(_QUEUE_POLL_S)

    async def stop(self) -> None:
        """Close the door, finish in-flight batches, hand back unstarted work, stop NATS.

        Every step that talks to NATS is bounded: a connection that stops taking writes (a server
        that hangs) must not keep a stopping box alive past its SIGTERM budget.
        """
        log.info("box stopping", extra={"box": self.box_id, "ready": self.ready})
        deadline = time.monotonic() + self.settings.shutdown_grace_s + _STOP_STEP_S - _STOP_RESERVE_S
        # The gateway answers new requests 503, each with its connection closed (`/readyz` says why), until the
        # listener closes. Idle kept-alive connections stay open till then: closing one a client had just sent a
        # request on dropped that request unanswered.
        self.draining = True
        if self._dead_letters is not None:
            await _bounded("dead letters", self._dead_letters.stop_taking())
        if self.placement is not None:
            await _bounded("placement", self.placement.stop())
        await _bounded("background tasks", self._tasks.cancel())
        drains = self.workers.drain_all()

        async def drained() -> None:
            await drains
            if self.fleet is not None:  # what it handed back is seen waiting now (`held` 0), not a beat later
                await self.fleet.beat()

        # Meanwhile the gateway waits for what its clients still await: the work its own worker hands
        # back is computed by other boxes and answered here. What is left after the grace gets a 503.
        grace = self.settings.shutdown_grace_s
        steps = [_bounded("workers", drained(), grace + _STOP_STEP_S)]
        if self.dispatcher is not None and self._other_workers():
            steps.append(_bounded("answers", self.dispatcher.wait_answered(grace), grace + _STOP_STEP_S))
        await asyncio.gather(*steps)
        self.workers.clear()
        others = self._others_on_this_nats()
        if others:
            # This box hosts the fleet's queue: what the other boxes' gateways sent, and what this box handed back,
            # is in it. It stays up till all is answered (`fleet.md`, "Stopping a box"), within the stop's budget.
            left_s = max(0.01, deadline - time.monotonic())
            await _bounded("the others' requests", self._queue_emptied(deadline), left_s)
        if self.dispatcher is not None:
            stopped = ServiceUnavailable(f"box {self.box_id} is stopping; send the request again", retry_after_s=1)
            await _bounded("unanswered", self.dispatcher.abandon(stopped))
        await self.door.close()
        if self._control is not None:
            await _bounded("control", self._control.stop())
        if self._dead_letters is not None:
            await _bounded("dead letters", self._dead_letters.stop())
        connected = self.nc is not None and self.nc.is_connected
        if self.fleet is not None:
            await _bounded("heartbeat", self.fleet.stop(connected=connected))
        if self.store is not None:
            await _bounded("catalog", self.store.close(connected=connected))
        if self.nc is not None and connected:
            await _bounded("NATS drain", self.nc.drain())
            await _bounded("NATS close", self.nc.close())
        elif self.nc is not None:  # cut off: nothing to drain, and a close fails on the transport already gone
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), _STOP_STEP_S)
        await self.residency.close()
        self._device_executor.shutdown(wait=False, cancel_futures=True)
        self._cpu_executor.shutdown(wait=False, cancel_futures=True)
        if self.natsd is not None:
            if others:
                log.warning(
                    "stopping the embedded nats-server the other boxes use; they are cut off from the fleet",
                    extra={"boxes": others},
                )
            await self.natsd.stop()
        log.info("box stopped", extra={"box": self.box_id, "ready": self.ready})


async def _bounded(step: str, awaitable: Awaitable[Any], timeout_s: float = 0.0) -> None:
    """One step of a box's shutdown, given at most `timeout_s` (default `_STOP_STEP_S`); failures are logged."""
    try:
        async with asyncio.timeout(timeout_s or _STOP_STEP_S):
            await awaitable
    except TimeoutError:
        log.warning(f"shutdown step {step!r} timed out; going on", extra={"step": step})
    except Exception as exc:
        log.warning(f"shutdown step {step!r} failed; going on", extra={"step": step, "error": repr(exc)})
