"""The paged engine on a tiny random model: exact against `transformers`, under chunking, preemption and prefix hits."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model import load_model
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 70))] for _ in range(n)]


def _engine(path, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), **kw))


def test_loads_hf_directory_with_identical_logits(tiny_model_dir, tiny_hf_model):
    model = load_model(tiny_model_dir)
    engine = _engine(tiny_model_dir, num_blocks=16, block_size=4)
    ids = list(range(5, 35))
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.engine.sequence import Sequence

    seq = Sequence("a", ids, GREEDY, block_ids=engine.allocator.allocate(8))
    batch = ScheduledBatch([seq], [len(ids)], [True])
    inputs = engine.runner.prepare(batch)
    inputs.logits_indices = torch.arange(len(ids))
    logits = engine.runner.forward(inputs)
    with torch.no_grad():
        ref = tiny_hf_model(torch.tensor([ids])).logits[0]
    assert model.config.num_kv_heads == 2
    assert (logits - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_size,budget", [(4, 2048), (16, 2048), (8, 19)])
def test_greedy_matches_transformers(tiny_model_dir, tiny_hf_model, block_size, budget):
    """Budget 19 forces long prompts to be prefilled in chunks next to other sequences' decode tokens."""
    prompts = _prompts(8)
    engine = _engine(tiny_model_dir, num_blocks=256, block_size=block_size, max_num_batched_tokens=budget)
    got = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, got):
        assert out == hf_greedy(tiny_hf_model, prompt, GREEDY.max_tokens)
    assert engine.allocator.num_used_blocks == 0


def test_preemption_recomputes_and_stays_exact(tiny_model_dir, tiny_hf_model):
    prompts = _prompts(6, seed=1)
    engine = _engine(tiny_model_dir, num_blocks=40, block_size=4)
    preempted = 0
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work:
        engine.step()
        preempted = max(preempted, sum(s.num_preemptions for s in engine.scheduler.running))
        engine.allocator.check_invariants()
    assert preempted > 0, "pool was meant to be too small for all sequences at once"
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == hf_greedy(tiny_hf_model, prompt, GREEDY.max_tokens)
    assert engine.allocator.num_used_blocks == 0


def test_prefix_cache_reuses_blocks_and_keeps_output(tiny_model_dir, tiny_hf_model):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    shared = list(range(10, 50))
    a, b = shared + [60, 61], shared + [70, 71, 72]
    first = engine.generate([a], GREEDY)[0]
    seq = engine.add_request(b, GREEDY)
    out = []
    while engine.has_work:
        out.extend(o.token_id for o in engine.step())
    assert seq.num_cached_tokens == 40
    assert first == hf_greedy(tiny_hf_model, a, GREEDY.max_tokens)
    assert out == hf_greedy(tiny_hf_model, b, GREEDY.max_tokens)


def test_abort_frees_blocks(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    seq = engine.add_request(list(range(3, 30)), GREEDY)
    engine.step()
    assert engine.allocator.num_used_blocks > 0
    engine.abort(seq)
    assert engine.allocator.num_used_blocks == 0
    assert not engine.has_work


def test_stops_on_eos_and_stop_ids(tiny_model_dir, tmp_path):
    prompt = list(range(3, 20))
    free = _engine(tiny_model_dir, num_blocks=64, block_size=4).generate([prompt], GREEDY)[0]
    firsts = sorted({t: free.index(t) for t in free}.items(), key=lambda kv: kv[1])
    later = [t for t, i in firsts if i >= 2]
    assert len(later) >= 2, f"greedy output too repetitive to pick stop tokens from: {free}"
    eos, stop_at = later[0], later[1]
    # a copy of the model whose end-of-sequence token is one that greedy decoding reaches after a few steps
    for f in tiny_model_dir.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (tmp_path / f.name).symlink_to(f)
    for name in ("config.json", "generation_config.json"):
        if (tiny_model_dir / name).is_file():
            config = json.loads((tiny_model_dir / name).read_text())
            (tmp_path / name).write_text(json.dumps({**config, "eos_token_id": eos}))
    engine = _engine(tmp_path, num_blocks=64, block_size=4)

    def run(params: SamplingParams) -> tuple[list[int], str | None]:
        seq = engine.add_request(prompt, params)
        while engine.has_work:
            engine.step()
        return seq.output_ids, seq.finish_reason

    assert run(SamplingParams(max_tokens=24, temperature=0.0)) == (free[: free.index(eos) + 1], "stop")
    assert run(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) == (free, "length")
    assert run(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))) == (
        free[: free.index(stop_at) + 1],
        "stop",
    )
    held, _ = run(SamplingParams(max_tokens=24, temperature=0.0, min_tokens=free.index(eos) + 2))
    assert len(held) > free.index(eos) + 1  # EOS is not allowed before min_tokens
    assert run(SamplingParams(max_tokens=2, temperature=0.0)) == (free[:2], "length")
    assert engine.allocator.num_used_blocks == 0


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], GREEDY, "empty"),
        ([1, 999], GREEDY, "token ids"),
        (list(range(3, 200)) * 3, GREEDY, "context"),
        ([5], SamplingParams(temperature=-1), "temperature"),
        ([5], SamplingParams(top_p=0), "top_p"),
    ],
)
def test_rejects_bad_requests(tiny_model_dir, prompt, params, match):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_work


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, repetition_penalty=1.3, presence_penalty=0.4),
    ],
    ids=["greedy", "seeded-penalties", "seeded-repetition"],
)
def test_a_moved_sequence_continues_where_it_stopped(tiny_model_dir, params):
    """What a migration relies on: prompt + the first k outputs, resubmitted with `num_prompt_tokens` at the
    prompt's end on another engine, yields exactly the rest of an unbroken run (seeded draws depend on the
    output position, penalties count the outputs already made, max_tokens counts them too)."""
    from pdserve.engine.sequence import Sequence

    prompts = _prompts(4, seed=5)
    whole = _engine(tiny_model_dir, num_blocks=256, block_size=4).generate(prompts, params)
    other = _engine(tiny_model_dir, num_blocks=256, block_size=4)
    for k, (prompt, out) in zip((1, 5, 11, 23), zip(prompts, whole)):
        k = min(k, len(out) - 1)
        seq = Sequence("moved", prompt + out[:k], params, num_prompt_tokens=len(prompt))
        other.check(seq.token_ids, params, num_prompt_tokens=len(prompt))
        other.add(seq)
        while other.has_work:
            other.step()
        assert seq.output_ids == out, (k, seq.output_ids, out)
    assert other.allocator.num_used_blocks == 0


def test_check_counts_the_tokens_already_generated(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=256, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.check(list(range(3, 20)), params, num_prompt_tokens=10)  # 7 generated, 1 to go
    from pdserve.engine.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="nothing is left of max_tokens") as err:
        engine.check(list(range(3, 20)), params, num_prompt_tokens=9)  # 8 generated: done already
    assert err.value.param == "num_prompt_tokens"
    with pytest.raises(InvalidParameter, match="num_prompt_tokens must be in"):
        engine.check(list(range(3, 20)), params, num_prompt_tokens=0)
