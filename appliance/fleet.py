"""The fleet as every box sees it: heartbeats in the KV bucket `fbx_boxes`.

Each box puts its own record (devices, resident models with bytes, backlog, throughput, latency)
every `heartbeat_s`; the bucket's TTL removes a dead box's record, and readers also ignore any
record older than the TTL. A clean stop deletes the record at once. Readers (the pull policy,
`GET /v1/models`, the TUI) keep a watched copy, so asking "who holds model M" costs no round trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import orjson
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from appliance import bus
from appliance.batch_cost import PaceLine
from appliance.delivery import GatewayState
from appliance.envelope import RequestMeta
from appliance.errors import Conflict
from appliance.hearing import RUN_MEMORY_S, Hearing
from appliance.logs import FailureStreak
from appliance.own_record import OwnRecord
from appliance.settings import GATEWAY_ROLES, MODEL_ROLES
from appliance.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_CLAIM = "claim."  # keys of short-lived claims, beside the boxes' records


class Fleet:
    def __init__(
        self,
        js: JetStreamContext,
        box_id: str,
        snapshot: Callable[[], dict[str, Any]] | None,
        *,
        period_s: float,
        ttl_s: float,
        replicas: int = 1,
        on_taken: Callable[[str], None] | None = None,
        on_lapse: Callable[[float], None] | None = None,
        on_held_again: Callable[[list[str]], None] | None = None,
        run_memory_s: float = RUN_MEMORY_S,
    ) -> None:
        self._js = js
        self.box_id = box_id
        self._snapshot = snapshot  # None: a reader only (the TUI), publishes nothing
        self._heartbeats = FailureStreak(log, "publishing the heartbeat")
        self._period_s = period_s
        self._ttl_s = ttl_s
        self._replicas = replicas
        self._kv: KeyValue | None = None
        self._boxes: dict[str, dict[str, Any]] = {}
        self._holdings: dict[str, list[_Holding]] | None = None  # `_boxes` by model (`_by_model`); None: out of date
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: KeyValue.KeyWatcher | None = None
        self._beating = False
        self._on_taken = on_taken  # told why when another box beats under this box's id now
        self._own = OwnRecord(box_id, period_s, lambda: self._boxes.get(box_id))  # its record, its `started`
        self._run: object = None  # this box's `run` (`RequestMeta.run`), which its records carry
        self._beat_lock = asyncio.Lock()
        self._workers_seen_at = time.monotonic()  # the last heartbeat of a box taking model work (or the start)
        self._hearing = Hearing(box_id, ttl_s, run_memory_s)  # when each box's record reached this one (`gateway_gone`)
        self._on_lapse = on_lapse  # told how long this box's heartbeat lapsed, once it writes one again
        self._on_held_again = on_held_again  # told of models resident on a live box again after none held them
        self._written_at: float | None = None  # monotonic: this box's last heartbeat written

    async def start(self) -> None:
        self._hearing.watch_begins()
        self._kv = await open_boxes_bucket(self._js, self._ttl_s, self._replicas)
        self._watcher = watcher = await self._kv.watchall()
        seen = set()
        for entry in await bus.replay(self._js, bus.BOXES_BUCKET, watcher):
            seen.add(entry.key)
            self._apply(entry)
        for gone in set(self._boxes) - seen:  # removed while nobody watched (before a reopen)
            del self._boxes[gone]
            self._holdings = None
        self._hearing.watching()
        self._tasks.append(asyncio.create_task(self._follow(watcher), name="fleet-watch"))
        if self._snapshot is not None:
            self._beating = False  # no beat of this box's (nor a delete by its stop) until it is judged no twin
            snapshot = self._snapshot()
            self._run = snapshot.get("run")
            await self._own.take(self._kv, snapshot.get("started"), self._record)
            self._beating = True  # from now the record under this id is this box's: its stop deletes it
            await self.beat()
            self._tasks.append(asyncio.create_task(self._beat_forever(), name="heartbeat"))

    async def reopen(self) -> None:
        """After a reconnect: a NATS server that restarted lost this bucket (it lives in memory), and
        its watch with it. Make the bucket again if it is gone, and watch it afresh."""
        await self._stop_tasks()
        self._own.forget()
        await self.start()

    async def _stop_tasks(self, *, connected: bool = True) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._watcher is not None:
            await bus.stop_watch(self._js, self._watcher, connected=connected)
            self._watcher = None

    async def beat(self) -> None:
        """Publish this box's record now (also called on state changes, so others see them at once)."""
        if self._kv is None or self._snapshot is None or not self._beating:  # not before `OwnRecord.take` saw no twin
            return
        async with self._beat_lock:  # one write at a time: each over the last
            try:  # a record that cannot be made is a failed beat too, not the end of the beats (review h202)
                await self._own.write(self._kv, self._record())
            except Conflict as exc:
                self._beating = False  # nor its stop deletes the other box's record
                log.error("another box beats under this box's id", extra={"error": exc.message})
                if self._on_taken is not None:
                    self._on_taken(exc.message)
            except Exception as exc:
                self._heartbeats.failed(exc)
            else:
                self._heartbeats.succeeded()
                self._written(time.monotonic())
            if self._blind():  # nothing known of the workers meanwhile: their absence is counted from sight again
                self._workers_seen_at = time.monotonic()

    def _written(self, now: float) -> None:
        """A heartbeat of this box's written: if the last was over a TTL ago (this box frozen, stalled, behind a
        half-open link or cut off from NATS), the other boxes may have taken its gateway for gone and let its
        requests go (`gateway_gone`): `on_lapse` says so, and its gateway publishes again what it awaits."""
        lapsed_s = now - self._written_at if self._written_at is not None else 0.0
        self._written_at = now
        if lapsed_s > self._ttl_s and self._on_lapse is not None:
            self._on_lapse(lapsed_s)

    def _blind(self) -> bool:
        """Whether this box's view of the heartbeats is stale: its own record, written each beat, is not among the
        live ones it sees (its beats fail, or its watch is cut: a NATS failover, a quorum lost, a restart). Then the
        workers' records age out too, and a gateway-only box said "no box in the fleet runs models" with three
        workers up, until 4 s after the cluster was back (tester h87)."""
        record = self._boxes.get(self.box_id)
        return record is None or not self._live(record)

    def _record(self) -> bytes:
        """This box's record as it is now, for the first write under its id (`OwnRecord.take`) and each beat."""
        assert self._snapshot is not None
        return orjson.dumps({**self._snapshot(), "box": self.box_id, "ts": time.time()})

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            await self.beat()

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is not None:
                self._apply(entry)

    async def claim(self, what: str) -> bool:
        """Be the one box to do `what` (load a cold model, say) for the next TTL; False if another box is.
        A claim this box holds already is its own again: a model it evicted (or that was deleted and registered
        again) and loads anew did wait out its own earlier claim, up to a TTL (5 s) before a 0.05 s load."""
        assert self._kv is not None
        key = f"{_CLAIM}{what}"
        try:
            await self._kv.create(key, self.box_id.encode())
        except KeyWrongLastSequenceError:
            try:
                held = await self._kv.get(key)
            except KeyNotFoundError:  # lapsed or given back since: free, but taken on the next pass
                return False
            return held.value == self.box_id.encode()
        return True

    def gateway_gone(self, meta: RequestMeta) -> GatewayState:
        """Whether the gateway awaiting `meta`'s answer is known gone (`Hearing.gone`), or its run over (its box
        restarted under its id: `RequestMeta.run`, `Hearing.ended`, `_own_run_over`), so that no worker spends a
        decode slot, a batch or the backlog on it. A gateway only frozen or cut off publishes again what it awaits
        once it writes its heartbeat again (`on_lapse`); an ended run never comes back."""
        box = bus.reply_box(meta.reply)
        if box is None:
            return GatewayState.AWAITS
        if self._hearing.ended(box, meta.run) or (box == self.box_id and self._own_run_over(meta)):
            return GatewayState.OVER
        return GatewayState.GONE if self._hearing.gone(box) else GatewayState.AWAITS

    def _own_run_over(self, meta: RequestMeta) -> bool:
        """Whether `meta`, on this box's own reply subject, is of a run of this box before this one: it names another
        run and was sent before this one started. This box's fresh `Hearing` may never have heard that run (its last
        record expired before this start). Judged only while this box holds its id (`OwnRecord.holds`): a twin,
        refused at start or not yet judged (its first write failed), would take the live box's requests for its own
        dead run's (reviews h209, h211). A box whose id was taken while it was frozen holds it no more, yet judges
        until its next beat says so: the other's requests were sent after this one started (by the two hosts'
        clocks: one far behind would have some let go), so it lets none go."""
        started = self._own.started
        return (
            self._own.holds
            and bool(meta.run)
            and meta.run != self._run
            and isinstance(started, int | float)
            and 0 < meta.sent_ms < started * 1000
        )

    def without_workers_s(self) -> float:
        """Seconds since a live box taking model work was last heard of (or since this box started, or last saw the
        heartbeats): 0 while one is live, or while this box does not see its own (`_blind`). A gateway queues
        requests through a worker's restart, and refuses them once none has come back."""
        if taking_work(self.live_boxes(), MODEL_ROLES):
            return 0.0
        if self._beating and self._blind():  # each beat meanwhile moves `_workers_seen_at` on (`beat`)
            return 0.0
        return time.monotonic() - self._workers_seen_at

    async def release(self, what: str) -> None:
        """Give back this box's claim on `what` once it is done (a load finished, or failed): the heartbeat says
        the rest, and another box need not wait out the TTL to load the model again after an eviction here."""
        assert self._kv is not None
        key = f"{_CLAIM}{what}"
        with suppress(NatsError):
            held = await self._kv.get(key)
            if held.value == self.box_id.encode():
                await self._kv.delete(key, last=held.revision)

    def _apply(self, entry: KeyValue.Entry) -> None:
        if entry.key.startswith(_CLAIM):
            return
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self._boxes.pop(entry.key, None)
            self._holdings = None
            return
        with suppress(orjson.JSONDecodeError):
            record = orjson.loads(entry.value)
            if isinstance(record, dict):
                held_again = self._held_again(entry.key, record) if self._on_held_again is not None else []
                self._hearing.heard(entry.key, str(record.get("run") or ""))
                self._boxes[entry.key] = record
                self._holdings = None
                if taking_work([record], MODEL_ROLES):
                    self._workers_seen_at = time.monotonic()
                if held_again and self._on_held_again is not None:
                    self._on_held_again(held_again)

    def _held_again(self, box: str, record: dict[str, Any]) -> list[str]:
        """The models `record` has resident that no live box took work for until it came: not `box`'s last record
        (live, of the same run), nor another box's. A gateway measures their rates afresh (`Dispatcher.held_again`)."""
        resident = _resident(record)
        last = self._boxes.get(box)
        # Its last record live by when it arrived here, not by the time its writer wrote in it: a box whose clock ran
        # 4.5 s behind had its models held again at every beat, and their rates never measured (review h211).
        if resident and last is not None and last.get("run") == record.get("run") and self._hearing.heard_within(box):
            resident -= _resident(last)
        return [model for model in resident if all(holder == box for holder in self.holders(model))]

    def _live(self, record: dict[str, Any]) -> bool:
        """Whether a heartbeat record is live: written (by its writer's clock) within the TTL."""
        return time.time() - float(record.get("ts", 0)) <= self._ttl_s

    def live_boxes(self) -> list[dict[str, Any]]:
        return [record for record in self._boxes.values() if self._live(record)]

    def hears_itself(self) -> bool:
        """Whether this box's own heartbeat is live in its view of the fleet: not, while JetStream takes or delivers
        no heartbeat (a frozen or failing-over server), when the others' are missing for the same reason."""
        return any(record.get("box") == self.box_id for record in self.live_boxes())

    def _by_model(self) -> dict[str, list[_Holding]]:
        """Each model's entries in the heartbeats, made again only once a heartbeat changed: a gateway reads them for
        every request it admits (`holders`, `box_round`, `pace_per_gateway`), and walking every box's every model
        entry, reading each pace line afresh, took 15% of the event loop's samples in benchmarks/pull_vs_push.py (235
        us a request's reads with 10 boxes of 50 models each; 51 us so)."""
        if self._holdings is None:
            holdings: defaultdict[str, list[_Holding]] = defaultdict(list)
            for record in self._boxes.values():
                for entry in record.get("models", []):
                    if isinstance(entry, dict) and isinstance(name := entry.get("name"), str):
                        holdings[name].append(_Holding(record, entry, PaceLine.from_json(entry.get("batch_cost"))))
            self._holdings = dict(holdings)
        return self._holdings

    def _live_holdings(self, model: str, *, draining: bool = True) -> list[_Holding]:
        """`model`'s entries in the heartbeats of live boxes (not of draining ones, when `draining` is false)."""
        now = time.time()
        return [
            held
            for held in self._by_model().get(model, ())
            if now - float(held.record.get("ts", 0)) <= self._ttl_s and (draining or not held.record.get("draining"))
        ]

    def holders(self, model: str, *, loading: bool = False, draining: bool = False) -> list[str]:
        """Live boxes that have `model` resident (or, with `loading`, on its way), from their heartbeats; a draining
        one only with `draining`: it takes nothing new, and the requests it hands back need another box to load the
        model (tester h114: counted, the sole holder's drain left them to wait out its grace, then a 503)."""
        states = ("resident", "loading") if loading else ("resident",)
        holdings = self._live_holdings(model, draining=draining)
        boxes = (held.record["box"] for held in holdings if held.state in states)
        return list(dict.fromkeys(boxes))

    def held_by_draining(self, model: str) -> int:
        """The requests for `model` that live draining boxes holding it still keep (their heartbeats' `unacked`, a
        box's of an older version `held`): of its unacked requests, those are taken; the rest a draining box handed
        back (a nak, unseen in the queue's pending count) or a dead box took, and wait for a box to pull them."""
        return sum(
            int(held.entry.get("unacked", held.entry.get("held")) or 0)
            for held in self._live_holdings(model)
            if held.record.get("draining") and held.state == "resident"
        )

    def can_load(self, model: str) -> bool:
        """Whether a live box would serve `model` in its turn: one taking model work, which loads any model of the
        catalog that requests wait for (placement), evicting others for budget. A model evicted so is not gone: its
        refusals are overload, where with no such box live they are not (`Holders`). Not a box whose last load of it
        failed (its heartbeat's `load_failed`): counted as one, a refusal for a model whose folder fails on every box
        read as overload (a 429 "retry in 1s") where no box would answer it."""
        return any(
            not any(isinstance(each, dict) and each.get("name") == model for each in record.get("load_failed", []))
            for record in taking_work(self.live_boxes(), MODEL_ROLES)
        )

    def box_round(self, model: str, field: str = "round_tokens") -> int | None:
        """The tokens one round of `model`'s batches takes on a box that holds it, as its heartbeat says (its
        profile may batch far smaller than the catalog: 1,024 tokens against 16,384 for the default model on a
        2-core box); the largest of the live holders', or None while none says. `field` "round_rows": the rows
        a round holds (`box_round_rows`)."""
        rounds = [
            int(held.entry[field])
            for held in self._live_holdings(model, draining=False)
            if isinstance(held.entry.get(field), int) and held.entry[field] > 0
        ]
        return max(rounds, default=None)

    def box_round_rows(self, model: str) -> int | None:
        """The rows (inputs) one round of `model`'s batches holds on a box that holds it: a round of short inputs is
        bound by them long before its tokens (`box_round`)."""
        return self.box_round(model, "round_rows")

    def pace_per_gateway(self, model: str, per_row: float) -> tuple[float, float] | None:
        """(tokens, rows) a second the live boxes holding `model` compute in rows of `per_row` tokens, as their
        heartbeats' batch cost says (`PaceLine`; an older box's pace at the rows it ran lately), shared among the
        live gateways; None while no holder has measured its pace."""
        tokens = rows = 0.0
        measured = False
        for held in self._live_holdings(model, draining=False):
            pace = held.pace.at(per_row) if held.pace is not None else _pace_said(held.entry)
            if pace is not None:
                tokens, rows, measured = tokens + pace[0], rows + pace[1], True
        if not measured:
            return None
        gateways = max(1, len(taking_work(self.live_boxes(), GATEWAY_ROLES)))
        return tokens / gateways, rows / gateways

    def holders_per_gateway(self, model: str) -> Fraction:
        """The boxes' worth of `model` one gateway may fill: the live boxes holding it shared among the live
        gateways, neither counting a draining box, and never less than one box's. A gateway admits a generation
        by the decode slots free for it; counting one box's whatever the fleet held, a gateway-only box in front
        of two worker boxes refused half of what they could start. Not less than one: clients that favour one
        gateway would have its share of a single box's slots refuse a burst those slots could start."""
        gateways = len(taking_work(self.live_boxes(), GATEWAY_ROLES))
        resident = [held for held in self._live_holdings(model, draining=False) if held.state == "resident"]
        holding = len({id(held.record) for held in resident})  # boxes, each counted once
        return max(Fraction(1), Fraction(holding, max(1, gateways)))  # exact: slots are rounded down from it

    async def stop(self, *, connected: bool = True) -> None:
        """Stop beating and take this box's record out of `fbx_boxes`; cut off from NATS, the record is left to
        its TTL (the delete would wait out the shutdown step's bound for nothing)."""
        await self._stop_tasks(connected=connected)
        if connected and self._kv is not None and self._beating:  # not a twin's record (`OwnRecord.take`)
            with suppress(Exception):
                await self._kv.delete(self.box_id)


