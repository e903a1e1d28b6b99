"""Sampler: exact candidate sets on hand-made logits, reproducible seeds, penalties, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.errors import SamplingError
from pdserve.engine.sampler import Sampler, apply_penalties, candidate_mask
from pdserve.engine.sampling_params import SampleOutput, SamplingParams


def _logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]  # sorted: 1 (.4), 3 (.3), 4 (.15), 2 (.1), 0 (.05)


def kept(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask).flatten().tolist())


@pytest.mark.parametrize(
    "k,expected", [(1, {1}), (2, {1, 3}), (3, {1, 3, 4}), (0, {0, 1, 2, 3, 4}), (-1, {0, 1, 2, 3, 4})]
)
def test_top_k(k, expected):
    assert kept(candidate_mask(_logits_for(PROBS), k, 1.0, 0.0)) == expected


@pytest.mark.parametrize(
    "p,expected", [(0.4, {1}), (0.41, {1, 3}), (0.7, {1, 3}), (0.71, {1, 3, 4}), (0.96, {0, 1, 2, 3, 4})]
)
def test_top_p(p, expected):
    assert kept(candidate_mask(_logits_for(PROBS), 0, p, 0.0)) == expected


@pytest.mark.parametrize("m,expected", [(0.25, {1, 3, 4, 2}), (0.3, {1, 3, 4}), (0.5, {1, 3}), (1.0, {1})])
def test_min_p(m, expected):
    assert kept(candidate_mask(_logits_for(PROBS), 0, 1.0, m)) == expected


def test_top_p_applies_after_top_k():
    # after top-2, probs renormalise to 4/7 and 3/7: top_p 0.5 keeps only token 1
    assert kept(candidate_mask(_logits_for(PROBS), 2, 0.5, 0.0)) == {1}


def _draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(sampler.sample(logits[None], [params], [[1, *out]], [1])[0].token_id)
    return out


def test_seeded_sampling_repeats_and_ignores_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(1000)
    s = Sampler(1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    a, b = _draw(s, logits, params, 30), _draw(Sampler(1000), logits, params, 30)
    assert a == b
    assert len(set(a)) > 5
    other = SamplingParams(temperature=1.0, seed=99)
    batch = s.sample(torch.stack([torch.randn(1000), logits]), [other, params], [[1], [1]], [1, 1])
    assert batch[1].token_id == a[0]
    assert _draw(s, logits, SamplingParams(temperature=1.0, seed=1235), 30) != a


def test_samples_only_from_candidates():
    logits = _logits_for(PROBS)
    s = Sampler(5)
    params = SamplingParams(temperature=1.0, top_k=2, seed=7)
    tokens = {s.sample(logits[None], [params], [[0] * (i + 1)], [1])[0].token_id for i in range(200)}
    assert tokens == {1, 3}


def test_greedy_and_logprobs():
    logits = _logits_for(PROBS)
    out = Sampler(5).sample(logits[None], [SamplingParams(temperature=0, logprobs=2)], [[0]], [1])[0]
    assert out.token_id == 1
    assert out.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert [t for t, _ in out.top_logprobs] == [1, 3]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 1.0]
    freq = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [2], [3, 3])
    assert freq.tolist() == [2.0, -2.0, 1.0, 1.0 - 1.0 - 0.25]


def test_min_tokens_blocks_eos():
    logits = torch.tensor([0.0, 0.0, 10.0, 1.0])
    s = Sampler(4, eos_token_ids=[2])
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    assert s.sample(logits[None], [params], [[0, 3]], [1])[0].token_id == 3
    assert s.sample(logits[None], [params], [[0, 3, 3]], [1])[0].token_id == 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("logprobs", 100),
        ("seed", -1),
        ("stop_token_ids", (10**9,)),
    ],
)
def test_invalid_params_name_the_parameter(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate(vocab_size=1000)


def test_min_tokens_above_max_is_invalid():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate()


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    z = logits / p.temperature
    keep = candidate_mask(z, p.top_k, p.top_p, p.min_p)
    return z.masked_fill(~keep, float("-inf")).softmax(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.7, min_p=0.05),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, min_p=0.2),
        SamplingParams(temperature=5.0, top_p=0.999),  # a flat nucleus wider than the candidate set
    ],
)
def test_batched_draws_follow_the_reference_distribution(params):
    """Rows of one batch, each with its own params, drawn 4000 times: only candidates, and frequencies within
    a few standard errors of the reference probabilities (seeded, so the check is deterministic)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3000, generator=gen) * 3
    other = SamplingParams(temperature=1.0, top_k=3, seed=1)
    sampler = Sampler(3000)
    draws = 4000
    batch = torch.stack([logits, torch.randn(3000, generator=gen)])
    counts = torch.zeros(3000)
    for i in range(draws):
        seeded = SamplingParams(**{**params.__dict__, "seed": 10_000 + i})
        out = sampler.sample(batch, [seeded, other], [[0], [0]], [1, 1])
        counts[out[0].token_id] += 1
    want = _reference_probs(logits, params)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    freq = counts / draws
    stderr = (want * (1 - want) / draws).sqrt()
    assert ((freq - want).abs() <= 5 * stderr + 2e-3).all()


