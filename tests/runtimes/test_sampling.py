"""The sampler's logit shaping: penalties and bias change the choice, greedy or not; top_k and min_p narrow a draw."""

from __future__ import annotations

import torch

from runtimes.tasks.generate import SamplingParams, choose_tokens

NO_PROMPT = torch.empty(0, dtype=torch.long)


def greedy(logits: list[float], prompt=NO_PROMPT, completion=(), **params) -> int:
    row = torch.tensor([logits])
    return choose_tokens(row, [SamplingParams(temperature=0, **params)], [None], [(prompt, completion)])[0]


def test_logit_bias_moves_the_greedy_choice() -> None:
    assert greedy([2.0, 1.0, 0.0]) == 0
    assert greedy([2.0, 1.0, 0.0], logit_bias=((2, 5.0),)) == 2
    assert greedy([2.0, 1.0, 0.0], logit_bias=((0, -100.0),)) == 1


def test_repetition_penalty_counts_the_prompt_and_the_completion() -> None:
    assert greedy([2.0, 1.9], prompt=torch.tensor([0]), repetition_penalty=2.0) == 1
    assert greedy([2.0, 1.9], completion=[0], repetition_penalty=2.0) == 1
    assert greedy([-1.0, -1.5], completion=[0], repetition_penalty=2.0) == 1  # a negative logit is multiplied
    assert greedy([2.0, 1.9], prompt=torch.tensor([1]), repetition_penalty=2.0) == 0


def test_presence_and_frequency_penalties_count_the_completion_only() -> None:
    assert greedy([2.0, 1.5], completion=[0, 0], frequency_penalty=0.3) == 1  # 2 - 2 * 0.3 < 1.5
    assert greedy([2.0, 1.5], completion=[0, 0], frequency_penalty=0.2) == 0
    assert greedy([2.0, 1.5], completion=[0], presence_penalty=0.6) == 1
    assert greedy([2.0, 1.5], prompt=torch.tensor([0, 0]), presence_penalty=2.0, frequency_penalty=2.0) == 0


def test_top_k_and_min_p_keep_only_the_likeliest_tokens_in_a_draw() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7]])
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        assert choose_tokens(logits.clone(), [SamplingParams(top_k=1)], [generator])[0] == 0
        assert choose_tokens(logits.clone(), [SamplingParams(min_p=1.0)], [generator])[0] == 0
    drawn = {
        choose_tokens(logits.clone(), [SamplingParams(top_k=2)], [torch.Generator().manual_seed(s)])[0]
        for s in range(60)
    }
    assert drawn == {0, 1}
