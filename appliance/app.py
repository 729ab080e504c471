"""One fleetbox process, wired: NATS (embedded or joined), the stream, the models, workers, gateway.

Start order follows the request path backwards (queue, then workers, then the HTTP door), and
stop order forwards: close the door, let workers finish what they started and hand back what they
did not, stop answering, then close NATS. Every step is bounded so SIGTERM exits within 15 s.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import nats
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.nuid import NUID

from appliance import bus
from appliance.catalog import Catalog, ModelSpec
from appliance.gateway.app import build_app
from appliance.gateway.context import GatewayContext
from appliance.gateway.dispatch import Dispatcher
from appliance.metrics import Metrics
from appliance.natsd import EmbeddedNats
from appliance.residency import Residency
from appliance.settings import Settings
from appliance.worker import ModelWorker

log = logging.getLogger(__name__)

_MONITOR_PERIOD_S = 1.0


def resolve_device(setting: str) -> str:
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def new_box_id() -> str:
    host = socket.gethostname().split(".")[0].lower()
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)[:24] or "box"
    return f"{safe}-{NUID().next().decode()[-6:].lower()}"


class Box:
    def __init__(self, settings: Settings, catalog: Catalog | None = None) -> None:
        self.settings = settings
        self.box_id = settings.box_id or new_box_id()
        self.catalog = catalog or Catalog.from_settings(settings)
        self.metrics = Metrics()
        self.device = resolve_device(settings.device)
        # One thread per device serialises model work on it; tokenising big bodies and loading use others.
        self._device_executor = ThreadPoolExecutor(1, thread_name_prefix="fbx-device")
        self._cpu_executor = ThreadPoolExecutor(2, thread_name_prefix="fbx-cpu")
        self.residency = Residency(self.device, settings.threads, self.metrics, self._cpu_executor)
        self.workers: dict[str, ModelWorker] = {}
        self.natsd: EmbeddedNats | None = None
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.dispatcher: Dispatcher | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._stream_ok = False
        self.http_port: int | None = None

    @property
    def nats_url(self) -> str:
        if self.natsd is not None:
            return self.natsd.url
        return self.settings.nats_urls[0]

    async def start(self) -> None:
        await self._connect()
        assert self.js is not None
        s = self.settings
        await bus.ensure_request_stream(
            self.js, max_msgs=s.stream_max_msgs, max_bytes=s.stream_max_bytes, max_age_s=s.stream_max_age_s
        )
        for spec in self.catalog:
            await self._ensure_consumer(spec)
        self._stream_ok = True
        if s.runs_models:
            for spec in self.catalog:
                if spec.pinned:
                    await self.serve_model(spec)
        if s.serves_http:
            await self._start_http()
        self._monitor = asyncio.create_task(self._watch_stream(), name="stream-monitor")
        log.info("box ready", extra={"box": self.box_id, "nats": self.nats_url, "http_port": self.http_port})

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
        self.nc = await nats.connect(
            servers=urls,
            name=f"fleetbox-{self.box_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
        )
        self.js = self.nc.jetstream()

    async def _on_nats_error(self, exc: Exception) -> None:
        log.warning("nats error", extra={"error": repr(exc)})

    async def _on_disconnect(self) -> None:
        log.warning("nats disconnected")

    async def _on_reconnect(self) -> None:
        log.info("nats reconnected", extra={"url": str(self.nc.connected_url.netloc) if self.nc else ""})

    async def _ensure_consumer(self, spec: ModelSpec) -> None:
        assert self.js is not None
        s = self.settings
        await bus.ensure_request_consumer(
            self.js, spec.slug, ack_wait_s=s.ack_wait_s, max_deliver=s.max_deliver, max_ack_pending=s.max_ack_pending
        )

    async def serve_model(self, spec: ModelSpec) -> ModelWorker:
        """Load a model (once) and start pulling its requests."""
        worker = self.workers.get(spec.name)
        if worker is not None:
            return worker
        runtime = await self.residency.ensure_loaded(spec)
        assert self.nc is not None
        worker = ModelWorker(
            self.box_id,
            self.nc,
            spec,
            runtime,
            self.settings,
            self.metrics,
            self._device_executor,
            self._cpu_executor,
        )
        self.workers[spec.name] = worker
        await worker.start()
        return worker

    async def _start_http(self) -> None:
        assert self.nc is not None and self.js is not None
        self.dispatcher = Dispatcher(self.box_id, self.nc, self.js, self.metrics, self.settings.max_waiting)
        await self.dispatcher.start()
        context = GatewayContext(
            settings=self.settings,
            catalog=self.catalog,
            dispatcher=self.dispatcher,
            metrics=self.metrics,
            not_ready_reason=self.not_ready_reason,
            model_state=self.model_state,
        )
        app = build_app(context, inference=True)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=3.0, handle_signals=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.settings.host, self.settings.port, reuse_address=True)
        await self._site.start()
        server = self._site._server
        if server is not None and server.sockets:  # port 0 means "any free port"
            self.http_port = int(server.sockets[0].getsockname()[1])

    def not_ready_reason(self) -> str | None:
        if self.nc is None or not self.nc.is_connected:
            return "not connected to NATS"
        if not self._stream_ok:
            return f"stream {bus.REQUEST_STREAM} is not available"
        if self.settings.runs_models:
            for spec in self.catalog:
                if spec.pinned and not self.residency.is_resident(spec.name):
                    return f"pinned model {spec.name} is not resident yet"
        return None

    def model_state(self, name: str) -> dict:
        resident = self.residency.get(name)
        if resident is None:
            return {"state": "cold", "boxes": [], "bytes": None}
        return {"state": "resident", "boxes": [self.box_id], "bytes": resident.nbytes}

    async def _watch_stream(self) -> None:
        """Keep the backlog gauge and the stream's health fresh for readiness and Retry-After."""
        assert self.js is not None
        while True:
            try:
                info = await self.js.stream_info(bus.REQUEST_STREAM)
                self._stream_ok = True
                self.metrics.backlog.set(info.state.messages)
                if self.dispatcher is not None:
                    self.dispatcher.backlog = info.state.messages
            except Exception as exc:
                self._stream_ok = False
                log.debug("stream info failed", extra={"error": repr(exc)})
            await asyncio.sleep(_MONITOR_PERIOD_S)

    async def stop(self) -> None:
        """Close the door, finish in-flight batches, hand back unstarted work, stop NATS."""
        log.info("box stopping", extra={"box": self.box_id})
        if self._site is not None:
            await self._site.stop()
        if self._monitor is not None:
            self._monitor.cancel()
        await asyncio.gather(*(w.drain() for w in self.workers.values()), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()  # waits (bounded) for handlers still answering
        if self.nc is not None:
            with suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 3.0)
            with suppress(Exception):
                await self.nc.close()
        await self.residency.close()
        self._device_executor.shutdown(wait=False, cancel_futures=True)
        self._cpu_executor.shutdown(wait=False, cancel_futures=True)
        if self.natsd is not None:
            await self.natsd.stop()
        log.info("box stopped", extra={"box": self.box_id})
