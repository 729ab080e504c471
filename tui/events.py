"""The fleet's recent history: events, and each model's throughput, from successive views.

Boxes publish state, not events; so an event is a difference between two successive views: a box
id that appears (joined) or whose status changes (draining, late, dead, left), a model that
appears on a box (loaded) or leaves it (evicted), a box's record newly saying a model's load failed
there and why (failed to load), a catalog entry added, removed, pinned or
unpinned, an error count that grows. Losing NATS and getting it back are events too (the views
then say `connected`). Operator actions and their failures are added directly.
The log keeps the newest `limit` events; nothing else writes to it. `Throughput` keeps the
last `samples` req/s readings of every model, one per view, for the sparkline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tui.format import age, count, human_bytes
from tui.model import BoxState, FleetView, model_rows

_STATUS_EVENTS = {
    "draining": ("drain", "{box} is draining: finishing its work, then exits"),
    "late": ("late", "{box} missed its heartbeats"),
    "dead": ("dead", "{box} stopped sending heartbeats (dead?)"),
    "left": ("leave", "{box} left the fleet"),
    "live": ("back", "{box} is sending heartbeats again"),
}


@dataclass(slots=True, frozen=True)
class Event:
    at: float
    kind: str  # attach join leave dead late back drain load loading evict register remove pin unpin error action
    # outage reconnect
    subject: str  # the box or model it concerns
    text: str


class EventLog:
    def __init__(self, limit: int = 500) -> None:
        self._events: deque[Event] = deque(maxlen=limit)
        self._last: FleetView | None = None
        self._connected_once = False
        self._down_since: float | None = None  # when NATS was lost, while it is
        self.version = 0  # grows with every event, so a screen re-renders only when it changed

    def add(self, event: Event) -> None:
        self._events.append(event)
        self.version += 1

    def newest_first(self) -> list[Event]:
        return list(reversed(self._events))

    def __len__(self) -> int:
        return len(self._events)

    def observe(self, view: FleetView) -> None:
        """Record what changed since the previous view."""
        before, self._last = self._last, view
        self._observe_connection(view)
        if not view.connected or view.waiting_for:
            return
        if before is None or not before.connected or before.waiting_for:
            self.add(
                Event(view.taken_at, "attach", view.address,
                      f"attached to {view.address}: {count(len(view.boxes), 'box')}, "
                      f"{count(len(view.catalog), 'model')}")
            )  # fmt: skip
            return
        for event in _differences(before, view):
            self.add(event)

    def _observe_connection(self, view: FleetView) -> None:
        if not view.connected:
            if self._connected_once and self._down_since is None:
                self._down_since = view.taken_at
                why = f" ({view.problem})" if view.problem else ""  # "no answer": a hung server keeps the connection
                self.add(Event(view.taken_at, "outage", view.address,
                               f"lost NATS at {view.address}{why}; retrying, and showing the fleet "
                               "as last seen meanwhile"))  # fmt: skip
            return
        self._connected_once = True
        if self._down_since is not None:
            down_for = age(view.taken_at - self._down_since)
            self._down_since = None
            self.add(Event(view.taken_at, "reconnect", view.address,
                           f"reconnected to NATS at {view.address} after {down_for}"))  # fmt: skip


def _differences(before: FleetView, after: FleetView) -> Iterator[Event]:
    at = after.taken_at
    old_boxes = {b.box: b for b in before.boxes}
    for box in after.boxes:
        old = old_boxes.get(box.box)
        if old is None:
            if box.usable:
                yield Event(at, "join", box.box, f"{box.box} joined ({box.role}, host {box.host or '?'})")
                yield from _new_failures(at, {}, box)  # a failure its first record holds is news too (review h219)
            continue
        if box.status != old.status and box.status in _STATUS_EVENTS:
            kind, text = _STATUS_EVENTS[box.status]
            yield Event(at, kind, box.box, text.format(box=box.box))
        if box.usable and old.usable:
            yield from _model_changes(at, old, box)
        elif box.usable:  # back from dead or late: what failed meanwhile
            yield from _new_failures(at, old.failed_loads, box)
    old_specs = {s.name: s for s in before.catalog}
    new_specs = {s.name: s for s in after.catalog}
    for name in sorted(new_specs.keys() - old_specs.keys()):
        spec = new_specs[name]
        what = f"adapter of {spec.adapter_of}" if spec.adapter_of else spec.task.value
        yield Event(at, "register", name, f"{name} registered ({what})")
    for name in sorted(old_specs.keys() - new_specs.keys()):
        yield Event(at, "remove", name, f"{name} removed from the catalog")
    for name in sorted(old_specs.keys() & new_specs.keys()):
        if old_specs[name].pinned != new_specs[name].pinned:
            kind = "pin" if new_specs[name].pinned else "unpin"
            yield Event(at, kind, name, f"{name} {kind}ned")
    old_errors = {row.name: row.errors for row in model_rows(before)}
    for row in model_rows(after):
        grown = row.errors - old_errors.get(row.name, row.errors)
        if grown > 0:
            yield Event(at, "error", row.name, f"{row.name}: {grown} more failed request(s), {row.errors} in all")
    old_redelivered = {c.name: c.redelivered for c in before.queue.consumers} if before.queue else {}
    for consumer in after.queue.consumers if after.queue else ():
        grown = consumer.redelivered - old_redelivered.get(consumer.name, consumer.redelivered)
        if grown > 0:
            yield Event(at, "error", consumer.name, f"{consumer.name}: {grown} request(s) redelivered")
    old_error = before.queue.error if before.queue else None
    new_error = after.queue.error if after.queue else None
    if new_error and new_error != old_error:
        yield Event(at, "error", "queue", f"queue info failed: {new_error}")


def _model_changes(at: float, old: BoxState, new: BoxState) -> Iterator[Event]:
    was = {m.name: m for m in old.models}
    now = {m.name: m for m in new.models}
    for name, model in sorted(now.items()):
        previous = was.get(name)
        if model.state == "loading" and previous is None:
            yield Event(at, "loading", name, f"{name} loading on {new.box}")
        elif model.state == "resident" and (previous is None or previous.state != "resident"):
            size = f" ({human_bytes(model.nbytes)})" if model.nbytes else ""
            yield Event(at, "load", name, f"{name} loaded on {new.box}{size}")
    for name in sorted(was.keys() - now.keys()):
        if was[name].state == "resident":
            yield Event(at, "evict", name, f"{name} evicted from {new.box}")
        elif not new.names_failures:  # a box of an older version: no why; a newer one names each failure below, so
            # a model gone from it while loading, not named, did not fail (deleted, or unloaded while starting)
            yield Event(at, "error", name, f"{name} failed to load on {new.box}")
    yield from _new_failures(at, old.failed_loads, new)


def _new_failures(at: float, failed_before: dict[str, str], box: BoxState) -> Iterator[Event]:
    """One event per failure that is new on the box, or whose reason changed: a pinned model's load tried again
    every 30 s that fails again for the same reason is the same failure (its record keeps it in between)."""
    for failure in sorted(box.load_failed, key=lambda f: f.name):
        if failed_before.get(failure.name) != failure.error:
            yield Event(at, "error", failure.name, f"{failure.name} failed to load on {box.box}: {failure.error}")


class Throughput:
    def __init__(self, samples: int = 60) -> None:
        self._samples = samples
        self._history: dict[str, deque[float]] = {}

    def record(self, view: FleetView) -> None:
        if not view.connected or view.waiting_for:
            return
        for row in model_rows(view):
            self._history.setdefault(row.name, deque(maxlen=self._samples)).append(row.rps)

    def of(self, model: str) -> list[float]:
        return list(self._history.get(model, ()))
