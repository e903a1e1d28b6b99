"""Speculative decoding by prompt lookup and by a draft model: the guesses, their checking, and the tokens, which must
be what they are without it (greedy and seeded draws alike), with every block handed back."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.errors import InvalidParameter
from pdserve.engine.grammar import Constraint
from pdserve.engine.model_store import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculation import (
    MAX_SPECULATIVE_TOKENS,
    TO_DRAFT,
    NgramIndex,
    Speculation,
    StepCost,
    worth_checking,
)


def _engine(path, **kw) -> EngineCore:
    """Every guess proposed is checked (no step costs are recorded): tests check tokens, never timings."""
    engine = EngineCore(EngineConfig(model=str(path), **kw))
    engine.runner.step_cost.observe = lambda rows, seconds: None  # type: ignore[method-assign]
    if engine.draft_model is not None:
        engine.draft_model.step_cost.observe = lambda rows, seconds: None  # type: ignore[method-assign]
    return engine


DRAFTS = ["none", "q8_0"]  # lookup alone; and a draft model where lookup finds nothing (the tiny model has no GGUF)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Half of them repeat a phrase (what lookup finds), half are noise."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2:
            phrase = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 9))]
            prompts.append([rng.randrange(3, 256) for _ in range(5)] + phrase * rng.randrange(3, 6))
        else:
            prompts.append([rng.randrange(3, 256) for _ in range(rng.randrange(2, 60))])
    return prompts


def _run(engine: EngineCore, prompts, params) -> list[tuple[list[int], str | None]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    while engine.has_work:
        for out in engine.step():
            assert out.error is None, out.error
        engine.allocator.check_invariants()
    assert engine.allocator.num_used_blocks == 0
    return [(s.output_ids, s.finish_reason) for s in seqs]


# ---- the guesses ---------------------------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 0, 2, 3, 4]
    # the suffix 2 3 4 occurred twice before: the latest (followed by 6 7 8) wins
    assert index.propose(tokens, 3) == [6, 7, 8]
    assert index.propose(tokens, 1) == [6]
    # a longer suffix that matches beats a shorter, more recent one
    tokens = [7, 1, 2, 3, 50, 51, 9, 2, 3, 60, 7, 1, 2, 3]
    assert NgramIndex().propose(tokens, 2) == [50, 51]


def test_lookup_never_matches_the_suffix_with_itself_and_grows_with_the_text():
    assert NgramIndex().propose([4, 5, 6, 7], 4) == []  # nothing earlier
    assert NgramIndex().propose([4, 5], 4) == []
    index = NgramIndex()  # one index follows one growing token list
    tokens = [4, 5, 6, 7, 4, 5]
    assert index.propose(tokens, 4) == [6, 7, 4, 5]
    tokens += [6, 7]  # the latest earlier 6 7 ... 4 5 6 7 is at the start, followed by 4 5
    assert index.propose(tokens, 2) == [4, 5]
    assert index.propose(tokens, 0) == []
    assert NgramIndex().propose([1, 1, 1, 1], 3) == [1]  # a run: what followed its latest earlier match is the last


def test_guesses_adapt_to_what_is_kept():
    spec = Speculation(8)
    assert spec.lookup.k == 8
    spec.draft = [1, 2, 3, 4, 5, 6, 7, 8]
    spec.settle(2)
    assert spec.lookup.k == 3 and spec.draft == [] and (spec.proposed, spec.accepted) == (8, 2)
    spec.draft = [1, 2, 3]
    spec.settle(3)
    assert spec.lookup.k == 5
    spec.draft = [1, 2, 3, 4, 5]
    spec.settle(5)
    assert spec.lookup.k == 7
    spec.draft = [9]
    spec.settle(0)
    assert spec.lookup.k == 1
    spec.settle(0)  # no guesses: nothing counted, nothing changed
    assert (spec.proposed, spec.accepted, spec.lookup.refused, spec.lookup.k) == (17, 10, 2, 1)
    assert spec.acceptance == pytest.approx(11 / 14)


def test_the_draft_model_guesses_where_lookup_finds_nothing_or_is_expected_to_make_fewer_tokens():
    spec = Speculation(4, drafts=True)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3]
    assert spec.propose(tokens, room=10) == [4, 5, 9, 2] and spec.source is spec.lookup and not spec.to_draft
    spec.settle(4)
    assert spec.propose([7, 8, 9], room=10) == [TO_DRAFT] * 4 and spec.to_draft
    spec.settle(1)  # the model's first guess kept, its second refused: it guesses two next
    assert (spec.model.k, spec.model.accepted, spec.lookup.k) == (2, 1, 4)
    assert spec.propose([7, 8, 9, 10], room=1) == [TO_DRAFT]
    spec.settle(0)
    assert spec.propose([7, 8, 9, 10], room=0) == [] and spec.source is None
    for _ in range(3):  # lookup's guesses refused at once, the model's kept: the model guesses even where lookup finds
        spec.lookup.settle(4, 0)
        spec.model.settle(2, 2)
    assert spec.propose(tokens, room=10) == [TO_DRAFT] * spec.model.k
    spec.settle(0)
    # but where a draft forward costs as much as a step, lookup's free guesses win even kept less often
    assert spec.propose(tokens, room=10, draft_price=1.0) == [4] and spec.source is spec.lookup  # lookup.k is 1
    spec.settle(0)
    assert (spec.proposed, spec.accepted) == (spec.lookup.proposed + spec.model.proposed, 4 + 1 + 6)
    plain = Speculation(4)  # no draft model: lookup or nothing
    assert plain.propose([7, 8, 9], room=10) == [] and not plain.to_draft


def test_a_step_checks_the_guesses_worth_their_rows():
    cost = StepCost()
    assert cost.estimate(4) is None
    assert worth_checking(1, [0.9, 0.5, 0.1], cost) == 3  # nothing measured: check them all
    for rows, ms in ((1, 10.0), (2, 10.2), (4, 10.6), (8, 14.0), (16, 25.0)):
        cost.observe(rows, ms / 1e3)
    assert cost.estimate(3) == pytest.approx(10.4e-3)  # between two measured
    assert cost.estimate(40) == pytest.approx(25e-3)  # past them: as the largest, until a step that big runs
    busy = StepCost(window=4)
    busy.observe(1, 10e-3)
    busy.observe(1, 40e-3)  # a neighbour slowed this step: the rows cost what the fast one showed
    assert busy.estimate(1) == pytest.approx(10e-3)
    for _ in range(4):
        busy.observe(1, 20e-3)  # the machine stays busier: the window holds only the new cost
    assert busy.estimate(1) == pytest.approx(20e-3)
    # one sequence: cheap rows, every likely guess pays; a guess almost never kept does not
    assert worth_checking(1, [0.9, 0.81, 0.73], cost) == 3
    assert worth_checking(1, [0.01], cost) == 0
    # eight sequences fill the cheap rows: only guesses nearly sure to be kept are worth a dearer step
    assert worth_checking(8, [0.3] * 8, cost) == 0
    assert worth_checking(8, [0.99] * 8, cost) == 8


def test_a_drafted_guess_costs_its_share_of_a_draft_forward():
    """Guess j of a sequence whose guesses a draft model makes needs the draft's j-th forward, which every sequence
    guessing that deep shares: a step keeps the guesses worth the target's rows and the draft's forwards."""
    cost, draft = StepCost(), StepCost()
    for rows in range(1, 17):
        cost.observe(rows, 10e-3)  # the target's rows are free up to 16
    draft.observe(1, 5e-3)
    draft.observe(2, 5.5e-3)
    chances = [0.9, 0.81, 0.73, 0.66]
    assert worth_checking(1, chances, cost) == 4  # already made: every guess pays
    # drafted: 1.9 tokens / 15 ms, 2.71 / 20, 3.44 / 25 (best), 4.1 / 30
    assert worth_checking(1, chances, cost, [1, 2, 3, 4], draft) == 3
    slow = StepCost()
    slow.observe(1, 20e-3)
    assert worth_checking(1, chances, cost, [1, 2, 3, 4], slow) == 0  # a draft dearer than what it saves
    # two sequences' first guesses share one forward (5.5 ms): (2 + 1.8) / 15.5 ms beats (2 + 0.9) / 15 ms
    assert worth_checking(2, [0.9, 0.9], cost, [1, 1], draft) == 2
    assert worth_checking(1, chances, cost, [1, 2, 3, 4], StepCost()) == 4  # the draft not measured yet: free


def test_probe_rows_grow_rarer_while_the_cost_model_keeps_no_guess(tiny_model_dir, monkeypatch):
    """A step whose guesses all cost more than they are worth checks one anyway now and then (a cost measured in a
    busy moment must not stop speculation for good); while the cost model keeps none, each such check doubles the
    wait for the next, up to RECHECK_BACKOFF times RECHECK_EVERY, and a step that keeps a guess brings the first
    wait back."""
    from pdserve.engine import engine_core

    every = 2  # RECHECK_EVERY, smaller: a few waits at the cap fit in the tiny model's 512 positions
    monkeypatch.setattr(engine_core, "RECHECK_EVERY", every)

    def one_guess(self, tokens, room, draft_price=0.0):
        self.draft, self.source = [tokens[-1]], self.lookup
        return self.draft

    monkeypatch.setattr(Speculation, "propose", one_guess)
    engine = _engine(tiny_model_dir, speculative_tokens=1, num_blocks=256, block_size=4)
    cost = engine.runner.step_cost

    def rows_cost(two: float) -> None:
        StepCost.observe(cost, 1, 1e-3)  # the engine's own observations are switched off (_engine)
        for _ in range(8):
            StepCost.observe(cost, 2, two)

    rows_cost(1.0)  # a guess row costs a thousand steps: never worth it
    seq = engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    checked: list[int] = []  # the decode steps that checked a guess
    step = 0
    while engine.has_work and len(checked) < 8:
        batch = engine.schedule()
        if seq.draft:
            checked.append(step)
        engine.update(batch, engine.execute(batch))
        step += seq.num_computed_tokens > 4
    gaps = [b - a for a, b in zip(checked, checked[1:])]
    cap = engine_core.RECHECK_BACKOFF
    assert gaps == [every * f for f in (2, 4, 8, 16, cap, cap, cap)], checked
    rows_cost(1e-3)  # guess rows got cheap: every step checks its guess, and the wait starts over
    for _ in range(3):
        batch = engine.schedule()
        assert seq.draft
        engine.update(batch, engine.execute(batch))
    rows_cost(1.0)
    waited = 0
    while engine.has_work:
        batch = engine.schedule()
        waited += 1
        if seq.draft:
            break
        engine.update(batch, engine.execute(batch))
    assert waited == every
    engine.abort(seq)


def test_speculative_tokens_is_checked():
    SamplingParams(speculative_tokens=0).validate()
    SamplingParams(speculative_tokens=MAX_SPECULATIVE_TOKENS).validate()
    for bad in (-1, MAX_SPECULATIVE_TOKENS + 1, 2.5):
        with pytest.raises(InvalidParameter, match="speculative_tokens") as e:
            SamplingParams(speculative_tokens=bad).validate()  # type: ignore[arg-type]
        assert e.value.param == "speculative_tokens"


# ---- the tokens: what they are without speculation -----------------------------------------------------------------


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_are_those_without_speculation(tiny_model_dir, block_size, draft):
    prompts = _prompts(12, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(tiny_model_dir, num_blocks=256, block_size=block_size), prompts, params)
    engine = _engine(
        tiny_model_dir, num_blocks=256, block_size=block_size, speculative_tokens=6, speculative_draft=draft
    )
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
        engine.allocator.check_invariants()
    assert [(s.output_ids, s.finish_reason) for s in seqs] == plain
    assert engine.allocator.num_used_blocks == 0
    assert engine.num_proposed > 0 and 0 < engine.num_accepted <= engine.num_proposed
    assert engine.stats().speculative_accepted_total == engine.num_accepted
    drafted = [s.speculation.model for s in seqs if s.speculation is not None]
    if draft == "none":
        assert all(m.proposed == 0 for m in drafted)
    else:  # the noise prompts have nothing to look up: the draft guessed for them, and was mostly right
        assert sum(m.accepted for m in drafted) > sum(m.proposed for m in drafted) / 2


@pytest.mark.parametrize("draft", DRAFTS)
def test_seeded_draws_are_those_without_speculation(tiny_model_dir, draft):
    """A kept guess is the token the row drew with the uniform of its output position, so a seed gives the same
    tokens: top-k, top-p, min-p, penalties, min_tokens and logprobs included."""
    prompts = _prompts(10, seed=2)
    rng = random.Random(5)
    params = [
        SamplingParams(
            max_tokens=32,
            temperature=rng.choice([0.3, 0.7, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            frequency_penalty=rng.choice([0.0, 0.5]),
            min_tokens=rng.choice([0, 8]),
            logprobs=rng.choice([None, 2]),
            seed=1000 + i,
        )
        for i in range(len(prompts))
    ]
    plain_engine = _engine(tiny_model_dir, num_blocks=256, block_size=4)
    spec_engine = _engine(tiny_model_dir, num_blocks=256, block_size=4, speculative_tokens=5, speculative_draft=draft)
    plain_seqs = [plain_engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    spec_seqs = [spec_engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    logprobs: dict[tuple[int, int], list] = {}
    for engine, tag in ((plain_engine, 0), (spec_engine, 1)):
        while engine.has_work:
            for out in engine.step():
                assert out.sample is not None
                if out.seq.params.logprobs is not None:
                    logprobs.setdefault((tag, id(out.seq)), []).append(out.sample)
    for a, b in zip(plain_seqs, spec_seqs):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason
        if a.params.logprobs is not None:
            got, want = logprobs[(1, id(b))], logprobs[(0, id(a))]
            assert [s.token_id for s in got] == [s.token_id for s in want]
            for g, w in zip(got, want):
                assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
                assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
    assert spec_engine.num_accepted > 0
    assert spec_engine.allocator.num_used_blocks == 0


@pytest.mark.parametrize("draft", DRAFTS)
def test_stops_and_limits_end_a_run_of_kept_guesses(tiny_model_dir, draft):
    """A kept guess that is a stop token, or that reaches max_tokens, ends the sequence there: nothing after it is
    returned."""
    prompts = _prompts(8, seed=3)
    plain_engine = _engine(tiny_model_dir, num_blocks=256, block_size=4)
    free = _run(plain_engine, prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    # stop on a token each greedy answer reaches in the middle, so a run of guesses may cross it
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(out[len(out) // 2],))
        for out, _ in free
    ]
    plain = _run(plain_engine, prompts, params)
    spec_engine = _engine(tiny_model_dir, num_blocks=256, block_size=4, speculative_tokens=8, speculative_draft=draft)
    assert _run(spec_engine, prompts, params) == plain
    assert all(reason == "stop" for _, reason in plain)
    for n in (1, 2, 7):
        short = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert _run(spec_engine, prompts, short) == _run(plain_engine, prompts, short)


def test_requests_that_do_and_do_not_speculate_share_steps(tiny_model_dir):
    """Per request: speculative_tokens 0 turns it off on a worker that speculates, a number turns it on where the
    worker does not; both kinds in one batch keep their tokens."""
    prompts = _prompts(10, seed=4)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    mixed = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative_tokens=[0, 3, None][i % 3])
        for i in range(len(prompts))
    ]
    plain = _run(_engine(tiny_model_dir, num_blocks=256, block_size=4), prompts, base)
    for worker_k in (0, 4):
        engine = _engine(tiny_model_dir, num_blocks=256, block_size=4, speculative_tokens=worker_k)
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, mixed)]
        while engine.has_work:
            engine.step()
        assert [(s.output_ids, s.finish_reason) for s in seqs] == plain
        for seq in seqs:
            k = seq.params.speculative_tokens
            speculates = (worker_k if k is None else k) > 0
            assert (seq.speculation is not None) == speculates


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_small_pool_preempts_and_trims_guesses_and_stays_exact(tiny_model_dir, draft):
    """Guesses take only blocks that are free: they never preempt anyone, and a preempted sequence drops them."""
    prompts = _prompts(8, seed=6)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(tiny_model_dir, num_blocks=256, block_size=4), prompts, params)
    engine = _engine(tiny_model_dir, num_blocks=48, block_size=4, speculative_tokens=8, speculative_draft=draft)
    assert _run(engine, prompts, params) == plain
    assert engine.num_preemptions > 0 and engine.num_accepted > 0


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_tight_token_budget_trims_guesses(tiny_model_dir, draft):
    prompts = _prompts(6, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(tiny_model_dir, num_blocks=256, block_size=4, max_num_batched_tokens=9), prompts, params)
    engine = _engine(
        tiny_model_dir,
        num_blocks=256,
        block_size=4,
        max_num_batched_tokens=9,
        speculative_tokens=8,
        speculative_draft=draft,
    )
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        batch = engine.schedule()
        assert batch.num_tokens <= 9
        engine.update(batch, engine.execute(batch))
    assert engine.num_accepted > 0
    assert [(s.output_ids, s.finish_reason) for s in seqs] == plain


def test_an_aborted_sequence_with_guesses_in_flight_hands_back_its_blocks(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4, speculative_tokens=8)
    phrase = [11, 12, 13, 14, 15]
    seq = engine.add_request([3] + phrase * 5, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(50):
        batch = engine.schedule()
        if seq.draft:
            break
        engine.update(batch, engine.execute(batch))
    assert seq.draft, "the repeated phrase was meant to be guessed"
    blocks = len(seq.block_ids)
    samples = engine.execute(batch)
    engine.abort(seq)  # while its step is in flight: freed when the step is accounted
    assert len(seq.block_ids) == blocks
    engine.update(batch, samples)
    assert seq.is_finished and engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()


# ---- the built-in model: bf16 kernels, a real tokenizer, grammars --------------------------------------------------


@pytest.fixture(scope="module")
def builtin():
    path = resolve_model("default")
    engines = {k: _engine(path, dtype="bfloat16", speculative_tokens=k) for k in (0, 6)}
    engines[-1] = _engine(path, dtype="bfloat16", speculative_tokens=4, speculative_draft="gguf")
    return path, engines


def _chat(path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": text}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


COPY = (
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears, plums, "
    "cherries, apples, pears, plums, cherries."
)


def _room_for_guesses(engine: EngineCore, rows: int) -> bool:
    """Whether the kernels vouch for a step of more than `rows` rows (a CPU level whose kernels vouch for one row,
    the portable C path, checks no guesses and must still give the same tokens)."""
    return engine.runner.rows_beside(rows) > rows


def test_a_step_grows_only_within_its_span_of_row_counts(builtin):
    """The runner's spans (on AMX, bf16: 1-3 rows alone, 4-64 rows on the tile unit): a step of 2 rows may grow to
    3, one of 8 to 64, one past every span by nothing; torch's linears claim no bound."""
    _, engines = builtin
    runner = engines[6].runner
    saved = runner._span_starts, runner._span_limit
    try:
        runner._span_starts, runner._span_limit = [1, 4], 64
        assert [runner.rows_beside(b) for b in (1, 2, 3, 4, 8, 64, 65)] == [3, 3, 3, 64, 64, 64, 65]
        runner._span_starts, runner._span_limit = [1], 7
        assert [runner.rows_beside(b) for b in (1, 7, 8)] == [7, 7, 8]
        runner._span_starts, runner._span_limit = [], None
        assert runner.rows_beside(8) > 1000
    finally:
        runner._span_starts, runner._span_limit = saved


