"""The KV cache of a decode batch whose rows join and leave at step boundaries.

The one idea: rows are left-padded, so every row's newest token sits in the last column and one
decode step appends one column for all rows. A row that joins brings its own prefilled cache; the
narrower of the two is padded on the left with zeros that the attention mask hides, and the rows
are stacked. A finished row is dropped by index, and columns that no remaining row uses any more
are cut from the left, so a long request that left does not keep the others' cache wide.

Each row's position ids count only its real tokens, which is what transformers' `generate` does
for a left-padded batch, so a row decodes the same tokens alone or in company.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache


@dataclass(slots=True)
class CacheBatch:
    cache: DynamicCache
    mask: torch.Tensor  # (rows, width) int64: 1 where the cache holds a real token of that row
    positions: torch.Tensor  # (rows,) int64: the position id of each row's next token

    @classmethod
    def prompts(cls, ids: list[torch.Tensor], pad_id: int, device: torch.device) -> tuple[CacheBatch, torch.Tensor]:
        """An empty cache for these prompts and their left-padded inputs: (batch, input_ids).

        The cache is filled by the prefill forward; `inputs` gives its mask and position ids.
        """
        width = max(int(row.shape[0]) for row in ids)
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(ids), width), dtype=torch.long, device=device)
        for i, row in enumerate(ids):
            input_ids[i, width - row.shape[0] :] = row
            mask[i, width - row.shape[0] :] = 1
        return cls(cache=DynamicCache(), mask=mask, positions=mask.sum(dim=1)), input_ids

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def prompt_position_ids(self) -> torch.Tensor:
        """(rows, width) position ids for a prefill: 0.. over real tokens, 0 on padding (as `generate`)."""
        return (self.mask.cumsum(dim=-1) - 1).masked_fill(self.mask == 0, 0)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask, position_ids) for one more token per row; call `advance` after the forward."""
        ones = torch.ones((self.rows, 1), dtype=self.mask.dtype, device=self.mask.device)
        return torch.cat([self.mask, ones], dim=1), self.positions.unsqueeze(1)

    def advance(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.positions = self.positions + 1

    def merge(self, other: CacheBatch) -> CacheBatch:
        """This batch's rows, then `other`'s, aligned on the right."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        layers = [
            tuple(
                torch.cat([_pad_left(a, width), _pad_left(b, width)], dim=0) for a, b in zip(mine, theirs, strict=True)
            )
            for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True)
        ]
        mask = torch.cat([_pad_left(self.mask, width, dim=1), _pad_left(other.mask, width, dim=1)], dim=0)
        return CacheBatch(
            cache=DynamicCache(ddp_cache_data=layers),
            mask=mask,
            positions=torch.cat([self.positions, other.positions]),
        )

    def keep(self, rows: list[int]) -> CacheBatch:
        """Only these rows, with the columns none of them uses cut from the left."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.sum(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        layers = [tuple(t.index_select(0, index)[:, :, start:] for t in kv) for kv in _layers(self.cache)]
        return CacheBatch(
            cache=DynamicCache(ddp_cache_data=layers),
            mask=mask[:, start:],
            positions=self.positions.index_select(0, index),
        )


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zeros on the left of `dim` up to `width`: keys and values are (rows, heads, tokens, head_dim)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return F.pad(t, pad)
