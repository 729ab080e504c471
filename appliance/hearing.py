"""When each box's heartbeat record last reached this box (`Hearing`): how a worker knows a gateway is gone.

The one idea: judge by arrival, timed by this box's own monotonic clock, never by the `ts` a record carries, its
writer's wall clock: a gateway whose clock ran 5 s behind a worker's was taken for gone (review h195). A box is gone
once no record of it has arrived for twice the TTL, and only while this box's own view is sound: its watch has run
that long and its own record, written each beat, arrived within a TTL (not frozen itself, nor cut off from NATS).
"""

from __future__ import annotations

import time


class Hearing:
    def __init__(self, box_id: str, ttl_s: float) -> None:
        self._box_id = box_id
        self._ttl_s = ttl_s
        self._at: dict[str, float] = {}  # box -> monotonic arrival of its last record here
        self._since: float | None = None  # monotonic: since when the watch runs; None while it is (re)made
        self._pruned_at = time.monotonic()

    def watch_begins(self) -> None:
        """The watch is being made afresh (a start, a reconnect): nobody is known gone from it yet."""
        self._since = None

    def watching(self) -> None:
        """The watch runs (its replay read): absences count from now."""
        self._since = time.monotonic()

    def heard(self, box: str) -> None:
        """A record of `box` reached this box."""
        now = self._at[box] = time.monotonic()
        if now - self._pruned_at > 2 * self._ttl_s:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget boxes not heard for over twice the TTL: `gone` judges them the same from `_since` (the watch ran
        that long, or nobody is judged yet), and a fleet whose gateways restart under new ids kept one entry for each
        id ever seen (review h202)."""
        self._pruned_at = now
        judged_s = 2 * self._ttl_s
        for box in [box for box, at in self._at.items() if now - at > judged_s and box != self._box_id]:
            del self._at[box]

    def gone(self, box: str) -> bool:
        """Whether `box` is known gone: no record of it arrived for over twice the TTL, from a sound view."""
        if box == self._box_id or self._since is None:
            return False
        now, judged_s = time.monotonic(), 2 * self._ttl_s
        own = self._at.get(self._box_id)
        if now - self._since <= judged_s or own is None or now - own > self._ttl_s:
            return False
        return now - self._at.get(box, self._since) > judged_s
