"""Steering a fleet: pin, unpin, update, load, evict, drain, register, delete, shared by the TUI and the CLI.

Every action is a control verb sent to one box with `appliance.control.call_box`, so the TUI, the
`fleetbox models …` commands and the admin HTTP routes run the same code on the box and get the
same typed errors. Which box answers is chosen here from the heartbeats: catalog-wide verbs (pin,
update, register, delete) go to any live box, preferring one on this host for registration (the folder is judged
on the box that answers); `load` goes to the live worker with the most free memory unless a box
is named; `evict` without a box evicts from every box holding the model.

A verb is sent only once NATS is connected and answers: nats-py would hold a request published
during an outage and send it on reconnecting, and a server that hangs (SIGSTOP) with the
connection up would read it when it wakes, so an action taken then would run, unannounced, long
after its operator was told nothing. While NATS is out of reach an action waits for it at most
`REACH_TIMEOUT_S` (the bound of the CLI's connect), then fails with the CLI's words. The box is chosen only
after that wait, and after the fleet is read (within the same bound): before the TUI first reaches NATS it
knows no box, and an action then failed at once with `no live box in the fleet to ask` (tester h212). A choice
that finds no box is made again until the bound, as a fleet read before its first box beat knows none yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from appliance import bus
from appliance.control import call_box
from appliance.errors import Conflict, ServiceUnavailable, not_evicted
from appliance.settings import MODEL_NAME_MAX, MODEL_NAME_PATTERN, composed_form_problem
from tui.model import BoxState

REACH_TIMEOUT_S = 10.0  # how long an action waits for NATS to come back before it gives up
_CONNECTED_POLL_S = 0.1
_LEAST_ANSWER_S = 0.5  # the least time a connected server is given to answer, however little is left of the bound


def new_name_problem(name: str) -> str | None:
    """Why `name` cannot name a new model (the rule of `POST /v1/models`), in words for one line; None if it can.

    Checked before a box is asked: the box's answer quotes its schema (a regular expression, `$.name`)."""
    if not name.strip():
        return "is empty"
    if len(name) > MODEL_NAME_MAX:
        return f"is longer than {MODEL_NAME_MAX} characters"
    if re.fullmatch(MODEL_NAME_PATTERN, name):
        return composed_form_problem(name)
    hidden = next((c for c in name if not re.fullmatch(MODEL_NAME_PATTERN, f"a{c}a")), None)
    if hidden is not None:
        return f"has a control or invisible character (U+{ord(hidden):04X}), which a model's name may not have"
    return "starts or ends with a space, which a model's name may not"


