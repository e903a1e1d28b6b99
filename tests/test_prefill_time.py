"""The prefill worker's step-time model: what a backlog will take, from steps of any size, under changing load."""

from __future__ import annotations

import random

import pytest

from pdserve.prefill_service.prefill_time import PrefillTime, features

SMOLLM_TOKEN_FLOPS = 2 * 135e6


def _burst(n: int = 8, tokens: int = 17) -> list[tuple[int, int]]:
    return [(tokens, 0)] * n


def test_before_any_step_the_prior_predicts_a_sane_backlog():
    model = PrefillTime(SMOLLM_TOKEN_FLOPS)
    fixed, per_token, per_pair = model.coef
    assert fixed > 0 and per_token > 0 and per_pair >= 0
    # 136 tokens at 270 MFLOP each and the prior's 20 GFLOP/s: seconds, not the minutes of a start_within
    assert 0.5 < model.backlog_seconds(_burst()) < 5.0


def test_one_token_warm_up_steps_do_not_make_a_burst_look_like_minutes():
    """The failure the ratio model had: a 1-token step is all fixed cost, and 138 queued tokens looked like 45 s."""
    model = PrefillTime(SMOLLM_TOKEN_FLOPS)
    for _ in range(50):
        model.observe([(1, 0)], 0.03)
    assert model.step_seconds([(1, 0)]) == pytest.approx(0.03, rel=0.05)
    assert model.backlog_seconds(_burst()) < 5.0


def test_steps_of_several_sizes_recover_fixed_token_and_pair_costs():
    truth = (0.02, 4e-4, 2e-7)
    rng = random.Random(0)
    model = PrefillTime(SMOLLM_TOKEN_FLOPS)
    for _ in range(200):
        chunks = [(rng.randint(1, 512), rng.choice([0, 0, 256])) for _ in range(rng.randint(1, 4))]
        x = features(chunks)
        seconds = (truth[0] * x[0] + truth[1] * x[1] + truth[2] * x[2]) * rng.uniform(0.97, 1.03)
        model.observe(chunks, seconds)
    for got, want in zip(model.coef, truth):
        assert got == pytest.approx(want, rel=0.15)  # noise of +-3%
    pending = [(300, 0), (1000, 100)]
    x = features(pending)
    assert model.backlog_seconds(pending) == pytest.approx(truth[0] + truth[1] * x[1] + truth[2] * x[2], rel=0.05)


def test_the_fit_follows_a_machine_that_got_busier():
    """Neighbours took the cores: steps became 3x slower; within a few dozen steps the model says so."""
    model = PrefillTime(SMOLLM_TOKEN_FLOPS)
    sizes = [1, 16, 64, 256]
    for i in range(100):
        n = sizes[i % 4]
        model.observe([(n, 0)], 0.01 + 5e-4 * n)
    calm = model.backlog_seconds(_burst())
    for i in range(60):
        n = sizes[i % 4]
        model.observe([(n, 0)], 3 * (0.01 + 5e-4 * n))
    assert model.backlog_seconds(_burst()) == pytest.approx(3 * calm, rel=0.15)


def test_a_backlog_counts_one_fixed_cost_per_step_it_fills():
    model = PrefillTime(SMOLLM_TOKEN_FLOPS, max_step_tokens=100)
    model.coef = (1.0, 0.0, 0.0)
    assert model.backlog_seconds([]) == 0.0
    assert model.backlog_seconds([(100, 0)]) == 1.0
    assert model.backlog_seconds([(60, 0), (60, 0)]) == 2.0


def test_steps_with_nothing_to_learn_from_are_ignored():
    model = PrefillTime(SMOLLM_TOKEN_FLOPS)
    before = model.coef
    model.observe([], 0.5)
    model.observe([(10, 0)], 0.0)
    model.observe([(10, 0)], float("nan"))
    assert model.coef == before and model.steps == 0
