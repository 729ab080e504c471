"""One request's decoding in a generate runtime: what it asked for, the tokens it has made, and what each adds.

The one idea: a request decides alone when it ends. Each new token is appended, its text released
through the request's `TextStream`, and the request finishes on an end-of-sequence token, a stop
string or its `max_new` tokens; the `StepOutput` says which, with the usage on the last one. The
decode batch (`runtimes/generate.py`) only chooses the tokens and drops the requests that finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtimes.tasks.generate import SamplingParams, TextStream
from runtimes.tasks.penalties import Penalties


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True, frozen=True)
class StepOutput:
    """One new token of one request. `finish_reason` is "stop" (EOS or a stop string) or "length"."""

    request_id: str
    token_id: int
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None  # on the last output of a request only
    # This request alone failed (its prefill, or logits with nothing finite to choose from): dropped, owed an error.
    error: Exception | None = None


class NoFiniteLogits(RuntimeError):
    """The model's logits for a request were all nan or infinite: no token to choose, so that request fails (its
    batch decodes on). A made-up token answered it with garbage text and a 200."""

    def __init__(self, dtype: torch.dtype) -> None:
        computed_in = str(dtype).removeprefix("torch.")
        likely = (
            "a half-precision overflow, most likely; serve the model with dtype float32 or bfloat16"
            if dtype is torch.float16
            else "its weights may hold nan or infinite values; check the model's files"
        )
        super().__init__(
            f"the model produced no finite logits (every one nan or infinite, computed in {computed_in}): {likely}"
        )


@dataclass(slots=True)
class Decoding:
    request_id: str
    prompt: torch.Tensor
    params: SamplingParams
    adapter: str | None
    max_new: int
    stream: TextStream
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    penalties: Penalties | None = None  # kept across steps, for a request whose params reshape its logits

    def emit(self, token: int, eos: frozenset[int]) -> StepOutput:
        """Append the new token and say what text it adds (and whether it ends the request)."""
        self.generated.append(token)
        if self.penalties is not None:
            self.penalties.add(token)
        if token in eos:
            delta, _ = self.stream.finish()
            reason: str | None = "stop"
        else:
            delta, stopped = self.stream.push(token)
            reason = "stop" if stopped else None
            if reason is None and len(self.generated) >= self.max_new:
                # What was held back (a half-made character) may end in a stop string: then it stopped there.
                rest, stopped = self.stream.finish()
                delta += rest
                reason = "stop" if stopped else "length"
        usage = None
        if reason is not None:
            usage = Usage(prompt_tokens=int(self.prompt.numel()), completion_tokens=len(self.generated))
        return StepOutput(self.request_id, token, delta, reason is not None, reason, usage)
