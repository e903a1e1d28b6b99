"""The paged engine on a tiny random model: exact against `transformers`, under chunking, preemption and prefix hits."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import load_model
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 70))] for _ in range(n)]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **kw))


def test_loads_hf_directory_with_identical_logits(tiny_model_dir, tiny_hf_model):
    model = load_model(tiny_model_dir)
    engine = _engine(tiny_model_dir, num_blocks=16, block_size=4)
    ids = list(range(5, 35))
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    seq = Sequence("a", ids, GREEDY, block_ids=engine.allocator.allocate(8))
    batch = ScheduledBatch([seq], [len(ids)])
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
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    results = {i: [] for i in ids}
    while engine.has_work:
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        preempted = max(preempted, sum(s.num_preemptions for s in engine.scheduler.running))
        engine.allocator.check_invariants()
    assert preempted > 0, "pool was meant to be too small for all sequences at once"
    for prompt, rid in zip(prompts, ids):
        assert results[rid] == hf_greedy(tiny_hf_model, prompt, GREEDY.max_tokens)
    assert engine.allocator.num_used_blocks == 0


def test_prefix_cache_reuses_blocks_and_keeps_output(tiny_model_dir, tiny_hf_model):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    shared = list(range(10, 50))
    a, b = shared + [60, 61], shared + [70, 71, 72]
    first = engine.generate([a], GREEDY)[0]
    rid = engine.add_request(b, GREEDY)
    seq = engine.scheduler.waiting[0]
    out = []
    while engine.has_work:
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert seq.num_cached_tokens == 40
    assert first == hf_greedy(tiny_hf_model, a, GREEDY.max_tokens)
    assert out == hf_greedy(tiny_hf_model, b, GREEDY.max_tokens)
    assert rid == seq.request_id


def test_abort_frees_blocks(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    rid = engine.add_request(list(range(3, 30)), GREEDY)
    engine.step()
    assert engine.allocator.num_used_blocks > 0
    engine.abort(rid)
    assert engine.allocator.num_used_blocks == 0
    assert not engine.has_work


def test_stops_on_eos_and_stop_ids(tiny_model_dir):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    prompt = list(range(3, 20))
    free = engine.generate([prompt], GREEDY)[0]
    stop_at = free[5]
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert out == free[: free.index(stop_at) + 1]
    assert len(engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]) <= 3


@pytest.mark.parametrize("prompt,params,match", [
    ([], GREEDY, "empty"),
    ([1, 999], GREEDY, "token ids"),
    (list(range(3, 200)) * 3, GREEDY, "context"),
    ([5], SamplingParams(temperature=-1), "temperature"),
    ([5], SamplingParams(top_p=0), "top_p"),
])
def test_rejects_bad_requests(tiny_model_dir, prompt, params, match):
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_work
