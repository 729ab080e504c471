"""A fake fleet for the TUI's screen tests and its documentation screenshot: fixed data, fixed clock.

This is a fake on purpose: what these tests check is the screen, so the fleet behind it is a
scripted sequence of views (a box joins, models load and get evicted, throughput moves along a
fixed curve) with timestamps from a fixed instant. The live tests in `test_tui_live.py` drive the
same app against a real NATS and a real box.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from appliance.bus import model_slug
from appliance.catalog import Batching, ModelSpec
from runtimes.base import RuntimeKind, Task
from tui.model import BoxState, ConsumerState, Device, FleetView, QueueState, Resident, StreamState

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
GiB = 1024**3
MiB = 1024**2


def spec(name: str, task: Task, *, pinned: bool = False, adapter_of: str | None = None) -> ModelSpec:
    return ModelSpec(
        name=name,
        slug=model_slug(name),
        task=task,
        runtime=RuntimeKind.TORCH,
        path=Path("/srv/models") / model_slug(name),
        batching=Batching(16384, 256, 2.0),
        pinned=pinned,
        adapter_of=adapter_of,
    )


CATALOG = (
    spec("all-minilm-l6-v2", Task.EMBED, pinned=True),
    spec("bge-reranker-base", Task.SCORE),
    spec("distilbert-sst2", Task.CLASSIFY),
    spec("qwen2.5-0.5b", Task.GENERATE),
    spec("qwen2.5-0.5b:sql", Task.GENERATE, adapter_of="qwen2.5-0.5b"),
)


def box(
    box_id: str,
    *,
    role: str = "all",
    device: str = "cuda:0",
    device_name: str = "NVIDIA L4",
    used: int = 0,
    budget: int = 20 * GiB,
    models: tuple[Resident, ...] = (),
    ts: float = T0,
    status: str = "live",
    backlog: int = 37,
) -> BoxState:
    return BoxState(
        box=box_id,
        host=box_id.rsplit("-", 1)[0],
        role=role,
        version="0.1.0",
        build="5552098b1c3e",
        ts=ts,
        uptime_s=7384.0,
        draining=status == "draining",
        http_port=8080 if role != "worker" else None,
        devices=(Device(device_name, device, used, budget),) if role != "gateway" else (Device("none", "none", 0, 0),),
        models=models,
        backlog=backlog,
        status=status,
    )


def resident(
    name: str, nbytes: int, rps: float, *, pinned: bool = False, state: str = "resident", adapters: tuple = ()
) -> Resident:
    p50 = 3.0 + rps / 200 if rps else 0.0
    return Resident(name, state, nbytes, pinned, round(rps, 1), round(p50, 1), round(p50 * 2.8, 1), 12, 0, adapters)


def queue(step: int) -> QueueState:
    consumers = tuple(
        ConsumerState(f"{kind}_{s.slug}", f"fbx.{'bulk' if kind == 'bulk' else 'req'}.{s.slug}", pending, ack, red, 1)
        for s, kind, pending, ack, red in (
            (CATALOG[0], "req", 21 + step % 5, 64, 0),
            (CATALOG[0], "bulk", 1200, 0, 0),
            (CATALOG[1], "req", 9, 16, 3),
            (CATALOG[2], "req", 0, 0, 0),
            (CATALOG[3], "req", 7, 4, 0),
        )
    )
    return QueueState(
        stream=StreamState("FBX_REQ", 1237 + step % 5, 1_843_200, 100_000, GiB),
        consumers=consumers,
        dead_letters=StreamState("FBX_DLQ", 2, 4096, 10_000, -1, {"fbx.dlq.bge-reranker-base": 2}),
    )


def fleet_view(step: int) -> FleetView:
    """The fleet `step` seconds after T0: throughput follows fixed curves; things happen at set steps."""
    at = T0 + step
    wave = math.sin(step / 3.0)
    a_models = [
        resident("all-minilm-l6-v2", 91 * MiB, 410 + 60 * wave, pinned=True),
        resident("bge-reranker-base", 279 * MiB, 36 + 9 * math.cos(step / 2.0)),
    ]
    if step >= 20:
        adapters = ("qwen2.5-0.5b:sql",) if step >= 25 else ()
        state = "loading" if step < 24 else "resident"
        a_models.append(
            resident("qwen2.5-0.5b", 1020 * MiB, 2.5 if step >= 24 else 0.0, state=state, adapters=adapters)
        )
    b_models = [resident("all-minilm-l6-v2", 91 * MiB, 395 + 55 * math.cos(step / 3.0), pinned=True)]
    if step < 12:
        b_models.append(resident("distilbert-sst2", 256 * MiB, 4.0))
    boxes = [
        box("gpu-a-7f3k2q", used=int(9.1 * GiB), models=tuple(a_models), ts=at - 0.4),
        box("gpu-b-19ab4c", role="worker", used=int(3.2 * GiB), models=tuple(b_models), ts=at - 0.7),
        box("edge-gw-k2m9x1", role="gateway", ts=at - 0.2),
    ]
    if step >= 8:
        boxes.append(box("cpu-c-88pq0z", device="cpu", device_name="cpu (16 cores)", used=0, budget=32 * GiB,
                         ts=at - 1.1, status="live" if step < 26 else "dead"))  # fmt: skip
    if step >= 28:
        boxes[1] = replace(boxes[1], status="draining", draining=True)
    catalog = tuple(replace(s, pinned=True) if s.name == "bge-reranker-base" and step >= 16 else s for s in CATALOG)
    return FleetView(
        address="nats://nats-1.lan:4222", taken_at=at, boxes=tuple(boxes), catalog=catalog, queue=queue(step)
    )


class FakeOps:
    """Records what the screens ask for and answers as a box would."""

    def __init__(self, source: FakeSource) -> None:
        self._source = source
        self.calls: list[tuple[str, Any]] = []

    def live(self) -> list[BoxState]:
        return [b for b in self._source.view_now().boxes if b.usable]

    def holders(self, model: str) -> list[str]:
        return [b.box for b in self.live() if any(m.name == model and m.state == "resident" for m in b.models)]

    async def pin(self, model: str) -> dict[str, Any]:
        self.calls.append(("pin", model))
        return {"ok": True, "box": "gpu-a-7f3k2q", "model": model, "pinned": True}

    async def unpin(self, model: str) -> dict[str, Any]:
        self.calls.append(("unpin", model))
        return {"ok": True, "box": "gpu-a-7f3k2q", "model": model, "pinned": False}

    async def load(self, model: str, box: str | None = None) -> dict[str, Any]:
        self.calls.append(("load", (model, box)))
        return {"ok": True, "box": box or "gpu-a-7f3k2q", "model": model, "state": "resident"}

    async def evict(self, model: str, box: str | None = None) -> dict[str, Any]:
        self.calls.append(("evict", (model, box)))
        return {"model": model, "evicted_from": [box] if box else self.holders(model)}

    async def drain(self, box: str) -> dict[str, Any]:
        self.calls.append(("drain", box))
        return {"ok": True, "box": box, "draining": True}

    async def register(self, registration: dict[str, Any], box: str | None = None) -> dict[str, Any]:
        self.calls.append(("register", registration))
        return {"ok": True, "box": "gpu-a-7f3k2q", "model": registration["name"], "task": "embed"}


class FakeSource:
    """Steps through `fleet_view(0..steps-1)`, one view per `view()` call, then stays on the last."""

    def __init__(self, steps: int = 30) -> None:
        self._steps = steps
        self._step = 0
        self.ops = FakeOps(self)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def view_now(self) -> FleetView:
        return fleet_view(min(self._step, self._steps - 1))

    def view(self) -> FleetView:
        current = self.view_now()
        self._step = min(self._step + 1, self._steps - 1)
        return current

    @property
    def exhausted(self) -> bool:
        return self._step >= self._steps - 1


def save_screenshots(folder: Path) -> list[Path]:
    """The documentation's screenshots (docs/tui.md): each screen of the fake fleet, as SVG."""
    from textual.pilot import Pilot

    from tui.app import FleetboxApp

    written = []

    async def shoot(pilot: Pilot, keys: tuple[str, ...], name: str) -> None:
        app = pilot.app
        assert isinstance(app, FleetboxApp) and isinstance(app.source, FakeSource)
        while not app.source.exhausted:
            app.tick()
        app.tick()
        await pilot.press(*keys)
        await pilot.pause()
        written.append(Path(app.save_screenshot(name, path=str(folder))))
        app.exit()

    for screen, keys in (("fleet", ()), ("models", ("2",)), ("queue", ("3",)), ("events", ("4",))):
        app = FleetboxApp(FakeSource(), refresh_s=0)
        name = f"tui-{screen}.svg"
        app.run(headless=True, size=(80, 24), auto_pilot=lambda pilot, k=keys, n=name: shoot(pilot, k, n))
    return written


if __name__ == "__main__":
    import os
    import sys
    import time

    os.environ["TZ"] = "UTC"
    time.tzset()
    for path in save_screenshots(Path(sys.argv[1] if len(sys.argv) > 1 else "docs")):
        print(path)