def taking_work(records: list[dict[str, Any]], roles: tuple[str, ...]) -> list[dict[str, Any]]:
    """The heartbeat records of boxes in one of `roles` that are not draining: those that take new work of that
    kind (a draining box finishes what it has and takes nothing new)."""
    return [record for record in records if record.get("role") in roles and not record.get("draining")]


def _pace_said(entry: dict[str, Any]) -> tuple[float, float] | None:
    """An older box's pace, read at the rows it ran lately: (tokens, rows) a second, where its heartbeat says both."""
    tokens, rows = entry.get("tokens_per_s"), entry.get("rows_per_s")
    if isinstance(tokens, int | float) and isinstance(rows, int | float) and tokens > 0 and rows > 0:
        return float(tokens), float(rows)
    return None


@dataclass(slots=True, frozen=True)
class _Holding:
    """One model's entry in one box's heartbeat, its pace line read once."""

    record: dict[str, Any]
    entry: dict[str, Any]
    pace: PaceLine | None

    @property
    def state(self) -> str:
        return str(self.entry.get("state", "resident"))


async def open_boxes_bucket(js: JetStreamContext, ttl_s: float, replicas: int = 1) -> KeyValue:
    return await bus.ensure_bucket(
        js, KeyValueConfig(bucket=bus.BOXES_BUCKET, history=1, ttl=ttl_s, replicas=replicas, storage=StorageType.MEMORY)
    )


def _resident(record: dict[str, Any]) -> set[str]:
    """The models a heartbeat record says are resident on its box."""
    entries = [e for e in record.get("models", []) if isinstance(e, dict) and e.get("state") == "resident"]
    return {name for e in entries if isinstance(name := e.get("name"), str)}
