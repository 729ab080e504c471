"""Steering a fleet: pin, unpin, load, evict, drain, register, shared by the TUI and the CLI.

Every action is a control verb sent to one box with `appliance.control.call_box`, so the TUI, the
`fleetbox models …` commands and the admin HTTP routes run the same code on the box and get the
same typed errors. Which box answers is chosen here from the heartbeats: catalog-wide verbs (pin,
register) go to any live box, preferring one on this host for registration (the folder is judged
on the box that answers); `load` goes to the live worker with the most free memory unless a box
is named; `evict` without a box evicts from every box holding the model.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from nats.aio.client import Client as NATS

from appliance.control import call_box
from appliance.errors import NotFound, ServiceUnavailable
from tui.model import BoxState


class FleetOps:
    def __init__(self, nc: NATS, boxes: Callable[[], Sequence[BoxState]], timeout_s: float = 120.0) -> None:
        self._nc = nc
        self._boxes = boxes  # the live view of the fleet, from heartbeats
        self._timeout_s = timeout_s

    async def pin(self, model: str) -> dict[str, Any]:
        return await self._call(self._any_box(), "pin", {"model": model})

    async def unpin(self, model: str) -> dict[str, Any]:
        return await self._call(self._any_box(), "unpin", {"model": model})

    async def load(self, model: str, box: str | None = None) -> dict[str, Any]:
        return await self._call(box or self.roomiest_box(), "load", {"model": model})

    async def evict(self, model: str, box: str | None = None) -> dict[str, Any]:
        """Evict from `box`, or from every live box that holds the model; says where it was evicted."""
        targets = [box] if box else self.holders(model)
        # With no holder in the heartbeats, one box is asked all the same: it answers 404 for a model
        # that does not exist, and evicts one that became resident since its last heartbeat.
        probing = not targets
        evicted = []
        for target in targets or [self._any_box()]:
            result = await self._call(target, "evict", {"model": model})
            if result.get("evicted"):
                evicted.append(target)
        if probing and not evicted:
            raise NotFound(f"model {model!r} is not resident on any live box", code="model_not_resident")
        return {"model": model, "evicted_from": evicted}

    async def drain(self, box: str) -> dict[str, Any]:
        return await self._call(box, "drain", {})

    async def register(self, registration: dict[str, Any], box: str | None = None) -> dict[str, Any]:
        """Register a model folder (the body of `POST /v1/models`); judged by `box` or a box on this host."""
        return await self._call(box or self._local_box(), "register", registration)

    # -- choosing a box ---------------------------------------------------------------------------

    def live(self) -> list[BoxState]:
        return sorted((b for b in self._boxes() if b.usable), key=lambda b: b.box)

    def workers(self) -> list[BoxState]:
        return [b for b in self.live() if b.runs_models]

    def holders(self, model: str) -> list[str]:
        return [b.box for b in self.live() if any(m.name == model and m.state == "resident" for m in b.models)]

    def roomiest_box(self) -> str:
        workers = self.workers()
        if not workers:
            raise ServiceUnavailable("no live box runs models; start one with --role worker or all")
        return max(workers, key=lambda b: b.budget_bytes - b.used_bytes).box

    def _any_box(self) -> str:
        live = self.live()
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

    async def _call(self, box: str, verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        return await call_box(self._nc, box, verb, payload, timeout_s=self._timeout_s)