class FleetOps:
    def __init__(
        self,
        nc: NATS,
        boxes: Callable[[], Sequence[BoxState]],
        timeout_s: float = 120.0,
        *,
        address: str = "",
        why_unreachable: Callable[[], str | None] = lambda: None,
        reach_timeout_s: float | None = None,
        fleet_read: Callable[[], bool] = lambda: True,
    ) -> None:
        self._nc = nc
        self._boxes = boxes  # the live view of the fleet, from heartbeats
        self._timeout_s = timeout_s
        self._address = address
        self._why_unreachable = why_unreachable  # the last connection problem, while NATS is down
        self._reach_timeout_s = reach_timeout_s or REACH_TIMEOUT_S
        self._fleet_read = fleet_read  # whether the boxes seen are the fleet's, read since NATS last answered

    async def pin(self, model: str) -> dict[str, Any]:
        return await self._call(self._any_box, "pin", {"model": model})

    async def unpin(self, model: str) -> dict[str, Any]:
        return await self._call(self._any_box, "unpin", {"model": model})

    async def update(self, model: str, change: dict[str, Any]) -> dict[str, Any]:
        """Change a model in place (the body of `PATCH /v1/models/{name}`): aliases, pin, batching knobs."""
        return await self._call(self._any_box, "update", {"model": model, "change": change})

    async def load(self, model: str, box: str | None = None) -> dict[str, Any]:
        return await self._call(box or self.roomiest_box, "load", {"model": model})

    async def evict(self, model: str, box: str | None = None) -> dict[str, Any]:
        """Evict from `box`, or from every live box that holds the model; says where it was evicted.

        A box named is refused as `load` refuses it when it runs no models, and it is an error when
        it does not hold the model (evicting from every box is done when none still holds it)."""
        if box:
            return await self._evict_from(model, box)
        # With no holder in the heartbeats, one box is asked all the same: it answers 404 for a model
        # that does not exist, and evicts one that became resident since its last heartbeat. A model no
        # box holds is evicted from every box already: `evicted_from: []`, as POST /v1/models/{name}/evict.
        # A box that runs models is asked: a gateway refuses the verb (tester h120: exit 1 behind a gateway).
        # With none that runs models live, a gateway is asked, only to judge the name ("where": it holds nothing).
        # The heartbeats name a model by its own name: where `model` is an alias, the first box's answer names it,
        # and its holders by that name are asked too (tester h226: by an alias, none or one of them was).
        await self._answering()  # the holders are judged from a fleet read, not from none known yet
        targets = self.holders(model) or [self._any_box(running_models=True)]
        evicted, name, asked = [], model, set()
        while targets:
            for target in targets:
                asked.add(target)
                result = await self._call(target, "evict", {"model": model, "where": "every holder"})
                name = result.get("model", name)  # its name, where `model` may be an alias
                if result.get("evicted"):
                    evicted.append(target)
            targets = [holder for holder in self.holders(name) if holder not in asked]
        return {"ok": True, "model": name, "evicted_from": evicted}

    async def _evict_from(self, model: str, box: str) -> dict[str, Any]:
        known = next((b for b in self._boxes() if b.box == box), None)
        if known is not None and not known.runs_models:
            raise Conflict(f"box {box} is a {known.role}; it runs no models")
        result = await self._call(box, "evict", {"model": model})
        if not result.get("evicted"):
            raise not_evicted(result.get("model", model), box, result)
        return {"ok": True, "model": result.get("model", model), "evicted_from": [box]}

    async def drain(self, box: str) -> dict[str, Any]:
        return await self._call(box, "drain", {})

    async def delete(self, model: str) -> dict[str, Any]:
        """Delete a model (or adapter) from the fleet's catalog, as `DELETE /v1/models/{name}`: its queued requests are
        answered 404 and it is unloaded everywhere; a base with adapters is refused until they are deleted."""
        return await self._call(self._any_box, "delete", {"model": model})

    async def register(self, registration: dict[str, Any], box: str | None = None) -> dict[str, Any]:
        """Register a model folder (the body of `POST /v1/models`); judged by `box` or a box on this host."""
        return await self._call(box or self._local_box, "register", registration)

    # -- choosing a box ---------------------------------------------------------------------------

    def live(self) -> list[BoxState]:
        """The boxes a verb may go to, those beating on time first: a box frozen (SIGSTOP, a hung host) is only late
        until its heartbeat expires, and a `models delete` sent to it waited out the verb's two minutes."""
        return sorted((b for b in self._boxes() if b.usable), key=lambda b: (b.status != "live", b.box))

    def workers(self) -> list[BoxState]:
        return [b for b in self.live() if b.runs_models]

    def holders(self, model: str) -> list[str]:
        return [b.box for b in self.live() if any(m.name == model and m.state == "resident" for m in b.models)]

    def roomiest_box(self) -> str:
        workers = self.workers()
        if not workers:
            raise ServiceUnavailable("no live box runs models; start one with --role worker or all")
        return max(workers, key=lambda b: b.budget_bytes - b.used_bytes).box

    def _any_box(self, *, running_models: bool = False) -> str:
        """A live box to ask, one that runs models if `running_models` and there is one."""
        live = (running_models and self.workers()) or self.live()
        if not live:
            raise ServiceUnavailable("no live box in the fleet to ask")
        return live[0].box

    def _local_box(self) -> str:
        here = socket.gethostname()
        live = self.live()
        local = [b for b in live if b.host == here]
        if not (local or live):
            raise ServiceUnavailable("no live box in the fleet to ask")
        return (local or live)[0].box

    async def _call(self, box: str | Callable[[], str], verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Send `verb` to `box`, or to the box `box()` chooses once NATS answers and the fleet is read."""
        deadline = await self._answering()
        target = box if isinstance(box, str) else await self._chosen(box, deadline)
        return await call_box(self._nc, target, verb, payload, timeout_s=self._timeout_s)

    async def _chosen(self, choose: Callable[[], str], deadline: float) -> str:
        """The box `choose` picks, asked again until the action's bound while it finds none: a fleet read before its
        first box beat (a TUI started before `fleetbox serve`, whose NATS is up a moment before its box's buckets
        and first heartbeat) knows no box yet (review h219)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return choose()
            except ServiceUnavailable:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(_CONNECTED_POLL_S)

    async def _answering(self) -> float:
        """Return once NATS is connected and answers, and the fleet is read, with the action's deadline (the loop's
        time); raise after `reach_timeout_s` without NATS (nothing is sent). A fleet still not read by then (no box
        ever started there) is the choice's to refuse.

        The answer asked for is a read the TUI makes each period anyway (the request stream's info), so it
        needs no permission more. Not `nc.flush(timeout)`: on a timeout it cancels its PONG's waiter, and the
        late PONG then stops the connection's read loop for good (nats-py 2.16)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reach_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                # Polled: the reconnect callback belongs to whoever made the connection (the box, embedded).
                while not self._nc.is_connected:  # noqa: ASYNC110
                    await asyncio.sleep(_CONNECTED_POLL_S)
        except TimeoutError:
            why = self._why_unreachable() or f"no connection within {self._reach_timeout_s:g} s"
            raise ServiceUnavailable(f"cannot reach NATS at {self._address}: {why}") from None
        try:
            await self._nc.jetstream(timeout=max(deadline - loop.time(), _LEAST_ANSWER_S)).stream_info(
                bus.REQUEST_STREAM
            )
        except TimeoutError:
            raise ServiceUnavailable(f"cannot reach NATS at {self._address}: no answer") from None
        except NatsError:  # no such stream (yet), no JetStream: answers all the same
            pass
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while not self._fleet_read():  # noqa: ASYNC110
                    await asyncio.sleep(_CONNECTED_POLL_S)
        return deadline
