"""Which waiting rows form the next batch: the batching rule, as a function of the rows and the cost fit.

The rule: the batch is anchored on the oldest waiting row (the oldest interactive one when there is
one, so no row starves and batch work waits behind interactive work) and holds only rows for the
anchor's adapter. It grows one row at a time toward whichever neighbour in length adds the least
padding, while `rows × longest row` stays within `max_batch_tokens` and the row count within
`max_batch_size`. Given a trusted cost fit (fixed seconds a batch, seconds a padded token), it is
cut where rows per second peak along that growth. Nothing here keeps state: the batcher owns the
waiting rows and takes out of them what this picks.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.catalog import Batching
from appliance.envelope import BATCH
from appliance.work import WorkItem


def next_batch(pending: Sequence[WorkItem], batching: Batching, fit: tuple[float, float] | None) -> list[WorkItem]:
    """The rows of the next batch, out of `pending` (in arrival order), sorted by length; [] when none wait.

    `fit` is the cost model's (fixed seconds, seconds a padded token), or None while it is not trusted:
    then the batch grows as far as the budget lets it.
    """
    if not pending:
        return []
    # Interactive work first: the oldest interactive row anchors the batch when there is one.
    anchor = next((item for item in pending if item.job.meta.priority != BATCH), pending[0])
    # One adapter per batch: the anchor's (None is the base model).
    same_adapter = [item for item in pending if item.job.meta.adapter == anchor.job.meta.adapter]
    by_length = sorted(same_adapter, key=lambda item: item.length)
    at = next(i for i, item in enumerate(by_length) if item is anchor)
    lo, hi = at, at + 1  # the batch is by_length[lo:hi]
    longest = anchor.length
    budget, max_rows = batching.max_batch_tokens, batching.max_batch_size
    best, best_rate = (lo, hi), (1 / (fit[0] + fit[1] * longest) if fit is not None else 0.0)
    while hi - lo < max_rows:
        rows = hi - lo + 1
        # Grow toward the neighbour that adds the least padding: a shorter row is padded up to the
        # longest; a longer row pads every row already in. Either must keep the batch in budget.
        shorter = longest - by_length[lo - 1].length if lo > 0 and rows * longest <= budget else None
        longer = None
        if hi < len(by_length) and rows * by_length[hi].length <= budget:
            longer = (by_length[hi].length - longest) * (hi - lo)
        if shorter is None and longer is None:
            break
        if longer is None or (shorter is not None and shorter <= longer):
            lo -= 1
        else:
            longest = by_length[hi].length
            hi += 1
        if fit is not None:
            # Rows a second if the batch stopped here: past some size, the padding a longer row
            # brings to every row costs more than one batch's fixed cost saves.
            rate = (hi - lo) / (fit[0] + fit[1] * (hi - lo) * longest)
            if rate >= best_rate:
                best, best_rate = (lo, hi), rate
    if fit is not None:
        lo, hi = best
    return by_length[lo:hi]
