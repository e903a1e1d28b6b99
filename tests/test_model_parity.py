"""The default model (SmolLM2-135M-Instruct, fp32) through the paged engine against `transformers` on the same
weights."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.gateway.tokenizer import Tokenizer
from tests.conftest import hf_greedy

TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the ocean and the moon.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List three reasons why the sky is blue, and explain each in one sentence.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "Translate to French: The weather is nice today and I would like to go for a walk in the park with my dog.",
    "Explain the difference between a process and a thread in an operating system. " * 4,
]


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tok = Tokenizer(model_dir)
    chat = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in TEXTS[:4]]
    return chat + [tok.encode(t) for t in TEXTS[4:]]


def test_logits_match_transformers(model_dir, hf_model, prompts):
    """One forward over three prompts of different lengths in a single flat batch."""
    engine = EngineCore(EngineConfig(model=str(model_dir), num_blocks=64))
    chosen = prompts[:3]
    seqs = [
        Sequence(str(i), p, SamplingParams(), block_ids=engine.allocator.allocate(-(-len(p) // 16)))
        for i, p in enumerate(chosen)
    ]
    inputs = engine.runner.prepare(ScheduledBatch(seqs, [len(p) for p in chosen], [True] * len(seqs)))
    inputs.logits_indices = torch.arange(sum(len(p) for p in chosen))
    logits = engine.runner.forward(inputs)
    worst = 0.0
    start = 0
    with torch.no_grad():
        for p in chosen:
            ref = hf_model(torch.tensor([p])).logits[0]
            worst = max(worst, (logits[start : start + len(p)] - ref).abs().max().item())
            start += len(p)
    print(f"max |logits - transformers| = {worst:.3g}")
    assert worst < 1e-3


@pytest.mark.slow
def test_greedy_mixed_batch_matches_transformers_token_for_token(model_dir, hf_model, prompts):
    """8 prompts, 64 tokens each, joining the running batch at different steps."""
    n = 64
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine = EngineCore(EngineConfig(model=str(model_dir), max_num_batched_tokens=96))
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_work:
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            results[engine.add_request(p, params, request_id=str(i)).request_id] = []
        for out in engine.step():
            results[out.request_id].append(out.token_id)
        step += 1
    for i, p in enumerate(prompts):
        assert results[str(i)] == hf_greedy(hf_model, p, n), f"prompt {i} diverged"
    assert engine.allocator.num_used_blocks == 0
