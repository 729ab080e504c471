"""What a batch costs on this device: a fixed cost per batch plus a cost per padded token, fitted as batches run.

The one idea: fit both parts, not a single rate. A rate read off small batches (mostly fixed cost)
undercounts what a full batch does; the two-part fit lets the batcher cut a batch where rows per
second peak and lets the box reckon the room it has in time (see `batcher.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


class BatchCost:
    """Seconds a batch takes on this device: a fixed cost plus a cost per padded token, fitted to the batches run.

    Why a fit and not rows per second: much of a small batch's time is the fixed part (a launch, a
    sync, the Python around the call), so a rate read off small batches undercounts what a full
    batch does, and a box sized by it asks for little, runs small batches and reads a low rate
    again. The fit is least squares with older batches weighing less (`_DECAY` per batch); a batch
    far slower than predicted (a GC pause, a cold cache) counts as at most twice the prediction, so
    one pause does not reshape the model, while a device that really slows down still shows within
    a few batches.
    """

    _DECAY = 0.95
    TRUST_AFTER = 5  # batches before outliers are clipped and the fit shapes batches

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums: weight, tokens, seconds, ...
        self.batches = 0  # of requests: what the batcher trusts the fit on to shape batches and its room
        self.samples = 0  # and the warm-up's made-up ones: what the pace a box reports is read from
        self.most_rows = 0  # the most rows of a batch seen: the pace is read at no larger a batch (not extrapolated)
        self.tokens_per_row: float | None = None  # padded tokens per row of recent batches (EWMA)
        self._shape: tuple[float, float] | None = None  # the last fit the batches told apart (`line`)

    def observe(self, tokens: int, rows: int, seconds: float, *, made_up: bool = False) -> None:
        """One batch's cost; `made_up`: a warm-up batch, not one of requests (see `samples`)."""
        predicted = self.seconds(tokens)
        if predicted is not None and self.batches >= self.TRUST_AFTER:
            seconds = min(seconds, 2 * predicted)
        d = self._DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds
        self.batches += 0 if made_up else 1
        self.samples += 1
        self.most_rows = max(self.most_rows, rows)
        per_row = tokens / rows
        self.tokens_per_row = per_row if self.tokens_per_row is None else 0.9 * self.tokens_per_row + 0.1 * per_row
        self._shape = self.fit() or self._shape

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds a batch, seconds a padded token): the fit, or where the batches of late are all of one size
        (a flood of like inputs, full batches) the last fit that told the two apart, scaled to what these batches
        take; None where none ever did. Without it, a pace reckoned after such a flood took every batch as fixed
        cost, and short requests sent next were refused (tester h92, 1 run of 5)."""
        fit = self.fit()
        if fit is not None or self._shape is None or self._w == 0:
            return fit
        fixed, slope = self._shape
        predicted = fixed + slope * self._x / self._w
        if predicted <= 0:
            return None
        scale = self._y / self._w / predicted  # what these batches take over what the last fit said they would
        return fixed * scale, slope * scale

    def seconds(self, tokens: float) -> float | None:
        """Predicted seconds for a batch of `tokens` padded tokens; None before any batch ran."""
        if self._w == 0:
            return None
        fit = self.fit()
        if fit is None:  # one batch size seen (or noise): cost in proportion to tokens
            mean_x, mean_y = self._x / self._w, self._y / self._w
            return mean_y / mean_x * tokens if mean_x > 0 else mean_y
        fixed, slope = fit
        return fixed + slope * tokens

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds a batch, seconds a padded token); None while the batches seen cannot tell them apart."""
        if self._w == 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread <= (0.05 * mean_x) ** 2:
            return None
        slope = (self._xy / self._w - mean_x * mean_y) / spread
        fixed = mean_y - slope * mean_x
        return None if slope < 0 or fixed < 0 else (fixed, slope)


@dataclass(frozen=True, slots=True)
class PaceLine:
    """A box's batch cost as its heartbeat tells gateways, so each can reckon the box's pace at the row length of
    the work it awaits: a pace read at the rows the box last ran (256 tokens long after a flood of long inputs) held
    a short request, sent while 100 medium inputs were awaited on an idle fleet, to 12 rows a second where the box
    goes 50, a 429 for half a minute (tester h86). Never reckoned at rows longer than the box ran lately
    (`row_tokens`): the line is fitted on them, and attention costs more than linearly past them."""

    fixed_s: float  # a batch's fixed cost
    token_s: float  # and its cost a padded token (0 where the batches seen cannot tell the two apart)
    rows: int  # the most rows a batch holds: the row cap, and no more than the largest batch timed
    tokens: int  # the padded tokens a batch holds
    slots: int  # batches the box runs at once
    row_tokens: float  # padded tokens a row of recent batches

    def at(self, per_row: float) -> tuple[float, float] | None:
        """(padded tokens, rows) a second in full batches of rows `per_row` tokens long (no longer than
        `row_tokens`), every slot busy; None for a line that says nothing."""
        per_row = max(1.0, min(per_row, self.row_tokens))
        rows = max(1, min(self.rows, int(self.tokens // per_row)))
        seconds = self.fixed_s + self.token_s * rows * per_row
        if not seconds > 0:
            return None
        return rows * per_row / seconds * self.slots, rows / seconds * self.slots

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: object) -> PaceLine | None:
        """The line a heartbeat says, or None where it says none (an older box) or something unusable."""
        if not isinstance(record, dict):
            return None
        try:
            line = cls(
                fixed_s=float(record["fixed_s"]),
                token_s=float(record["token_s"]),
                rows=int(record["rows"]),
                tokens=int(record["tokens"]),
                slots=int(record["slots"]),
                row_tokens=float(record["row_tokens"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return None
        usable = min(line.fixed_s, line.token_s) >= 0 and min(line.rows, line.tokens, line.slots) >= 1
        return line if usable and line.row_tokens >= 1 and math.isfinite(line.fixed_s + line.token_s) else None
