"""Which cold models this box starts pulling for (DESIGN.md §2).

A box always pulls for the models resident on it. It loads a cold model only when requests wait
for it and either no live box holds it (from the heartbeats) or its backlog has passed
`cold_backlog`, so the fleet loads a model once, not everywhere, and a second box joins only
under sustained load. The first load of a model is claimed in the fleet's bucket (one box wins), and a
box announces a load in its heartbeat as it starts, so others see it is on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from appliance import bus
from appliance.catalog import ModelSpec
from appliance.delivery import HandBack, deliver_reply
from appliance.envelope import PRIORITIES, ReplyMeta, RequestMeta
from appliance.errors import (
    FleetboxError,
    InsufficientMemory,
    NotFound,
    ServiceUnavailable,
    UnloadedWhileStarting,
    reason_of,
)
from appliance.fleet import taking_work
from appliance.logs import FailureStreak
from appliance.model_bytes import size_text
from appliance.puller import Puller, stop_pullers
from appliance.settings import MODEL_ROLES
from appliance.tasks import Background, cancel_and_wait

if TYPE_CHECKING:
    from appliance.app import Box

log = logging.getLogger(__name__)

_PERIOD_S = 0.25
_JITTER_S = 0.3
_RETRY_AFTER_FAILURE_S = 30.0


def _load_claim(spec: ModelSpec) -> str:
    return f"load.{spec.slug}"


def load_failed(model: str, box_id: str, exc: BaseException) -> ServiceUnavailable:
    """The 503 for a model whose load failed on this box, as a waiting request or an admin `load` sees it."""
    return ServiceUnavailable(f"model {model} could not be loaded on box {box_id}: {reason_of(exc)}")


def fits_no_box(model: str, need_bytes: int, largest: tuple[str, int]) -> InsufficientMemory:
    """The 507 for a model larger than every live box's memory budget: no box will load it until a larger one
    joins, where a 503 (try again soon) would have the client retry a load that fails the same way."""
    box_id, budget = largest
    return InsufficientMemory(
        f"model {model} needs about {size_text(need_bytes)}, more than any box in the fleet can hold: the largest "
        f"memory budget is {size_text(budget)} (box {box_id})",
        need_bytes=need_bytes,
    )


@dataclass(slots=True, frozen=True)
class _Failure:
    """A load of a model that failed here: not tried again before `until` (loop time), unless what it depends on
    changes (its registration `spec`; memory, `for_memory`: a pin let go)."""

    until: float
    spec: ModelSpec
    for_memory: bool = False


class Placement:
    def __init__(self, box: Box) -> None:
        self._box = box
        self._task: asyncio.Task[None] | None = None
        self._loading: set[str] = set()
        self._loads = Background("placement")
        # A model that failed to load is retried later, not hammered: when, and the registration whose load failed.
        self._failed: dict[str, _Failure] = {}
        self.refusing: set[str] = set()  # models whose waiting requests this box answers with its load error
        self._changed: dict[str, asyncio.Event] = {}  # set when what a load of a model refused here depends on changes

    @property
    def loading(self) -> set[str]:
        return set(self._loading)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="placement")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        await self._loads.cancel()

    async def _run(self) -> None:
        passes = FailureStreak(log, "placement pass")
        while True:
            await asyncio.sleep(_PERIOD_S)
            try:
                await self._consider_all()
            except Exception as exc:
                passes.failed(exc)
            else:
                passes.succeeded()

    async def _consider_all(self) -> None:
        box = self._box
        if box.draining or box.js is None:
            return
        for spec in box.catalog:
            if spec.adapter_of is not None or spec.name in box.workers or spec.name in self._loading:
                continue
            failed = self._failed.get(spec.name)
            if failed is not None and failed.until > asyncio.get_running_loop().time():
                continue
            if spec.pinned and box.residency.load_error(spec.name) is not None:
                # Every box that runs models holds a pinned model: one whose load failed (at start, or at its pin)
                # is tried again after the back-off, not only once requests wait (tester h73: a pinned model whose
                # folder came back stayed cold).
                if await self._could_fit(spec):
                    self._loading.add(spec.name)
                    self._loads.spawn(self._load(spec, claimed=False))
                continue
            waiting = await self._waiting(spec.slug, self._taken(spec.name))
            if waiting == 0 or not self._should_load(spec.name, waiting) or not await self._could_fit(spec):
                continue
            await asyncio.sleep(random.uniform(0, _JITTER_S))
            if not self._should_load(spec.name, waiting):
                continue
            claimed = not self._holders(spec.name) and box.fleet is not None
            if claimed and not await box.fleet.claim(_load_claim(spec)):
                continue  # another box claimed the first load of this model
            self._loading.add(spec.name)
            if box.fleet is not None:
                await box.fleet.beat()  # tell the fleet at once that this model is on its way here
            self._loads.spawn(self._load(spec, claimed))

    async def _could_fit(self, spec: ModelSpec) -> bool:
        """Whether this box should try to load the model: not one it could never hold while a box with a larger
        budget is live (it claimed the load, failed at once, and the fleet refused the model's requests for the
        30 s back-off while that box had room)."""
        try:
            await self._box.residency.check_fits(spec)
        except InsufficientMemory:
            return not self._a_larger_box_is_live()  # with none, this box tries, fails and says why (its 503)
        return True

    def _a_larger_box_is_live(self) -> bool:
        """Another live box that runs models, not draining, with a larger memory budget (from the heartbeats)."""
        return self._largest_budget()[0] != self._box.box_id

    def _largest_budget(self) -> tuple[str, int]:
        """The box, this one or another live box that runs models and is not draining, with the largest memory
        budget (from the heartbeats), and that budget; this box's on a tie."""
        box = self._box
        largest = (box.box_id, box.residency.budget_bytes)
        for record in taking_work(box.fleet.live_boxes(), MODEL_ROLES) if box.fleet is not None else []:
            if record.get("box") == box.box_id:
                continue
            budget = max((device.get("budget_bytes") or 0 for device in record.get("devices", [])), default=0)
            if budget > largest[1]:
                largest = (str(record.get("box")), budget)
        return largest

    def _load_error(self, spec: ModelSpec, exc: Exception) -> FleetboxError:
        """What the requests waiting for a model this box failed to load are told: 507 when the model is larger
        than every live box's budget, by its estimate or by what its load measured (no retry helps until a larger
        box joins), else the 503 of a failed load (a corrupt folder, a box short of memory for its pinned models,
        a larger box that joined meanwhile)."""
        if isinstance(exc, InsufficientMemory) and exc.need_bytes:
            largest = self._largest_budget()
            if exc.need_bytes > largest[1]:
                return fits_no_box(spec.name, exc.need_bytes, largest)
        return load_failed(spec.name, self._box.box_id, exc)

    def _holders(self, name: str, *, draining: bool = False) -> list[str]:
        return self._box.fleet.holders(name, loading=True, draining=draining) if self._box.fleet else []

    def _should_load(self, name: str, waiting: int) -> bool:
        return not self._holders(name) or waiting >= self._box.settings.cold_backlog

    def _taken(self, name: str) -> int | None:
        """Of a model's unacked requests, how many are being computed: None (all of them) while a live box that is
        not draining holds or loads it; else what its draining holders still compute (`Fleet.held_by_draining`).
        The rest wait for a box to pull them: a dead box's come back once their `ack_wait` runs out, and what a
        draining box hands back is a nak, never in the queue's pending count (tester h226: the sole holder's own
        clients, every request pulled before its drain, waited out its grace for a 503 while another box idled)."""
        if self._holders(name):
            return None
        return self._box.fleet.held_by_draining(name) if self._box.fleet is not None else 0

    async def _waiting(self, slug: str, taken: int | None) -> int:
        """Requests waiting for a model: those in its queue, and of those taken but not acked, all but `taken`
        (counting only the queue, a dead box's request waited out its deadline)."""
        assert self._box.js is not None
        waiting = 0
        for priority in PRIORITIES:
            try:
                info = await self._box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(slug, priority))
            except NotFoundError:
                continue
            waiting += int(info.num_pending or 0)
            if taken is not None:
                waiting += max(0, int(info.num_ack_pending or 0) - taken)
                taken = max(0, taken - int(info.num_ack_pending or 0))  # the held are counted once over both
        return waiting

    async def _load(self, spec: ModelSpec, claimed: bool) -> None:
        try:
            await self._serve(spec, claimed)
        except NotFound as exc:  # deleted (or registered again elsewhere) while it loaded: nothing failed
            log.info("model deleted while it loaded", extra={"model": spec.name, "error": exc.message})
        except UnloadedWhileStarting as exc:  # evicted for another load: its requests still wait, and a pass loads it
            log.info("model unloaded while it started", extra={"model": spec.name, "error": exc.message})
        except Exception as exc:
            error = self._load_error(spec, exc)
            current = self._box.catalog.get(spec.name)
            if current is None or current.load_key() != spec.load_key():
                # Deleted or registered again while it loaded: the new registration's load is another try.
                log.info("model changed while a load failed", extra={"model": spec.name, "error": error.message})
                self._box.residency.forget_load_error(spec.name, current)
                return
            log.error("loading a model requests wait for failed", extra={"model": spec.name, "error": error.message})
            until = asyncio.get_running_loop().time() + _RETRY_AFTER_FAILURE_S
            self._failed[spec.name] = _Failure(until, spec, for_memory=isinstance(exc, InsufficientMemory))
            self._loading.discard(spec.name)  # no longer on its way here (before the refusing): other boxes may try
            if not (self._box.fleet and self._box.fleet.holders(spec.name)):
                # No box can answer them: say why now rather than let them wait out their deadlines.
                await self._refuse(spec, error)
        finally:
            self._loading.discard(spec.name)

    async def _serve(self, spec: ModelSpec, claimed: bool) -> None:
        """Load the model and start its worker; a first-load claim is given back either way (the heartbeat
        has said where it is by then)."""
        try:
            await self._box.workers.serve(spec)
        finally:
            if claimed and self._box.fleet is not None:
                await self._box.fleet.release(_load_claim(spec))

    def forget_failure(self, name: str, spec: ModelSpec | None) -> None:
        """The catalog says `name` is now `spec` (None: deleted). If what a load of it depends on changed, a load
        that failed is no reason to wait before the next, nor to answer its requests with that failure (a user
        who fixed a broken folder and registered it again got the old folder's error for the 30 s back-off). A
        change of aliases or batching, or the catalog replayed after a reconnect, is the same failing model."""
        self._box.residency.forget_load_error(name, spec)  # a failed load of any path (pinned, the `load` verb)
        failed = self._failed.get(name)
        if failed is None or (spec is not None and spec.load_key() == failed.spec.load_key()):
            return
        del self._failed[name]
        changed = self._changed.get(name)
        if changed is not None:
            changed.set()

    def memory_freed(self) -> None:
        """A model was unpinned or deleted: a load refused for memory is no reason to wait out the back-off, nor to
        answer its requests with the refusal (they read `... with 66 MiB pinned` for 30 s after the pins were gone,
        residency tester h65); a pass tries it again."""
        for name in [name for name, failed in self._failed.items() if failed.for_memory]:
            del self._failed[name]
            changed = self._changed.get(name)
            if changed is not None:
                changed.set()

    async def _refuse(self, spec: ModelSpec, error: FleetboxError) -> None:
        """Answer the requests waiting for a model that failed to load, until the next load attempt here, until
        another box holds it (or is loading it): from then on that box answers them, or until the model is
        changed (`forget_failure`)."""
        box = self._box
        assert box.nc is not None

        def answer(msg: Msg) -> None:
            self._loads.spawn(self._answer(msg, error))

        # Both priorities: a batch-priority request would otherwise wait out its deadline for a 504.
        pullers = [
            Puller(
                box.nc,
                spec.slug,
                bus.refuse_inbox(box.box_id, spec.slug, priority),
                lambda: 64,
                answer,
                priority=priority,
                hand_back=self._hand_back(),
            )
            for priority in PRIORITIES
        ]
        self.refusing.add(spec.name)
        changed = self._changed[spec.name] = asyncio.Event()
        try:
            for puller in pullers:
                await puller.start()
            for _ in range(round(_RETRY_AFTER_FAILURE_S / _PERIOD_S)):  # heartbeats say who holds it: polled
                if set(self._holders(spec.name)) - {box.box_id}:  # its own heartbeat may still say "loading"
                    break
                if spec.name in box.workers:  # loaded here after all (the `load` verb, a pin): its worker answers
                    self._failed.pop(spec.name, None)
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), _PERIOD_S)
                if changed.is_set():
                    break
        finally:
            self.refusing.discard(spec.name)
            if self._changed.get(spec.name) is changed:
                del self._changed[spec.name]
            await stop_pullers(pullers)

    def served(self, name: str) -> None:
        """`name` was loaded here after all (the `load` verb): a refusal of its requests ends now."""
        self._failed.pop(name, None)
        changed = self._changed.get(name)
        if changed is not None:
            changed.set()

    def _hand_back(self) -> HandBack:
        """How this box gives back a request it refused for: not dead-lettered on its last delivery."""
        assert self._box.nc is not None
        return HandBack(
            self._box.nc,
            self._box.settings.max_deliver,
            self._box.workers.queue_epoch,
            ack_wait_s=self._box.settings.ack_wait_s,
        )

    async def _answer(self, msg: Msg, error: FleetboxError) -> None:
        assert self._box.nc is not None
        try:
            meta = RequestMeta.from_headers(msg.headers)
        except ValueError:
            await msg.term()
            return
        if meta.model in self._box.workers:
            # Loaded here since the refusal began (the `load` verb, a pin): its worker answers it. The refusal's
            # pull, still open, took the next request before the worker's, and answered it the old error (h50).
            # Handed back after the refusal has stopped (it looks every `_PERIOD_S`): at once, the refusal's own
            # pull could take it again and again, each a delivery, until it was dead-lettered (review r50). On its
            # last delivery, where a nak has it dead-lettered (review h132), the worker takes it in itself, or, one
            # draining (an eviction meanwhile), it is queued afresh for another delivery (review h141).
            if (msg.metadata.num_delivered or 1) >= self._box.settings.max_deliver:
                if not self._box.workers[meta.model].take(msg):
                    await self._hand_back()(msg)
                return
            await msg.nak(delay=2 * _PERIOD_S)
            return
        # A 503: until this box tries the load again, a retry gets the same answer (a 507's retry waits for a box).
        failed = self._failed.get(meta.model) if error.status == 503 else None
        retry = max(1, math.ceil(failed.until - asyncio.get_running_loop().time())) if failed else 0
        reply = ReplyMeta.for_error(meta.id, error, self._box.box_id, retry_after_s=retry)
        # Acked only once its gateway has the answer: one sent while the gateway reconnects is sent again, not lost.
        if not await deliver_reply(self._box.nc, meta, error.to_json(), reply.headers(), lambda: self._box.draining):
            # This box is stopping with the answer undelivered: another box answers it.
            await self._hand_back()(msg)
            return
        assert self._box.blobs is not None  # made with the connection
        await self._box.blobs.ack(msg, meta.blob)