def test_builtin_model_bf16_greedy_is_the_same_with_guesses_in_the_step(builtin):
    """The bf16 kernels sum a row the same way whatever rows share its step, so the C layer stack picks the same
    greedy tokens for a guess checked beside others as for a one-row step."""
    path, engines = builtin
    prompts = [_chat(path, COPY), _chat(path, "Write a short poem about the sea.")]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    plain = _run(engines[0], prompts, params)
    before = engines[6].num_accepted
    assert _run(engines[6], prompts, params) == plain
    if _room_for_guesses(engines[6], len(prompts)):
        assert engines[6].num_accepted - before >= 16


def test_builtin_model_gguf_draft_guesses_free_text_and_keeps_the_tokens(builtin):
    """The draft (the GGUF's own 4-bit blocks, over the bf16 target's KV cache) guesses text with nothing to look up;
    the target's tokens, greedy and seeded, are what they are without it. (Seeded draws are compared between engines
    with the same history: a prompt whose KV came from the prefix cache, computed in a step of other rows, may
    differ in its last bits, which a draw can notice and a greedy pick seldom does.)"""
    path, engines = builtin
    prompts = [_chat(path, "Write a short poem about the sea."), _chat(path, "Why is the sky blue?")]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain_engine = _engine(path, dtype="bfloat16")  # the same history as the drafting engine: the same cached KV
    plain = _run(plain_engine, prompts, params)
    drafting = engines[-1]
    seqs = [drafting.add_request(p, params) for p in prompts]
    while drafting.has_work:
        for out in drafting.step():
            assert out.error is None, out.error
    assert [(s.output_ids, s.finish_reason) for s in seqs] == plain
    assert drafting.allocator.num_used_blocks == 0
    if _room_for_guesses(drafting, len(prompts)):
        model = [s.speculation.model for s in seqs if s.speculation is not None]
        assert sum(m.accepted for m in model) >= 24  # the same weights in 4 bits mostly pick the target's tokens
    seeded = SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    assert _run(drafting, prompts, seeded) == _run(plain_engine, prompts, seeded)


