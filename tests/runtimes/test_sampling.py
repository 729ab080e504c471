"""The sampler's logit shaping: penalties and bias change the choice, greedy or not; top_k and min_p narrow a draw."""

from __future__ import annotations

import torch

from runtimes.tasks.generate import SamplingParams, choose_tokens
from runtimes.tasks.penalties import Penalties

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


def test_a_penalty_that_overflows_the_logits_fails_no_row_of_its_batch() -> None:
    """Tester h181: a repetition_penalty of 1e-39 (the API takes (0, 10]) divided a seen token's positive logit past
    float32's range: inf, then inf - inf = nan in the draw, whose multinomial raised for the whole decode step, so
    every request decoding beside it was answered 500. The shaped logits stay finite: the limit of the penalty, a
    seen positive-logit token, is what it chooses."""
    logits = torch.tensor([[2.0, 1.9, -1.0], [2.0, 1.9, -1.0], [2.0, 1.9, -1.0]])
    seen = torch.tensor([1])
    params = [
        SamplingParams(temperature=0),  # greedy, another client's
        SamplingParams(temperature=1.0, seed=5, repetition_penalty=1e-39),
        SamplingParams(temperature=0, repetition_penalty=1e-39, logit_bias=((1, 100.0),)),
    ]
    generators = [None, torch.Generator().manual_seed(5), None]
    rows = [None, (seen, ()), (seen, ())]
    assert choose_tokens(logits, params, generators, rows) == [0, 1, 1]
    # Two seen tokens past float32's range keep their order (clamped, they tied: the lowest id won; review h184).
    for seed in range(4):
        row = torch.tensor([[1.0, 2.0, 0.0]])
        sampled = SamplingParams(temperature=1.0, repetition_penalty=1e-39)
        assert choose_tokens(row, [sampled], [torch.Generator().manual_seed(seed)], [(torch.tensor([0, 1]), ())]) == [1]
    assert greedy([1.0, 2.0, 0.0], prompt=torch.tensor([0, 1]), repetition_penalty=1e-39) == 1
    # Past float64's range too (review h186: 1e-308 made the nan again; 5e-324 is the least the API takes).
    for penalty in (1e-308, 5e-324):
        sampled = SamplingParams(temperature=1.0, repetition_penalty=penalty)
        row = torch.tensor([[1.0, 2.0, 0.0, 3.0]])
        generator = torch.Generator().manual_seed(0)
        assert choose_tokens(row, [sampled], [generator], [(torch.tensor([0, 1]), ())])[0] in (0, 1)


def test_a_models_inf_or_nan_logits_fail_no_row_of_its_batch() -> None:
    """Review h184: a sampling row without shaping drew from a model's inf (or nan) logits, inf - inf = nan, and the
    draw raised for the whole decode step. A nan is never chosen; an inf is the float32 extreme. A row with no finite
    logit at all is flagged (None), not answered."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, inf, 0.0], [nan, 1.0, 0.0], [-inf, -inf, -inf]])
    greedy_row = SamplingParams(temperature=0)
    params = [greedy_row, SamplingParams(seed=1), greedy_row, SamplingParams(seed=2)]
    generators = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    assert choose_tokens(logits, params, generators) == [1, 1, 1, None]


def test_a_row_with_no_finite_logit_is_flagged_and_the_other_rows_choose_as_before() -> None:
    """A broken half-precision model's row all nan (or all inf) was answered token 0 (greedy) or a uniform draw (a
    200 with garbage text): it is flagged, to fail its request alone. Every other row, greedy, seeded or shaped,
    chooses what it chooses in a batch without that row."""
    nan, inf = float("nan"), float("inf")
    vocab = 50
    good = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3
    good[3, 7] = inf  # only some non-finite: mapped and answered, as before
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=11, top_p=0.9),
        SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias=((3, 2.0),)),
        SamplingParams(temperature=1.0, seed=12),
    ]
    seen = [None, None, (torch.tensor([1, 2]), [5]), None]

    def generators() -> list[torch.Generator | None]:
        return [None, torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(12)]

    alone = choose_tokens(good.clone(), params, generators(), seen)
    assert None not in alone and alone[3] == 7
    for broken in (nan, inf, -inf):
        for bad_params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)):
            logits = torch.cat([good[:2], torch.full((1, vocab), broken), good[2:]])
            rows = [*params[:2], bad_params, *params[2:]]
            gens = generators()
            gens.insert(2, torch.Generator().manual_seed(3) if bad_params.seed is not None else None)
            chosen = choose_tokens(logits, rows, gens, [*seen[:2], None, *seen[2:]])
            assert chosen == [*alone[:2], None, *alone[2:]], (broken, bad_params)


def from_scratch(logits: torch.Tensor, params: SamplingParams, prompt: torch.Tensor, completion: list[int]):
    """The shaping computed from the whole prompt and completion (the sampler's own, before it kept counts), in
    float64 and shifted so the largest is 0, as the sampler's is."""
    scores = logits.to(torch.float64, copy=True)
    if params.logit_bias:
        scores[torch.tensor([t for t, _ in params.logit_bias])] += torch.tensor([b for _, b in params.logit_bias])
    done = torch.tensor(completion, dtype=torch.long)
    if params.repetition_penalty != 1:
        ids = torch.unique(torch.cat([prompt, done]))
        picked = scores[ids]
        scores[ids] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if done.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(done, minlength=scores.numel()).to(torch.float32)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    return (scores - scores.max()).float()


def test_penalties_kept_across_a_long_completion_equal_the_from_scratch_computation() -> None:
    """A request's penalties keep its token counts as it goes (one token a step); over 2,000 steps the shaped
    logits stay bit for bit those computed afresh from the whole prompt and completion, tokens repeating often."""
    generator = torch.Generator().manual_seed(0)
    vocab = 300
    params = SamplingParams(
        temperature=0,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.25,
        logit_bias=((7, 2.0), (9, -1.5)),
    )
    prompt = torch.randint(0, vocab, (40,), generator=generator)
    kept, completion = Penalties(params, prompt), []
    for _ in range(2000):
        logits = torch.randn(vocab, generator=generator) * 4
        assert torch.equal(kept.apply(logits), from_scratch(logits, params, prompt, completion))
        token = int(torch.randint(0, vocab, (), generator=generator))
        kept.add(token)
        completion.append(token)
    alone = (
        {"repetition_penalty": 0.8},
        {"presence_penalty": -0.5},
        {"frequency_penalty": 0.5},
        {"logit_bias": ((3, 1),)},
    )
    for shaping in alone:  # each alone, for a completion known whole
        params = SamplingParams(temperature=0, **shaping)
        shaped = Penalties.of(params, prompt, completion).apply(logits)
        assert torch.equal(shaped, from_scratch(logits, params, prompt, completion)), shaping


def test_no_finite_logits_advises_by_the_dtype_the_model_ran_in() -> None:
    """Review h193: a float32 model was told of a half-precision overflow and to serve in float32."""
    from runtimes.decoding import NoFiniteLogits

    assert "serve the model with dtype float32 or bfloat16" in str(NoFiniteLogits(torch.float16))
    assert "check the model's files" in str(NoFiniteLogits(torch.float32))
    assert "half-precision" not in str(NoFiniteLogits(torch.bfloat16))
