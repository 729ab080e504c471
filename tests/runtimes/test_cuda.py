"""The same runtimes on a CUDA device: skipped where there is none.

What can differ on a GPU is where tensors and generators live, so each test compares a CUDA runtime
with transformers/peft on the same device (or with the CPU runtime) on the tiny test models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtimes import ModelSource, Task, load_runtime
from runtimes.generate import SamplingParams

from .helpers import drive, greedy_reference, prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = ["The quick brown fox", "Paris is the capital of France, and Berlin is", "Alice"]


def test_batched_greedy_generation_on_cuda_matches_generate_alone(
    model_dirs: dict[Task, Path], adapter_dirs: dict[Task, Path]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = model_dirs[Task.GENERATE]
    runtime = load_runtime(ModelSource(folder, Task.GENERATE, device="cuda"))
    runtime.load_adapter("tuned", adapter_dirs[Task.GENERATE])
    prompts = [prompt_ids(runtime, text) for text in PROMPTS]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    joins = {0: [("r0", prompts[0], greedy), ("lora", prompts[0], greedy, "tuned")], 2: [("r1", prompts[1], greedy)]}
    joins[3] = [("r2", prompts[2], greedy)]
    outputs = drive(runtime, joins)

    base = AutoModelForCausalLM.from_pretrained(folder).to("cuda").eval()
    for i, prompt in enumerate(prompts):
        assert [o.token_id for o in outputs[f"r{i}"]] == greedy_reference(base, prompt, 10)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), adapter_dirs[Task.GENERATE])
    expected = greedy_reference(tuned.to("cuda").eval(), prompts[0], 10)
    assert [o.token_id for o in outputs["lora"]] == expected

    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first = drive(runtime, {0: [("s", prompts[1], seeded)]})["s"]
    again = drive(runtime, {0: [("x", prompts[0], greedy), ("s", prompts[1], seeded)]})["s"]
    assert [o.token_id for o in first] == [o.token_id for o in again]
    runtime.close()


@pytest.mark.parametrize("task", [Task.SCORE, Task.CLASSIFY, Task.EXTRACT], ids=str)
def test_encoder_tasks_with_an_adapter_on_cuda_match_the_cpu(
    task: Task, model_dirs: dict[Task, Path], adapter_dirs: dict[Task, Path]
) -> None:
    outputs = []
    for device in ("cpu", "cuda"):
        runtime = load_runtime(ModelSource(model_dirs[task], task, device=device))
        runtime.load_adapter("tuned", adapter_dirs[task])
        texts = ["Alice lives in Paris.", "A fine film."]
        batch = runtime.tokenize_pairs([("q", t) for t in texts]) if task is Task.SCORE else runtime.tokenize(texts)
        outputs.append((runtime.run(batch), runtime.run(batch, adapter="tuned")))
        runtime.close()
    (cpu_base, cpu_tuned), (gpu_base, gpu_tuned) = outputs
    np.testing.assert_allclose(gpu_base, cpu_base, atol=1e-3)
    np.testing.assert_allclose(gpu_tuned, cpu_tuned, atol=1e-3)
