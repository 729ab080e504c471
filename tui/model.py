"""What the TUI shows, as plain values: one `FleetView` per refresh, built from NATS alone.

A view is a snapshot (boxes from their heartbeats, the catalog, the queue's stream and consumer
info) taken at one instant, `taken_at`. Screens only render views and the rows derived from them
here, so a screen can be tested with a view built by hand and the live source can be swapped for
a fake without the screens knowing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.catalog import ModelSpec


@dataclass(slots=True, frozen=True)
class Device:
    name: str
    device: str
    used_bytes: int
    budget_bytes: int


@dataclass(slots=True, frozen=True)
class Resident:
    """One model on one box, as that box's heartbeat describes it."""

    name: str
    state: str  # resident | loading
    nbytes: int | None
    pinned: bool
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    held: int = 0
    errors: int = 0
    adapters: tuple[str, ...] = ()  # LoRA adapters loaded on this base model here


@dataclass(slots=True, frozen=True)
class LoadFailure:
    """A model whose last load on one box failed, as that box's heartbeat says (its `load_failed`)."""

    name: str
    error: str  # one line, cut by the box
    at: float  # when (the box's clock)


@dataclass(slots=True, frozen=True)
class BoxState:
    box: str
    host: str
    role: str
    version: str
    build: str
    ts: float  # when the box wrote this heartbeat (its clock)
    uptime_s: float
    draining: bool
    http_port: int | None
    devices: tuple[Device, ...]
    models: tuple[Resident, ...]
    backlog: int
    status: str = "live"  # live | late | draining | dead | left: set by the source, not the box
    load_failed: tuple[LoadFailure, ...] = ()
    names_failures: bool = False  # its record has `load_failed` (a box of an older version's has not)

    @classmethod
    def from_heartbeat(cls, record: dict[str, Any], status: str | None = None) -> BoxState:
        """Parse a heartbeat leniently: a field a box of another version lacks is shown as empty."""
        devices = tuple(
            Device(
                name=str(d.get("name", "")),
                device=str(d.get("device", "")),
                used_bytes=int(d.get("used_bytes") or 0),
                budget_bytes=int(d.get("budget_bytes") or 0),
            )
            for d in record.get("devices") or ()
            if isinstance(d, dict)
        )
        models = tuple(
            Resident(
                name=str(m.get("name", "")),
                state=str(m.get("state", "resident")),
                nbytes=m.get("bytes"),
                pinned=bool(m.get("pinned")),
                rps=float(m.get("rps") or 0.0),
                p50_ms=float(m.get("p50_ms") or 0.0),
                p99_ms=float(m.get("p99_ms") or 0.0),
                held=int(m.get("held") or 0),
                errors=int(m.get("errors") or 0),
                adapters=tuple(str(a) for a in m.get("adapters") or ()),
            )
            for m in record.get("models") or ()
            if isinstance(m, dict)
        )
        load_failed = tuple(
            LoadFailure(name=str(f.get("name", "")), error=str(f.get("error", "")), at=float(f.get("at") or 0.0))
            for f in record.get("load_failed") or ()
            if isinstance(f, dict)
        )
        draining = bool(record.get("draining"))
        return cls(
            box=str(record.get("box", "?")),
            host=str(record.get("host", "")),
            role=str(record.get("role", "")),
            version=str(record.get("version", "")),
            build=str(record.get("build") or ""),
            ts=float(record.get("ts") or 0.0),
            uptime_s=float(record.get("uptime_s") or 0.0),
            draining=draining,
            http_port=record.get("http_port"),
            devices=devices,
            models=models,
            backlog=int(record.get("backlog") or 0),
            status=status or ("draining" if draining else "live"),
            load_failed=load_failed,
            names_failures="load_failed" in record,
        )

    @property
    def rps(self) -> float:
        return sum(m.rps for m in self.models)

    @property
    def p99_ms(self) -> float:
        """The worst model's p99 on this box: a bound, since latencies of different models do not add."""
        return max((m.p99_ms for m in self.models), default=0.0)

    @property
    def used_bytes(self) -> int:
        return sum(d.used_bytes for d in self.devices)

    @property
    def budget_bytes(self) -> int:
        return sum(d.budget_bytes for d in self.devices)

    @property
    def runs_models(self) -> bool:
        return self.role in ("all", "worker")

    @property
    def failed_loads(self) -> dict[str, str]:
        """Model -> why its last load on this box failed, as its record says."""
        return {f.name: f.error for f in self.load_failed}

    @property
    def usable(self) -> bool:
        """Whether a control verb sent now would be answered by a box that keeps serving."""
        return self.status in ("live", "late")


@dataclass(slots=True, frozen=True)
class ConsumerState:
    name: str
    subject: str
    pending: int
    ack_pending: int
    redelivered: int
    waiting: int

    @property
    def slug(self) -> str:
        """The model slug a request consumer serves: the last token of its subject (fbx.<kind>.<slug>)."""
        return self.subject.rsplit(".", 1)[-1]


@dataclass(slots=True, frozen=True)
class StreamState:
    name: str
    messages: int
    nbytes: int
    max_msgs: int  # -1: unlimited
    max_bytes: int
    subjects: dict[str, int] = field(default_factory=dict)  # per subject, where asked for (dead letters)