def test_a_draft_model_must_have_the_targets_shape(builtin, tiny_model_dir):
    from pdserve.engine.draft_model import DraftModel

    _, engines = builtin
    tiny = _engine(tiny_model_dir, num_blocks=16)
    with pytest.raises(ValueError, match="shape"):
        DraftModel(tiny.runner.model, engines[0].runner)
    with pytest.raises(ValueError, match="gguf"):
        _engine(tiny_model_dir, num_blocks=16, speculative_draft="gguf")  # no GGUF behind the tiny model
    with pytest.raises(ValueError, match="speculative_draft"):
        _engine(tiny_model_dir, num_blocks=16, speculative_draft="fp8")


def test_a_grammar_masks_each_guess_row_from_the_state_after_the_guesses_before(builtin):
    path, engines = builtin
    schema = '{"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}}}'
    prompts = [_chat(path, COPY + " Answer in JSON with a fruits array.")]
    for params in (
        SamplingParams(max_tokens=80, temperature=0.0, constraint=Constraint("json_schema", schema)),
        SamplingParams(max_tokens=80, temperature=0.8, seed=3, constraint=Constraint("regex", r"(apples, |pears, )+")),
    ):
        seqs = []
        for engine in (engines[0], engines[6]):
            seq = engine.add_request(prompts[0], params)
            while engine.has_work:
                for out in engine.step():
                    assert out.error is None, out.error
            seqs.append(seq)
        assert seqs[1].output_ids == seqs[0].output_ids
        if _room_for_guesses(engines[6], 1):
            assert seqs[1].speculation is not None and seqs[1].speculation.accepted > 0


