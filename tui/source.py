"""Where the TUI's views come from: a fleet read through NATS alone, or a fake in tests.

`NatsSource` is a reader of the fleet's shared state and nothing more: the heartbeats (KV
`fbx_boxes`, through `appliance.fleet.Fleet` as a reader), the catalog (KV `fbx_models`, through
`CatalogStore`), and the queue (JetStream stream and consumer info, polled once a period). It
never creates a bucket or a stream, so attaching to a fleet that has not started yet waits for
it instead of shaping it. Heartbeats arrive by watch; `view()` only assembles what is already in
memory, so building a view costs no round trip and never waits.

A box that stops heartbeating is kept in the view for a while, marked `dead` (its records aged
out) or `left` (its record was deleted by a clean stop), so an operator sees that it went. But
while NATS itself is out of reach (and until the fleet is read again after it returns) no
heartbeat can arrive: then the view keeps the boxes and the catalog as last seen, unjudged, and
says since when (`FleetView.stale_since`), rather than calling every box dead. Out of reach
includes a server that keeps the connection up but stops answering (hung, or SIGSTOP): the
queue poll, a request each period, is what notices, when it times out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from appliance import bus
from appliance.catalog import Catalog
from appliance.catalog_store import CatalogStore
from appliance.connect import NO_AUTH, NatsAuth
from appliance.fleet import Fleet
from appliance.tasks import cancel_and_wait
from tui.dial import NatsUnreachable, dial
from tui.model import BoxState, ConsumerState, FleetView, QueueState, StreamState
from tui.ops import FleetOps

log = logging.getLogger(__name__)

FORGET_AFTER_S = 120.0  # how long a dead or departed box stays on screen
_READ_ERRORS = (NatsError, TimeoutError, OSError)


class Operations(Protocol):
    """The actions a screen can take; `FleetOps` over NATS, or a recording fake in tests."""

    def live(self) -> list[BoxState]: ...
    def holders(self, model: str) -> list[str]: ...
    async def pin(self, model: str) -> dict[str, Any]: ...
    async def unpin(self, model: str) -> dict[str, Any]: ...
    async def load(self, model: str, box: str | None = None) -> dict[str, Any]: ...
    async def evict(self, model: str, box: str | None = None) -> dict[str, Any]: ...
    async def drain(self, box: str) -> dict[str, Any]: ...
    async def register(self, registration: dict[str, Any], box: str | None = None) -> dict[str, Any]: ...


class FleetSource(Protocol):
    ops: Operations

    async def start(self) -> None: ...
    def view(self) -> FleetView: ...
    async def stop(self) -> None: ...


class NatsSource:
    def __init__(
        self,
        nc: NATS,
        *,
        address: str,
        own_connection: bool = False,
        period_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream(timeout=max(2.0, period_s * 2))
        self.address = address
        self._own = own_connection
        self._period_s = period_s
        self._clock = clock
        self._catalog = Catalog()
        self._fleet: Fleet | None = None
        self._store: CatalogStore | None = None
        self._queue: QueueState | None = None
        self._ttl_s = 5.0
        self._waiting_for: str | None = "reading the fleet…"
        self._known: dict[str, BoxState] = {}
        self._gone_at: dict[str, float] = {}
        self._attached = asyncio.Event()
        self._no_fleet_since: float | None = None  # when its heartbeat bucket was first found missing, if it still is
        self._attach_task: asyncio.Task[None] | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._dial_to: tuple[str, NatsAuth] | None = None  # connect in start(), for `dialing`
        self._problem: str | None = None  # why the connection is down, while it is
        self._reason: str | None = None  # the same, without "retrying…"
        self._silent = False  # a read of the connected server timed out, and none was answered since
        self._reconnects_read = nc.stats["reconnects"]  # the fleet was read after this many reconnects
        self._fresh_at: float | None = None  # when the view was last judged from a connected, attached fleet
        self.ops = FleetOps(
            nc, self._current_boxes, address=address, why_unreachable=lambda: self._reason, fleet_read=self._read
        )

    @classmethod
    def dialing(cls, servers: str, auth: NatsAuth = NO_AUTH, *, period_s: float = 1.0) -> NatsSource:
        """A source that makes its own connection in `start()` and retries it for ever, its view
        saying why it cannot connect meanwhile (the TUI draws at once, not after a connect)."""
        source = cls(NATS(), address=servers, own_connection=True, period_s=period_s)
        source._dial_to = (servers, auth)
        source._waiting_for = f"connecting to NATS at {servers}…"
        return source

    async def start(self) -> None:
        self._attach_task = asyncio.create_task(self._connect_and_attach(), name="tui-attach")
        self._follow_task = asyncio.create_task(self._follow(), name="tui-follow")

    async def _connect_and_attach(self) -> None:
        if self._dial_to is not None:
            servers, auth = self._dial_to
            try:
                await dial(self._nc, servers, auth, give_up_after_s=None, on_problem=self._connect_failed)
            except NatsUnreachable as exc:  # nothing to retry: a URL or credentials nats-py cannot use
                self._problem = f"{exc.reason} (not retrying)"
                return
            self._dial_to = None
            self._waiting_for = "reading the fleet…"
        await self._attach()

    def _connect_failed(self, problem: str) -> None:
        self._reason = problem
        self._problem = f"{problem}; retrying…"

    async def attached(self, timeout_s: float, *, no_fleet_s: float | None = None) -> None:
        """Wait until the heartbeats and the catalog are read (for the CLI); raises TimeoutError, after
        `no_fleet_s` already when no box ever started on this NATS (no heartbeat bucket that long)."""
        async with asyncio.timeout(timeout_s):
            while not self._attached.is_set():
                since = self._no_fleet_since
                if no_fleet_s is not None and since is not None and time.monotonic() - since >= no_fleet_s:
                    raise TimeoutError
                await asyncio.sleep(0.1)
        if self._queue is None:
            try:
                self._queue = await self._read_queue()
            except TimeoutError:
                self._queue = QueueState(stream=None, error="NATS did not answer the queue read")

    @property
    def waiting_for(self) -> str | None:
        return self._waiting_for

    def _reachable(self) -> bool:
        """Whether NATS is connected and answers (a hung server keeps the connection up for minutes)."""
        return self._nc.is_connected and not self._silent

    def _stale(self) -> bool:
        """Whether heartbeats cannot be arriving: NATS is out of reach, or the fleet is not (yet again) read."""
        return not self._reachable() or self._fleet is None or self._nc.stats["reconnects"] != self._reconnects_read

    def _read(self) -> bool:
        """Whether the boxes known are the fleet's now: read since NATS last answered, or found to be none yet."""
        return not self._stale() or self._no_fleet_since is not None

    def view(self) -> FleetView:
        now = self._clock()
        stale = self._stale()
        if not stale:
            self._fresh_at = now
        stale_since = self._fresh_at if stale else None
        return FleetView(
            address=self.address,
            taken_at=now,
            boxes=tuple(self._boxes(now)),
            catalog=tuple(sorted(self._catalog, key=lambda s: s.name)),
            queue=self._queue,
            connected=self._reachable(),
            waiting_for=self._waiting_for,
            problem=self._why_out_of_reach(showing_the_last_seen=stale_since is not None),
            stale_since=stale_since,
        )

    def _why_out_of_reach(self, *, showing_the_last_seen: bool) -> str | None:
        """Why NATS is out of reach, or None; without "retrying…" where the view says it shows the fleet as last
        seen (the status line has 80 columns for both)."""
        if not self._nc.is_connected:
            reason, problem = self._reason, self._problem
        elif self._silent:
            reason, problem = "no answer", "no answer; retrying…"
        else:
            return None
        return reason if showing_the_last_seen and reason else problem

    def _current_boxes(self) -> Sequence[BoxState]:
        return self._boxes(self._clock())

    def _boxes(self, now: float) -> list[BoxState]:
        if self._stale():  # NATS down, or not (re)attached yet: what was known stands, unjudged
            return sorted(self._known.values(), key=lambda b: b.box)
        late_after_s = max(2.5, self._ttl_s / 2)
        seen: dict[str, BoxState] = {}
        for record in self._fleet.live_boxes() if self._fleet else ():
            box = BoxState.from_heartbeat(record)
            if not box.draining and now - box.ts > late_after_s:
                box = replace(box, status="late")
            seen[box.box] = box
        for box_id, last in self._known.items():
            if box_id in seen:
                self._gone_at.pop(box_id, None)
                continue
            gone_at = self._gone_at.setdefault(box_id, now)
            if now - gone_at > FORGET_AFTER_S:
                continue
            if last.status not in ("dead", "left"):
                # Records age out after the TTL; a clean stop deletes its record while it is fresh.
                last = replace(last, status="dead" if now - last.ts >= self._ttl_s * 0.8 else "left")
            seen[box_id] = last
        self._known = seen
        return sorted(seen.values(), key=lambda b: b.box)

    async def _attach(self) -> None:
        """Read the fleet, again after any read that fails (a timeout, NATS going away meanwhile)."""
        while True:
            try:
                await self._attach_once()
                return
            except _READ_ERRORS as exc:
                self._waiting_for = f"cannot read the fleet: {exc!r}; retrying…"
                await self._drop_readers()
            await asyncio.sleep(1.0)

    async def _attach_once(self) -> None:
        """Watch the heartbeats once their bucket exists, then the catalog once its bucket does."""
        boxes = await self._bucket(bus.BOXES_BUCKET, f"no fleet at {self.address} yet: no box has started there")
        ttl_s = float((await boxes.status()).ttl or self._ttl_s)
        fleet = Fleet(self._js, "tui", None, period_s=self._period_s, ttl_s=ttl_s)
        try:
            await fleet.start()
            await self._bucket(bus.MODELS_BUCKET, f"the fleet has no catalog (bucket {bus.MODELS_BUCKET}) yet")
            catalog = Catalog()  # a fresh one: no model removed meanwhile stays listed
            store = CatalogStore(self._js, catalog)
            try:
                await store.open([])  # no configured models: a reader adds nothing to the catalog
            except BaseException:
                await store.close()
                raise
        except BaseException:
            await fleet.stop()
            raise
        # Shown only now, all at once: until then the last known fleet stands (see `_stale`).
        self._ttl_s, self._fleet, self._catalog, self._store = ttl_s, fleet, catalog, store
        self._waiting_for = None
        self._attached.set()

    async def _drop_readers(self) -> None:
        """Stop watching the heartbeats and the catalog; NATS gone meanwhile is no failure."""
        fleet, store, self._fleet, self._store = self._fleet, self._store, None, None
        for stop in (fleet.stop if fleet else None, store.close if store else None):
            if stop is None:
                continue
            try:
                await stop()
            except _READ_ERRORS as exc:
                log.debug("stopping a reader of the fleet failed", extra={"error": repr(exc)})

    async def _bucket(self, name: str, missing: str) -> KeyValue:
        """The bucket `name`, once it exists; meanwhile the status line says what is missing."""
        while True:
            try:
                bucket = await self._js.key_value(name)
                if name == bus.BOXES_BUCKET:
                    self._no_fleet_since = None
                return bucket
            except BucketNotFoundError:
                self._waiting_for = missing
                if name == bus.BOXES_BUCKET and self._no_fleet_since is None:
                    self._no_fleet_since = time.monotonic()
            except (ServiceUnavailableError, NoRespondersError):  # no JetStream here: no fleet either (tester h74)
                self._waiting_for = f"no fleet at {self.address}: JetStream does not answer there (no -js?)"
                if self._no_fleet_since is None:
                    self._no_fleet_since = time.monotonic()
            except _READ_ERRORS as exc:
                self._waiting_for = f"cannot read the fleet: {exc!r}"
            await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        """Poll the queue each period; after a reconnect, or a spell of no answer, read the fleet afresh.

        A NATS server that restarted may have lost the buckets (memory storage) and with them
        this reader's watches; the boxes recreate them, and attaching again waits until they do.
        A poll that times out means the server does not answer: the view is then stale (as when
        the connection is down) until a poll is answered again.
        """
        while True:
            if self._nc.is_connected:
                if self._nc.stats["reconnects"] != self._reconnects_read:
                    await self._reattach("reconnected to NATS")
                try:
                    queue = await self._read_queue()
                except TimeoutError:
                    self._silent = True
                else:
                    self._queue = queue
                    if self._silent:
                        self._silent = False
                        await self._reattach("NATS answers again")
            await asyncio.sleep(self._period_s)

    async def _reattach(self, why: str) -> None:
        await cancel_and_wait([self._attach_task])
        self._attached.clear()
        self._waiting_for = f"{why}; reading the fleet again…"
        await self._drop_readers()
        self._reconnects_read = self._nc.stats["reconnects"]  # stays stale until attached: _fleet is None
        self._attach_task = asyncio.create_task(self._attach(), name="tui-attach")

    async def _read_queue(self) -> QueueState:
        """The stream and its consumers; raises TimeoutError when NATS does not answer."""
        try:
            info = await self._js.stream_info(bus.REQUEST_STREAM)
            consumers = await self._js.consumers_info(bus.REQUEST_STREAM)
        except NotFoundError:
            return QueueState(stream=None, error=f"stream {bus.REQUEST_STREAM} does not exist yet")
        except TimeoutError:
            raise
        except _READ_ERRORS as exc:
            return QueueState(stream=None, error=repr(exc))
        try:
            dead = await self._js.stream_info(bus.DEAD_LETTER_STREAM, subjects_filter=">")
        except NotFoundError:
            dead = None
        except _READ_ERRORS as exc:
            log.debug("dead-letter stream info failed", extra={"error": repr(exc)})
            dead = None
        return QueueState(
            stream=_stream_state(info),
            consumers=tuple(
                sorted(
                    (
                        ConsumerState(
                            name=c.name,
                            subject=c.config.filter_subject or "",
                            pending=c.num_pending or 0,
                            ack_pending=c.num_ack_pending or 0,
                            redelivered=c.num_redelivered or 0,
                            waiting=c.num_waiting or 0,
                        )
                        for c in consumers
                    ),
                    key=lambda c: c.name,
                )
            ),
            dead_letters=_stream_state(dead) if dead is not None else None,
        )

    async def stop(self) -> None:
        """Stop reading, and close the connection if it is this source's own; NATS gone meanwhile is no failure
        (closing a connection whose reconnects failed raises `Connection lost`: quitting the TUI then exited 1)."""
        await cancel_and_wait([self._follow_task, self._attach_task])
        await self._drop_readers()
        if self._own and _opened(self._nc):
            try:
                async with asyncio.timeout(3.0):  # not wait_for: on Python 3.11 it can swallow a cancel
                    await self._nc.close()
            except _READ_ERRORS as exc:
                log.debug("closing the TUI's NATS connection failed", extra={"error": repr(exc)})


def _opened(nc: NATS) -> bool:
    """Whether a client has a connection to close, or one being made: one never connected (the TUI quit before its
    dial began, or its dial gave up before connecting: a plain server where TLS was asked) has none, and nats-py's
    `close()` of it raises an AssertionError (review h219)."""
    return nc.is_connected or nc.is_reconnecting or nc.is_connecting


def _stream_state(info: Any) -> StreamState:
    return StreamState(
        name=info.config.name,
        messages=info.state.messages,
        nbytes=info.state.bytes,
        max_msgs=info.config.max_msgs if info.config.max_msgs is not None else -1,
        max_bytes=info.config.max_bytes if info.config.max_bytes is not None else -1,
        subjects=dict(info.state.subjects or {}),
    )
