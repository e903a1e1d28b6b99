"""The colocated engine: scheduler + model runner in one loop, for offline generation and single-process serving."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence as Seq

from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner
from engine.request_check import check_request
from engine.sampler import SampleOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[SampleOutput] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model: LlamaForCausalLM | None = None) -> None:
        self.runner = ModelRunner.from_config(cfg, model)
        self.model_config = self.runner.config
        self.max_model_len = min(cfg.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        self.allocator = BlockAllocator(self.runner.spec.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError if this request can never run on this engine."""
        check_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len,
                      self.allocator.num_blocks * self.allocator.block_size)

    def add_request(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str | None = None) -> str:
        self.check_request(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_ids), params)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("waiting requests cannot be scheduled: KV pool too small")
            return []
        samples = self.runner.execute(batch)
        self.scheduler.commit(batch)
        outputs = []
        eos = self.model_config.eos_token_ids
        for seq, sample in zip(batch.seqs, samples):
            if sample is None:
                continue
            seq.append(sample, eos, self.max_model_len)
            out = StepOutput(seq.request_id, [sample.token_id],
                             [sample] if seq.params.logprobs is not None else [])
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                self._seqs.pop(seq.request_id, None)
                out.finished, out.finish_reason = True, seq.finish_reason
            outputs.append(out)
        return outputs

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[list[int]]:
        """Generate for every prompt (continuously batched); returns output token ids in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_work:
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]