def test_a_draft_models_guesses_follow_the_grammar(builtin):
    """The draft picks the best token its grammar allows after its guesses before, through a grammar that completes
    within a step's guesses too; the answers are those without speculation. (Fresh engines: the same history, the
    same cached KV.)"""
    path, _ = builtin
    plain = _engine(path, dtype="bfloat16")
    drafting = _engine(path, dtype="bfloat16", speculative_tokens=4, speculative_draft="gguf")
    schema = (
        '{"type": "object", "properties": {"city": {"type": "string"}, "reasons": {"type": "array", "items": '
        '{"type": "string"}}}, "required": ["city", "reasons"]}'
    )
    asks = [
        ("Which city would you visit first, and why? Answer in JSON.", Constraint("json_schema", schema), 0.0),
        ("Is the sea salty?", Constraint("regex", r"Yes, the sea is salty\."), 0.0),
        ("Name some fruits.", Constraint("regex", r"(apples|pears|plums)(, (apples|pears|plums))*"), 0.7),
    ]
    drafted = 0
    for text, constraint, temperature in asks:
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=5, constraint=constraint)
        seqs = []
        for engine in (plain, drafting):
            seq = engine.add_request(_chat(path, text), params)
            while engine.has_work:
                for out in engine.step():
                    assert out.error is None, out.error
            seqs.append(seq)
        assert seqs[1].output_ids == seqs[0].output_ids and seqs[1].finish_reason == seqs[0].finish_reason
        spec = seqs[1].speculation  # None for an answer that ended with its first token
        drafted += spec.model.accepted if spec is not None else 0
    assert drafting.allocator.num_used_blocks == 0
    if _room_for_guesses(drafting, 1):
        assert drafted > 0


