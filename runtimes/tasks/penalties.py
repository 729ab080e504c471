"""One request's logit shaping before the choice: `logit_bias`, then the repetition, presence and frequency penalties.

The one idea: what the penalties read is kept, not rebuilt. A request keeps, on the logits' device, the
ids it has seen (prompt and completion, for the repetition penalty) and the ids its completion holds
with their counts (for presence and frequency), each id once; a token it makes adds its id or one to
its count. A step then touches only those ids, with no pass over the completion (rebuilding them from
it cost its length, a sort and a host-to-device copy at every step) and none over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtimes.tasks.generate import SamplingParams

_HIGHEST = torch.finfo(torch.float64).max
_LOWEST = torch.finfo(torch.float64).min


class Penalties:
    """The shaping of one request's logits, one (vocab,) row a step; the tokens it makes told with `add`."""

    def __init__(self, params: SamplingParams, prompt: torch.Tensor) -> None:
        self._params = params
        self._repeats = params.repetition_penalty != 1
        self._counts_made = bool(params.presence_penalty or params.frequency_penalty)
        # Host side, so that a token is placed without asking the device: every id seen, and each
        # completion id's place in `_made_ids`; then what the device has not been told yet.
        self._seen: set[int] = set(prompt.tolist()) if self._repeats else set()
        self._place: dict[int, int] = {}
        self._untold_seen: list[int] = list(self._seen)
        self._untold_made: list[int] = []  # completion ids new since the last step
        self._untold_counts: list[int] = []  # places of the tokens made since the last step
        self._device: torch.device | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._seen_ids = self._made_ids = self._made_counts = torch.empty(0)

    @classmethod
    def of(cls, params: SamplingParams, prompt: torch.Tensor, completion: Sequence[int]) -> Penalties:
        """Penalties for a completion known whole (computed afresh, not kept across steps)."""
        penalties = cls(params, prompt)
        for token in completion:
            penalties.add(token)
        return penalties

    def add(self, token: int) -> None:
        """A token the request made."""
        if self._repeats and token not in self._seen:
            self._seen.add(token)
            self._untold_seen.append(token)
        if self._counts_made:
            if token not in self._place:
                self._place[token] = len(self._place)
                self._untold_made.append(token)
            self._untold_counts.append(self._place[token])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """One row's (vocab,) logits with the bias and penalties applied, as a new float32 tensor, shifted so the
        largest is 0 (which changes neither a greedy choice nor a draw of these float64 scores).

        Shaped in float64, held within its range, then shifted: a tiny repetition_penalty (the API takes (0, 10])
        divides a logit past float32's range, where inf - inf = nan in the draw failed the decode step of every
        request in the batch (tester h181); clamped to float32's, tokens past it tied (review h184), and past
        float64's (1e-308) the nan came back (review h186). Whatever falls below float32's range after the shift is
        -inf: never chosen."""
        scores = logits.to(torch.float64, copy=True)
        self._tell(scores.device)
        params = self._params
        if self._bias is not None:
            ids, values = self._bias
            scores[ids] += values
        if self._seen_ids.numel():
            picked = scores[self._seen_ids]
            penalty = params.repetition_penalty
            scores[self._seen_ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
        if self._made_ids.numel():
            scores[self._made_ids] -= params.frequency_penalty * self._made_counts + params.presence_penalty
        scores.nan_to_num_(nan=_LOWEST, posinf=_HIGHEST, neginf=_LOWEST)
        return scores.sub_(scores.max()).float()

    def _tell(self, device: torch.device) -> None:
        """Bring the device's ids and counts up to the tokens made (each tensor replaced whole, or not at all)."""
        if self._device is None:
            empty = torch.empty(0, dtype=torch.long, device=device)
            self._seen_ids, self._made_ids = empty, empty
            self._made_counts = torch.empty(0, dtype=torch.float32, device=device)
            if self._params.logit_bias:
                ids = torch.tensor([t for t, _ in self._params.logit_bias], device=device)
                self._bias = ids, torch.tensor([b for _, b in self._params.logit_bias], device=device)
            self._device = device
        if self._untold_seen:
            told = torch.tensor(self._untold_seen, dtype=torch.long, device=device)
            self._seen_ids = torch.cat([self._seen_ids, told])
            self._untold_seen.clear()
        if self._untold_counts:
            made = torch.tensor(self._untold_made, dtype=torch.long, device=device)
            counts = torch.cat([self._made_counts, torch.zeros(made.numel(), dtype=torch.float32, device=device)])
            places = torch.tensor(self._untold_counts, dtype=torch.long, device=device)
            counts.index_add_(0, places, torch.ones(places.numel(), dtype=torch.float32, device=device))
            self._made_ids, self._made_counts = torch.cat([self._made_ids, made]), counts
            self._untold_made.clear()
            self._untold_counts.clear()
