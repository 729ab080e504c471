"""When each box's heartbeat record last reached this box (`Hearing`): how a worker knows a gateway is gone.

The one idea: judge by arrival, timed by this box's own monotonic clock, never by the `ts` a record carries, its
writer's wall clock: a gateway whose clock ran 5 s behind a worker's was taken for gone (review h195). A box is gone
once no record of it has arrived for twice the TTL, and only while this box's own view is sound: its watch has run
that long and its own record, written each beat, arrived within a TTL (not frozen itself, nor cut off from NATS).

A box restarted under its id is heard again at once, yet its last run's requests have nobody awaiting them: each
record names its run (a token a box draws at start), and a run is over once a record of another run of its box
arrives (`ended`). Arrival order again, not clocks: a run not heard yet (a request that came before its box's first
record) is never taken for over.
"""

from __future__ import annotations

import time

RUN_MEMORY_S = 900.0  # how long a box's runs are remembered by default: beyond a request's life (`run_memory_s`)


class Hearing:
    def __init__(self, box_id: str, ttl_s: float, run_memory_s: float = RUN_MEMORY_S) -> None:
        self._box_id = box_id
        self._ttl_s = ttl_s
        self._run_memory_s = run_memory_s  # as long as a request of an ended run may still be queued or held
        self._at: dict[str, float] = {}  # box -> monotonic arrival of its last record here
        self._since: float | None = None  # monotonic: since when the watch runs; None while it is (re)made
        self._pruned_at = time.monotonic()
        self._runs: dict[str, tuple[str, float]] = {}  # box -> (run of its last record heard, monotonic when)
        self._ended: dict[tuple[str, str], float] = {}  # (box, run) -> monotonic: when another run's record came

    def watch_begins(self) -> None:
        """The watch is being made afresh (a start, a reconnect): nobody is known gone from it yet."""
        self._since = None

    def watching(self) -> None:
        """The watch runs (its replay read): absences count from now."""
        self._since = time.monotonic()

    def heard(self, box: str, run: str = "") -> None:
        """A record of `box` reached this box, of its run `run` ("" from a box that names none)."""
        now = self._at[box] = time.monotonic()
        if run:
            last = self._runs.get(box)
            if last is not None and last[0] != run:
                self._ended[(box, last[0])] = now
            self._ended.pop((box, run), None)  # beats again: two boxes under one id (a start refuses the second)
            self._runs[box] = (run, now)
        if now - self._pruned_at > 2 * self._ttl_s:
            self._prune(now)

    def heard_within(self, box: str) -> bool:
        """Whether a record of `box` reached this box within the TTL."""
        at = self._at.get(box)
        return at is not None and time.monotonic() - at <= self._ttl_s

    def ended(self, box: str, run: str) -> bool:
        """Whether `box`'s run `run` is over: a record of another run of `box` arrived after one of `run`."""
        return (box, run) in self._ended

    def _prune(self, now: float) -> None:
        """Forget boxes not heard for over twice the TTL: `gone` judges them the same from `_since` (the watch ran
        that long, or nobody is judged yet), and a fleet whose gateways restart under new ids kept one entry for each
        id ever seen (review h202)."""
        self._pruned_at = now
        judged_s = 2 * self._ttl_s
        for box in [box for box, at in self._at.items() if now - at > judged_s and box != self._box_id]:
            del self._at[box]
        for box in [box for box, (_, at) in self._runs.items() if now - at > self._run_memory_s]:
            del self._runs[box]
        for key in [key for key, at in self._ended.items() if now - at > self._run_memory_s]:
            del self._ended[key]

    def gone(self, box: str) -> bool:
        """Whether `box` is known gone: no record of it arrived for over twice the TTL, from a sound view."""
        if box == self._box_id or self._since is None:
            return False
        now, judged_s = time.monotonic(), 2 * self._ttl_s
        own = self._at.get(self._box_id)
        if now - self._since <= judged_s or own is None or now - own > self._ttl_s:
            return False
        return now - self._at.get(box, self._since) > judged_s
