"""Helpers shared by the generate and LoRA tests: driving a generate runtime, and the greedy reference."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from runtimes.generate import GenerateRuntime, StepOutput


def drive(runtime: GenerateRuntime, joins: dict[int, list[tuple]]) -> dict[str, list[StepOutput]]:
    """Step until every request is done; before step k, add each `(id, prompt, params[, adapter])` in `joins[k]`."""
    outputs: dict[str, list[StepOutput]] = defaultdict(list)
    step = 0
    while runtime.has_work or joins:
        for request_id, prompt, params, *adapter in joins.pop(step, []):
            runtime.add(request_id, prompt, params, adapter=adapter[0] if adapter else None)
        for out in runtime.step():
            outputs[out.request_id].append(out)
        step += 1
        assert step < 500, "generation did not finish"
    return outputs


def prompt_ids(runtime: GenerateRuntime, text: str) -> np.ndarray:
    return runtime.tokenize([text])[0].ids


def greedy_reference(model: torch.nn.Module, prompt: np.ndarray, max_new_tokens: int) -> list[int]:
    """What `model.generate` gives for this prompt alone, greedy: the tokens after the prompt."""
    ids = torch.as_tensor(prompt, device=model.device).unsqueeze(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()
