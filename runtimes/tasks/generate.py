"""Text generation's per-token work: choosing the next token, and turning tokens into streamed text.

Two rules make streaming honest. Text is released only once it is stable: the newest tokens are
decoded together with a few before them (so a word-piece or a byte of a multi-byte character is not
shown half-made), and text ending in U+FFFD waits for the bytes that complete it. And text that
could still be the start of a stop string is held back until it is clear either way, so a client
never receives the first half of a stop sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtimes.tasks.penalties import Penalties

# Prompt tokens decoded in front of the first generated one, so its leading space survives.
_CONTEXT_TOKENS = 5


_HIGHEST = torch.finfo(torch.float32).max
_LOWEST = torch.finfo(torch.float32).min
_GREEDY_BELOW = 1e-5  # a temperature this small samples the argmax anyway; below float32's range it would be 0


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request decodes. `temperature == 0` (or under 1e-5) is greedy; `seed` makes sampling reproducible.

    The penalties and `logit_bias` change the logits before the choice, greedy or not (as in vLLM;
    `runtimes/tasks/penalties.py`):
    `repetition_penalty` (HF/CTRL style: a seen token's positive logit divided by it, a negative one
    multiplied) over the prompt and the completion, `presence_penalty` and `frequency_penalty` (OpenAI's:
    subtracted once, and per occurrence) over the completion. `top_k` (0: all) and `min_p` (0: none)
    narrow a draw, before `top_p`.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (every token) or more")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be more than 0")
        # Accept any sequence (a JSON list, say) but keep a hashable, immutable value.
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

    @property
    def reshapes(self) -> bool:
        """Whether the logits change before the choice (penalties, a bias)."""
        penalised = self.repetition_penalty != 1 or self.presence_penalty or self.frequency_penalty
        return bool(penalised or self.logit_bias)


Seen = Penalties | tuple[torch.Tensor, Sequence[int]]
"""What a row's penalties read: kept across steps (`Penalties`), or (prompt ids, completion so far) to count afresh."""


def choose_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen: Sequence[Seen | None] | None = None,
) -> list[int | None]:
    """The next token of each row of (rows, vocab) logits, read back from the device once per step.

    Greedy rows take the argmax together; a sampling row draws with its own generator, so a seeded
    request gets the same draws whatever else is in the batch. `seen`: what each row's penalties read,
    for the rows that ask for them. None for a row with no finite logit: the model gave it nothing to
    choose from, and its request alone is to fail.
    """
    # Judged on the model's own logits, before they are mapped: a row all nan or inf (a broken half-precision model)
    # answered token 0, or a uniform draw, as a 200 with garbage text.
    answerable = torch.isfinite(logits).any(dim=-1)
    # A model's inf or nan (a half-precision overflow) made one row's draw raise, and that fails the decode step of
    # every request in the batch (review h184): nan is never chosen, and infinities are the float32 extremes.
    logits.nan_to_num_(nan=_LOWEST, posinf=_HIGHEST, neginf=_LOWEST)
    for row, row_params in enumerate(params):
        if row_params.reshapes:
            logits[row] = _penalties(row_params, seen[row] if seen is not None else None).apply(logits[row])
    picks = torch.argmax(logits, dim=-1)
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.temperature > _GREEDY_BELOW:
            picks[row] = _draw(logits[row], row_params, generator)
    picks = torch.where(answerable, picks, -1)  # flagged on the device: still one read back a step
    return [pick if pick >= 0 else None for pick in picks.tolist()]


def _penalties(params: SamplingParams, seen: Seen | None) -> Penalties:
    if isinstance(seen, Penalties):
        return seen
    prompt, completion = seen if seen is not None else (torch.empty(0, dtype=torch.long), ())
    return Penalties.of(params, prompt, completion)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    # Shifted so the best is 0 first: a tiny temperature then drives the rest to -inf (an argmax), not to
    # inf - inf = nan, which failed the decode step of every request in the batch.
    scores = logits.float()
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax((scores - scores.max()) / params.temperature, dim=-1)
    if params.min_p > 0:  # tokens less likely than min_p times the most likely one are dropped
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Drop the tokens whose predecessors already cover top_p; the most likely one always stays.
        beyond = (sorted_probs.cumsum(dim=-1) - sorted_probs) > params.top_p
        sorted_probs = sorted_probs.masked_fill(beyond, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]


class TextStream:
    """One request's completion text, released delta by delta as tokens arrive."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int], stop: tuple[str, ...]) -> None:
        self._decode = decode
        self._ids = [int(i) for i in prompt[-_CONTEXT_TOKENS:]]
        self._prefix = 0  # ids[prefix:read] decode to text already counted
        self._read = len(self._ids)
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._text = ""  # the completion so far, released or not
        self._released = 0

    @property
    def text(self) -> str:
        """The completion released so far."""
        return self._text[: self._released]

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text it releases, whether a stop string ended the completion)."""
        self._ids.append(int(token_id))
        self._text += self._new_text(final=False)
        return self._release(final=False)

    def finish(self) -> tuple[str, bool]:
        """The completion ended for another reason: release what was held back."""
        self._text += self._new_text(final=True)
        return self._release(final=True)

    def _new_text(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, *, final: bool) -> tuple[str, bool]:
        start = self._released
        hits = [at for s in self._stop if (at := self._text.find(s, start)) >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self._released = len(self._text)
            return self._text[start:], True
        cut = len(self._text) if final else self._safe_end()
        self._released = cut
        return self._text[start:cut], False

    def _safe_end(self) -> int:
        """Where the text stops being certain: the first suffix that a stop string could still begin with."""
        text = self._text
        for at in range(max(self._released, len(text) - self._longest_stop + 1), len(text)):
            tail = text[at:]
            if any(s.startswith(tail) for s in self._stop):
                return at
        return len(text)