@dataclass(slots=True, frozen=True)
class QueueState:
    stream: StreamState | None
    consumers: tuple[ConsumerState, ...] = ()
    dead_letters: StreamState | None = None  # None: the fleet has no FBX_DLQ stream
    error: str | None = None  # why the last poll failed, shown instead of stale numbers


@dataclass(slots=True, frozen=True)
class FleetView:
    address: str  # where the TUI is attached, for the status line
    taken_at: float
    boxes: tuple[BoxState, ...] = ()
    catalog: tuple[ModelSpec, ...] = ()
    queue: QueueState | None = None
    connected: bool = True
    waiting_for: str | None = None  # e.g. "no fleet at this address yet"
    problem: str | None = None  # while not connected: why the last attempt failed ("connection refused")
    # While NATS is out of reach (or being read again after it): the boxes and models are as they were
    # last seen at this instant, not judged now (a box is not dead because its heartbeats cannot arrive).
    stale_since: float | None = None

    def box(self, box_id: str) -> BoxState | None:
        return next((b for b in self.boxes if b.box == box_id), None)

    def spec(self, name: str) -> ModelSpec | None:
        return next((s for s in self.catalog if s.name == name), None)

    def live_boxes(self) -> list[BoxState]:
        return [b for b in self.boxes if b.usable]


@dataclass(slots=True, frozen=True)
class ModelRow:
    """One catalog model across the fleet: where it lives and how it is doing."""

    name: str
    task: str
    runtime: str
    adapter_of: str | None
    pinned: bool
    state: str  # resident | loading | failed | cold
    boxes: tuple[str, ...]
    nbytes: int | None
    backlog: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    load_failed_on: dict[str, str] = field(default_factory=dict)  # box -> why its last load of the model failed


def listing_order(catalog: Sequence[ModelSpec]) -> list[ModelSpec]:
    """Models by name, each followed by its adapters (by name): a screen shows an adapter under its base. An
    adapter whose base is not a model of the catalog stands among the models."""
    bases = {spec.name for spec in catalog if spec.adapter_of is None}
    adapters: dict[str, list[ModelSpec]] = {}
    tops = []
    for spec in sorted(catalog, key=lambda s: s.name):
        if spec.adapter_of in bases:
            adapters.setdefault(spec.adapter_of, []).append(spec)
        else:
            tops.append(spec)
    return [each for spec in tops for each in (spec, *adapters.get(spec.name, ()))]


def model_rows(view: FleetView) -> list[ModelRow]:
    """Join the catalog with the heartbeats and the queue: one row per model, in `listing_order`.

    Latency percentiles of a model held by several boxes are the worst box's (percentiles of
    different boxes cannot be merged from summaries); errors add each box's count to the
    model's dead letters. A model no live box holds or loads afresh, whose last load failed on a
    live box, is `failed`, with each such box's error in `load_failed_on`.
    """
    queue = view.queue
    backlog: dict[str, int] = {}
    for consumer in queue.consumers if queue else ():
        backlog[consumer.slug] = backlog.get(consumer.slug, 0) + consumer.pending
    dead: dict[str, int] = {}
    if queue and queue.dead_letters:
        for subject, count in queue.dead_letters.subjects.items():
            slug = subject.rsplit(".", 1)[-1]
            dead[slug] = dead.get(slug, 0) + count
    rows = []
    for spec in listing_order(view.catalog):
        if spec.adapter_of is None:
            holders = [(b, m) for b in view.boxes if b.usable for m in b.models if m.name == spec.name]
        else:  # an adapter lives inside its base model, on the boxes that loaded it there
            holders = [
                (b, m)
                for b in view.boxes
                if b.usable
                for m in b.models
                if m.name == spec.adapter_of and spec.name in m.adapters
            ]
        resident = [(b, m) for b, m in holders if m.state == "resident"]
        failed_on = {b.box: f.error for b in view.boxes if b.usable for f in b.load_failed if f.name == spec.name}
        # A box loading it again after its load failed there (a pinned model, every 30 s) is no news: still failed.
        loading = [b for b, m in holders if m.state == "loading" and b.box not in failed_on]
        state = "resident" if resident else "loading" if loading else "failed" if failed_on else "cold"
        measured = resident if spec.adapter_of is None else []  # an adapter's figures are its base's
        rows.append(
            ModelRow(
                name=spec.name,
                task=spec.task.value,
                runtime=spec.runtime.value,
                adapter_of=spec.adapter_of,
                pinned=spec.pinned,
                state=state,
                boxes=tuple(sorted(b.box for b, _ in resident)),
                nbytes=next((m.nbytes for _, m in measured if m.nbytes), None),
                backlog=backlog.get(spec.slug, 0),
                rps=round(sum((m.rps for _, m in measured), 0.0), 2),
                p50_ms=max((m.p50_ms for _, m in measured), default=0.0),
                p99_ms=max((m.p99_ms for _, m in measured), default=0.0),
                errors=sum(m.errors for _, m in measured) + dead.get(spec.slug, 0),
                load_failed_on=dict(sorted(failed_on.items())),
            )
        )
    return rows