def test_steps_stay_within_the_rows_the_kernels_vouch_for(monkeypatch):
    """On an AVX2 core the bf16 kernels sum a row in one order up to 7 rows (then block-wise): a step takes only the
    guesses that keep it within them, so the greedy tokens stay those of one-row steps there too."""
    from pdserve.kernels import cpu_isa

    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    path = resolve_model("default")
    plain_engine = _engine(path, dtype="bfloat16")
    spec_engine = _engine(path, dtype="bfloat16", speculative_tokens=8)
    assert spec_engine.runner.invariant_rows == 7
    prompt = _chat(path, COPY)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    seq = spec_engine.add_request(prompt, params)
    while spec_engine.has_work:
        batch = spec_engine.schedule()
        assert len(batch.seqs) == 1 and (batch.num_tokens <= 7 or not seq.draft)
        spec_engine.update(batch, spec_engine.execute(batch))
    assert seq.output_ids == _run(plain_engine, [prompt], params)[0][0]
    assert spec_engine.num_accepted >= 8


def test_the_ceiling_times_steps_where_every_sequence_checks_its_guesses(tiny_model_dir):
    """The c=8 ceiling's steps have 8 (1 + g) rows, a sequence's together as a served step has them; the engine's
    own choice of guesses is back and every block free afterwards."""
    from pdserve.benchmarks.speculation import guess_steps

    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=256, block_size=4, max_num_seqs=8))
    free = engine.scheduler.allocator.num_free_blocks
    rows: list[int] = []
    execute = engine.execute

    def counting(batch, layer_hook=None):
        rows.append(sum(batch.num_new_tokens))
        return execute(batch, layer_hook)

    engine.execute = counting  # type: ignore[method-assign]
    times = guess_steps(engine, 3, 20, 2, random.Random(0))
    assert len(times) == 2 and all(t > 0 for t in times)
    assert rows[-2:] == [8 * 4, 8 * 4]
    assert "_propose" not in vars(engine)
    assert engine.scheduler.allocator.num_free_blocks == free


def test_the_c8_window_closes_when_the_first_client_runs_out_of_requests():
    """The "8 in flight" rate counts what came before the first client had nothing left to send; the whole block's
    rate counts everything."""
    from pdserve.benchmarks.speculation import _Block

    block = _Block(start=0.0)
    block.add(5)
    block.client_done()
    block.add(3)
    block.client_done()
    assert block.produced == 8
    assert block.in_flight is not None and block.in_flight[0] == 5 and block.in_flight[1] > 0
