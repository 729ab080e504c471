"""The room a batcher has in time: how many more rows it could take now and still answer them within a bound.

The one idea: a row taken now waits for the batches on the device (each until its predicted end), then for the
batches of the rows already waiting, then runs in its own; every batch ahead is counted full, at the cost `BatchCost`
measured here, and each of the `concurrent_batches` slots runs its batches one after another. So `BatchRoom` keeps
the batches handed to the device threads, when each started and how long it should take: a batch far past its
predicted end is stalled, and leaves no room until it ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from appliance.batch_cost import BatchCost, PaceLine
from appliance.catalog import Batching

_NEARLY_FREE = 0.1  # of the time budget: a device with this little left of its batch takes the next one
_LATE_S = 0.005  # a batch this far past its predicted end (or a quarter of it) is stalled, not just late


class BatchRoom:
    """One batcher's batches on its device threads, and the room they leave. `batching()` reads the batcher's knobs
    as retuned; `pending(for_bulk)` counts its rows not yet in a batch (batch-priority ones only `for_bulk`)."""

    def __init__(
        self, slots: int, cost: BatchCost, batching: Callable[[], Batching], pending: Callable[[bool], int]
    ) -> None:
        self._slots_total = slots
        self._cost = cost
        self._batching = batching
        self._pending = pending
        # Batches handed to the device threads: rows and predicted seconds (kept by the event loop);
        # and when each started (written by its device thread as it starts: a formed batch may wait).
        self._formed: dict[int, tuple[int, float | None]] = {}
        self._started: dict[int, float] = {}

    def formed(self, key: int, rows: int, tokens: int) -> None:
        """Batch `key`, of `rows` rows and `tokens` padded tokens, was handed to the device threads."""
        self._formed[key] = (rows, self._cost.seconds(tokens))

    def start(self, key: int) -> None:
        """On the device thread: batch `key` starts now."""
        self._started[key] = time.monotonic()

    def ended(self, key: int) -> None:
        self._started.pop(key, None)
        del self._formed[key]

    def threads_busy(self) -> bool:
        return len(self._formed) >= self._slots_total

    def room(self, within_s: float, *, for_bulk: bool = False) -> int:
        """Rows this batcher could take now and still answer within `within_s`, at the measured cost.

        A row taken now waits for the batches on the device and the batches of rows already waiting,
        then runs in its own; every batch ahead is counted full, and each of the `concurrent_batches`
        slots runs its batches one after another. A batch is let in once a slot is nearly free however
        slow a batch is, so a box never starves itself. Before any batch is timed: one batch per slot.
        An interactive row overtakes the batch-priority rows waiting (`next_batch`), so only `for_bulk`
        counts them: counted for interactive work too, a bulk row pulled ahead left interactive requests
        in the queue, and it ran before them.
        """
        full = self._full_batch()
        pending = self._waiting_rows(for_bulk=for_bulk)
        if full is None:
            return max(0, self._slots_total * self._batching().max_batch_size - pending)
        rows, batch_s = full
        busy = self._busy_left_s()
        if busy is None:
            return 0  # a batch on the device is overdue (stalled): rows taken now would wait it out
        lefts = [0.0] * (self._slots_total - len(busy)) + busy  # soonest free first
        batches = sum(max(0, math.floor((within_s - left) / batch_s)) for left in lefts)
        if batches < 1 and lefts[0] <= _NEARLY_FREE * within_s:
            batches = 1
        return max(0, batches * rows - pending)

    def opens_in(self, within_s: float) -> float | None:
        """Seconds until `room(within_s)` may turn positive as batches on the device run; None: only an event can."""
        full = self._full_batch()
        if full is None:
            return None
        rows, batch_s = full
        busy = self._busy_left_s()
        if not busy:  # stalled (None): look again soon; idle: only rows arriving or leaving change the room
            return 0.25 * batch_s
        # Room for one more row needs the batches of the rows waiting plus one to fit in `within_s`
        # (reckoned for the slot that frees first).
        waiting = self._waiting_rows()
        threshold = within_s - (waiting // rows + 1) * batch_s
        if waiting < rows:
            threshold = max(threshold, _NEARLY_FREE * within_s)
        if threshold > 0:
            return max(0.001, busy[0] - threshold)
        return busy[0] + 0.25 * batch_s  # only batches ending make room: look again after the next one

    def lasts_s(self, within_s: float) -> float | None:
        """How long rows pulled now for the next batch still make it: until that batch starts. None: no sooner limit.

        Only a busy device with room for just its next batch has one; a row that arrived later would
        wait out a whole batch more than `room` counted, where another box may be free.
        """
        full = self._full_batch()
        if full is None or len(self._started) < self._slots_total:
            return None  # a slot is free: the next batch starts as soon as rows arrive
        rows, batch_s = full
        busy = self._busy_left_s()
        if busy is None or busy[0] + batch_s <= within_s - batch_s or self._waiting_rows() >= rows:
            return None
        return busy[0] + _NEARLY_FREE * within_s

    def _full_batch(self) -> tuple[int, float] | None:
        """(rows, predicted seconds) of a full batch of rows like recent ones; None before a batch of requests ran."""
        per_row = self._cost.tokens_per_row
        if per_row is None or not self._cost.batches:  # the warm-up's alone: room as an untimed box's
            return None
        rows = self.full_rows(per_row)
        seconds = self._cost.seconds(rows * per_row) or 0.0
        return rows, max(seconds, 1e-4)

    def full_rows(self, per_row: float) -> int:
        """The rows of a full batch of rows `per_row` padded tokens long: as many as the token budget holds, within
        the row cap."""
        batching = self._batching()
        return max(1, min(batching.max_batch_size, int(batching.max_batch_tokens // max(1.0, per_row))))

    def pace_line(self) -> PaceLine | None:
        """The measured cost as a box's heartbeat tells gateways (`PaceLine`), None until it is trusted: a full batch
        no larger than the largest timed (the warm-up's are 16 rows: read at 256, a GPU's near-flat cost of small
        batches made a pace far too high)."""
        per_row = self._cost.tokens_per_row
        if self._cost.samples < BatchCost.TRUST_AFTER or not per_row:  # the warm-up's batches count here
            return None
        batching = self._batching()
        rows = min(batching.max_batch_size, max(1, self._cost.most_rows))
        fit = self._cost.line()
        if fit is None:  # no batches ever told fixed cost from tokens: a shorter row is reckoned no cheaper
            full_rows = min(rows, self.full_rows(per_row))
            fit = (self._cost.seconds(full_rows * per_row) or 0.0, 0.0)
        return PaceLine(*fit, rows, batching.max_batch_tokens, batching.concurrent_batches, per_row)

    def _waiting_rows(self, *, for_bulk: bool = False) -> int:
        """Rows not yet on the device that a new row waits behind: in batches formed ahead that have not started,
        and pending, batch-priority ones only `for_bulk` (an interactive row overtakes them)."""
        ahead = sum(rows for key, (rows, _) in list(self._formed.items()) if key not in self._started)
        return self._pending(for_bulk) + ahead

    def _busy_left_s(self) -> list[float] | None:
        """Predicted seconds each batch on the device still needs, soonest first; None when one is overdue."""
        now = time.monotonic()
        lefts: list[float] = []
        for key, sent in list(self._started.items()):  # one C call: safe while a device thread adds one
            formed = self._formed.get(key)
            predicted = formed[1] if formed is not None else None
            if predicted is None:
                lefts.append(0.0)
                continue
            left = sent + predicted - now
            if left < -max(_LATE_S, 0.25 * predicted):
                return None
            lefts.append(max(0.0, left))
        return sorted(lefts)
