"""The runtime options a model may carry (`options`), and what each must be.

A model's `options` are read by the runtime that loads it, long after the model was registered: a value the
runtime cannot use ("lots" for a decode batch, or 0) was a 500 on every request, or a decode batch of no rows
that left every request waiting out its deadline (black-box finding). So each option is judged when a model is
registered or configured, by the kind of model that will read it: a wrong type, a value out of bounds or a name
no runtime of its kind reads (a misspelling, say) is refused there, named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtimes.base import RuntimeKind, Task

ONNX_OPT_LEVELS = ("disabled", "basic", "extended", "all")


@dataclass(frozen=True, slots=True)
class Option:
    """One option: an integer (`whole`), a number, or a string (one of `choices`, if given)."""

    kind: type
    meaning: str
    minimum: float | None = None
    above: float | None = None  # strictly more than this
    choices: tuple[str, ...] = ()

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` for this option, or None."""
        if self.kind is str:
            if not isinstance(value, str):
                return f"must be a string ({self.meaning})"
            if self.choices and value not in self.choices:
                return f"must be one of {', '.join(self.choices)}, not {value!r}"
            return None
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or (self.kind is int and not isinstance(number, int)) or not math.isfinite(number):
            kind = "a whole number" if self.kind is int else "a number"
            return f"must be {kind} ({self.meaning}), not {value!r}"
        if self.minimum is not None and number < self.minimum:
            return f"must be at least {self.minimum:g} ({self.meaning}), not {value!r}"
        if self.above is not None and number <= self.above:
            return f"must be more than {self.above:g} ({self.meaning}), not {value!r}"
        return None


# An encoder's profile may run it on ONNX Runtime whatever runtime it was registered with, so its ONNX options are
# an encoder's on either runtime.
_ENCODER = {
    "onnx_file": Option(str, "an .onnx file to run as it is"),
    "onnx_opt_level": Option(str, "ONNX Runtime's graph optimisation", choices=ONNX_OPT_LEVELS),
    "cache_dir": Option(str, "where ONNX exports are cached"),
}
_GENERATOR = {
    "max_batch_size": Option(int, "requests decoded together", minimum=1),
    "max_prefill_tokens": Option(int, "prompt tokens admitted in one step", minimum=1),
}
_NOOP = {
    "cost_ms": Option(float, "a batch's fixed cost", minimum=0),
    "cost_per_token_us": Option(float, "the cost of a padded token", minimum=0),
    "speed": Option(float, "the speed the cost is divided by", above=0),
    "stall_every": Option(float, "mean batches between stalls", minimum=0),
    "stall_ms": Option(float, "a stall's length", minimum=0),
    "cold_every": Option(float, "mean batches between long stalls", minimum=0),
    "cold_ms": Option(float, "a long stall's length", minimum=0),
    "seed": Option(int, "the stalls' random seed"),
    "max_length": Option(int, "the longest input, in tokens", minimum=1),
    "bytes": Option(int, "its size for the memory budget", minimum=0),
    "fail_on": Option(str, "an input that makes it fail"),
}


def known_options(task: Task, runtime: RuntimeKind) -> Mapping[str, Option]:
    """The options a model of `task` run by `runtime` is read with."""
    if runtime is RuntimeKind.NOOP:  # a generator's decode batch is read by the gateway whatever runs it
        return {**_NOOP, **_GENERATOR} if task is Task.GENERATE else _NOOP
    return _GENERATOR if task is Task.GENERATE else _ENCODER


def option_problems(
    task: Task, runtime: RuntimeKind, options: Mapping[str, Any], *, not_here: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Each option of `options` that a model of `task` on `runtime` cannot be run with, and why; `not_here` are
    options the caller refuses on its own (the API's `cache_dir`), left out of the options a refusal lists."""
    known = {name: option for name, option in known_options(task, runtime).items() if name not in not_here}
    problems = {}
    for name, value in options.items():
        option = known.get(name)
        if option is None:
            kind = "a no-op model" if runtime is RuntimeKind.NOOP else f"a model for {task}"
            problems[name] = f"is not an option of {kind}; its options are {', '.join(sorted(known))}"
        elif (problem := option.problem(value)) is not None:
            problems[name] = problem
    return problems
