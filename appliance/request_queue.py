"""The request queue as one box keeps it: made at start, a model's consumers made and settled with the catalog, and
watched, so that what a NATS server lost is made again and what it held then is not waited on forever.

One look a second at the request stream keeps the backlog (the gauge, and the gateway's Retry-After) and the
stream's health (`/readyz`) fresh. A stream or consumers found missing some looks in a row, on a server that
answers, are made again. The one idea: a request stream made since this box last saw it (by this box or by any
other) is a lost queue, whatever made it: its workers let go of what they hold of the old one and its gateway
publishes again what it still awaits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from datetime import datetime
from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError

from appliance import bus
from appliance.catalog import ModelSpec
from appliance.connect import (
    delete_model,
    ensure_queue,
    open_catalogued_queues,
    open_model_queue,
    remove_leftover_queues,
    restore_after_reconnect,
    settle_model_queue,
    when_jetstream_answers,
)
from appliance.errors import Conflict
from appliance.logs import FailureStreak

if TYPE_CHECKING:
    from appliance.app import Box

log = logging.getLogger(__name__)

_MONITOR_PERIOD_S = 1.0
_MISSING_LOOKS = 3  # looks of the stream monitor in a row that find the request stream or consumers gone
_MISSING_LOOKS_MOST = 300  # ... and at most this many while the restores do not make them (the server refuses)
_STREAM_LOOK_S = 2.0  # the stream monitor's look at the request stream: longer is no answer (no leader)


class RequestQueue:
    """One box's hold on the shared request stream and its models' consumers; `stream_ok` and `backlog` are its
    last look's."""

    def __init__(self, box: Box) -> None:
        self._box = box
        self.stream_ok = False
        self.backlog = 0  # messages in the request stream, kept fresh by `watch`
        self._restoring: asyncio.Task[None] | None = None  # at most one restore at a time
        # One change of a model's consumers at a time on this box: a registration opens them while the catalog's
        # listener settles them for the same entry, and interleaved at the consumer limit, one's cleanup of a
        # refused half let the other make it, a model answered 201 with its interactive consumer gone.
        self._changing: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def ensure(self) -> None:
        """Make the request stream (or find it made), and note when it was made: the epoch of this box's queue."""
        box = self._box
        assert box.js is not None
        box.workers.queue_epoch.made = await ensure_queue(box.js, box.settings)

    async def open_catalogued(self) -> None:
        """At start, once the catalog is read: every catalogued model's consumers (waiting out a fresh cluster's
        election), and a sweep for the consumers of models deleted since; the stream is then taken as healthy until
        `watch` looks."""
        box = self._box
        assert box.js is not None
        await open_catalogued_queues(box.js, box.settings, box.catalog, when_jetstream_answers)
        try:
            await remove_leftover_queues(box.js, box.catalog)
        except Exception as exc:  # a sweep for leftovers never fails a start: the next box to start tries again
            log.warning("leftover queues not looked for", extra={"error": repr(exc)})
        self.stream_ok = True

    async def open_model(self, spec: ModelSpec) -> None:
        """A model just registered here: its consumers made before the 201, so a refusal is the client's 409."""
        assert self._box.js is not None
        async with self._changing[spec.slug]:
            await open_model_queue(self._box.js, self._box.settings, spec.slug)

    async def settle_model(self, spec: ModelSpec) -> None:
        """Make the model's consumers match the catalog: both while it holds the model, neither once not."""
        assert self._box.js is not None
        async with self._changing[spec.slug]:
            await settle_model_queue(self._box.js, self._box.settings, self._box.catalog, spec.slug)

    async def delete_model(self, spec: ModelSpec) -> list[str]:
        """Take a model out of the fleet: `DELETE /v1/models/{name}` and the `delete` verb. Returns the adapters
        deleted with it (registered on another box while the deletion was judged)."""
        box = self._box
        assert box.js is not None and box.store is not None
        async with self._changing[spec.slug]:
            return await delete_model(box.js, box.settings, box.catalog, box.store, spec)

    def restore_soon(self) -> None:
        """After a reconnect: make again what the server lost, unless a restore is already under way."""
        if self._box.js is not None and (self._restoring is None or self._restoring.done()):
            self._restoring = self._box.spawn(self._restore())

    async def _restore(self) -> None:
        """Make again what the NATS server lost; if that was the request stream, the gateway publishes again what
        it awaits from the old one."""
        box = self._box
        assert box.js is not None
        try:
            created = await restore_after_reconnect(box.js, box.settings, box.catalog, box.store, box.fleet)
        except Conflict as exc:  # its id taken while it was cut off (`OwnRecord.take`): the other box stays
            box.id_taken(exc.message)
            return
        box.workers.pull_again()
        if created is not None:
            self._queue_made(created)

    def _queue_made(self, created: datetime, *, seen_gone: bool = True) -> None:
        """The request stream, as made at `created`: one made anew since this box last saw it lost what was queued
        in the old one, which the gateway publishes again (and the workers let go). `seen_gone`: this box's epoch of
        publishes was cut when the old stream was found gone; else it is cut now (another box made it again first)."""
        box = self._box
        epoch = box.workers.queue_epoch  # when the request stream was made, as this box last saw it
        if created == epoch.made:
            return
        lost, epoch.made = epoch.made is not None, created
        if not lost:
            return
        box.workers.queue_lost()
        if box.dispatcher is not None:
            if not seen_gone:
                box.dispatcher.nats_interrupted()
            box.dispatcher.queue_lost()

    async def watch(self) -> None:
        """Keep the backlog gauge and the stream's health fresh for readiness and Retry-After, and make the request
        stream or a model's consumers again when they are gone on a server that is up (deleted by hand, say)."""
        box = self._box
        assert box.js is not None
        streak = FailureStreak(log, "reading the request stream's state")
        short = 0  # looks in a row that found the stream or some consumers missing
        looks = _MISSING_LOOKS  # how many make a restore: doubled while restores do not help (a consumer limit)
        gone = False  # the stream itself was found missing
        while True:
            missing = False
            looked_at = time.monotonic()
            try:
                # Bounded below JetStream's 5 s: a look waiting out an election said the stream was there meanwhile.
                info = await asyncio.wait_for(box.js.stream_info(bus.REQUEST_STREAM), _STREAM_LOOK_S)
                # Made anew by another box's monitor (or a hand) since this box looked: its lost requests published.
                self._queue_made(info.created, seen_gone=gone)
                self.stream_ok, gone = True, False
                if box.dispatcher is not None:
                    box.dispatcher.stream_answered(looked_at)
                streak.succeeded()
                self.backlog = info.state.messages
                box.metrics.backlog.set(self.backlog)
                if box.dispatcher is not None:
                    box.dispatcher.backlog = info.state.messages
                bases = sum(1 for spec in box.catalog if spec.adapter_of is None)
                missing = info.state.consumer_count < len(bus.PRIORITIES) * bases
            except NotFoundError:
                if not gone and box.dispatcher is not None:
                    box.dispatcher.nats_interrupted()  # what it published before now was in the stream deleted
                self.stream_ok, missing, gone = False, True, True
                box.metrics.backlog.set(math.nan)
            except Exception as exc:
                self.stream_ok = False
                # No value, not the last one read: a dashboard showed a backlog through a NATS outage (tester finding).
                box.metrics.backlog.set(math.nan)
                streak.failed(exc)
            # Not at the first look: a model deleted on another box loses its consumers before this catalog hears.
            short = short + 1 if missing else 0
            looks = looks if missing else _MISSING_LOOKS
            if short >= looks and (self._restoring is None or self._restoring.done()):
                log.warning(
                    "request queue missing; making it again", extra={"missing": "stream" if gone else "consumers"}
                )
                # A stream made anew is a lost queue (its requests published again); consumers are only made again.
                self._restoring = box.spawn(self._restore() if gone else self._reopen_queues())
                short, looks = 0, min(2 * looks, _MISSING_LOOKS_MOST)
            await asyncio.sleep(_MONITOR_PERIOD_S)

    async def _reopen_queues(self) -> None:
        assert self._box.js is not None
        await open_catalogued_queues(self._box.js, self._box.settings, self._box.catalog)