def test_tiny_temperature_is_greedy_and_bad_rows_fail_alone():
    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan"), 1.0, 2.0], [1.0, 0.0, 3.0]])
    s = Sampler(3)
    out = s.sample(
        logits,
        [SamplingParams(temperature=1e-37), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=3)],
        [[0], [0], [0]],
        [1, 1, 1],
    )
    assert out[0].token_id == 1
    assert isinstance(out[1], SamplingError)
    assert isinstance(out[2], SampleOutput)
    greedy = s.sample(
        logits[:1].repeat(2, 1).index_copy(0, torch.tensor([1]), logits[1:2]),
        [SamplingParams(temperature=0)] * 2,
        [[0], [0]],
        [1, 1],
    )
    assert greedy[0].token_id == 1 and isinstance(greedy[1], SamplingError)


def test_greedy_rows_take_the_argmax_kernel_where_it_takes_the_logits():
    calls = []

    def kernel(logits: torch.Tensor) -> tuple[list[int], set[int]] | None:
        calls.append(logits.shape)
        return None if logits.dtype == torch.float16 else ([2] * logits.shape[0], {1})

    s = Sampler(3, argmax=kernel)
    logits = torch.tensor([[0.0, 5.0, 1.0], [1.0, 0.0, 3.0]])
    out = s.sample(logits, [SamplingParams(temperature=0)] * 2, [[0], [0]], [1, 1])
    assert out[0].token_id == 2 and isinstance(out[1], SamplingError)  # the kernel's answer
    out = s.sample(logits.half(), [SamplingParams(temperature=0)] * 2, [[0], [0]], [1, 1])
    assert [o.token_id for o in out] == [1, 2]  # it declined: torch's argmax
    assert len(calls) == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-9])
def test_non_finite_or_negative_temperature_is_invalid(value):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value).validate()


def test_two_level_inverse_cdf_matches_one_cumsum_and_skips_zero_weights():
    """A vocabulary of many chunks plus a ragged tail, weight only on a few tokens (chunk edges, the tail):
    the chunked draw picks what one cumulative sum over the row picks, and never a zero-weight token."""
    from pdserve.engine.sampler import CDF_CHUNK, _inverse_cdf

    vocab = 11 * CDF_CHUNK + 37
    weights = torch.zeros(3, vocab)
    heavy = [0, CDF_CHUNK - 1, CDF_CHUNK, 5 * CDF_CHUNK + 17, vocab - 1]
    weights[0, heavy] = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    weights[1] = torch.rand(vocab, generator=torch.Generator().manual_seed(0))
    weights[2, vocab - 5] = 2.0
    for u in (0.0, 0.05, 0.1, 0.35, 0.5, 0.61, 0.9, 0.999999, 1.0 - 2**-24):
        us = torch.full((3,), u)
        got = _inverse_cdf(weights, us)
        cdf = weights.cumsum(-1)
        want = torch.searchsorted(cdf, (us[:, None] * cdf[:, -1:]).contiguous(), right=True).squeeze(1)
        assert (weights.gather(1, got[:, None]) > 0).all(), u
        assert got[0].item() in heavy and got[2].item() == vocab - 5
        assert torch.equal(got[:1], want[:1].clamp(max=vocab - 1)), u
        assert abs(got[1].item() - want[1].item()) <= 1, u  # sums in a different order may move a boundary


def test_logit_bias_shifts_its_tokens_only():
    """+100 makes a greedy row pick the biased token, -100 bans the favourite; a neighbour without a bias in the same
    batch keeps its own argmax; a sampled row with a -100 bias never draws that token."""
    logits = torch.stack([_logits_for(PROBS)] * 3)
    s = Sampler(5)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((0, 100.0),)),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias=((1, -100.0),)),
    ]
    out = s.sample(logits, params, [[2]] * 3, [1] * 3)
    assert [o.token_id for o in out] == [0, 1, 3]
    drawn = SamplingParams(temperature=1.0, seed=7, logit_bias=((1, -100.0), (3, -100.0)))
    tokens = {s.sample(logits[:1], [drawn], [[2] * (i + 1)], [1])[0].token_id for i in range(50)}
    assert tokens and not tokens & {1, 3}


@pytest.mark.parametrize("bias", [((0, 100.5),), ((9, 1.0),), (((-1, 1.0)),)])
def test_logit_bias_is_validated(bias):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias).validate(vocab_size=5)
    assert e.value.param == "logit_bias"
