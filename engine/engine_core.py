"""The engine core: one owner for the model runner, the block allocator and the scheduler, and one `step()`.

A step is schedule -> forward + sample -> update. Every role runs this same core: offline generation calls
`step()` in a loop; the serving workers (`engine.engine_loop`) run `schedule` and `update` on their event
loop and `execute` on a model thread, so scheduler state is only ever touched from one thread. What differs
between roles is what they feed in (prompts, or sequences whose KV a prefill worker already wrote) and what they
do with each output (stream it, or ship the prompt's KV).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence as Seq

from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.config import EngineConfig
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_runner import LayerHook, ModelRunner
from pdserve.engine.request_check import check_request
from pdserve.engine.sampler import SampleOutput, SamplingError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """One new token of one sequence, or (`error` set, `sample` None) why the sequence failed this step."""

    seq: Sequence
    sample: SampleOutput | None
    error: SamplingError | None = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_id(self) -> int:
        assert self.sample is not None, "a failed step has no token"
        return self.sample.token_id

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    @property
    def finished(self) -> bool:
        return self.seq.is_finished


class EngineCore:
    def __init__(self, cfg: EngineConfig, model: LlamaForCausalLM | None = None) -> None:
        self.runner = ModelRunner.from_config(cfg, model)
        self.model_config = self.runner.config
        self.layout = self.runner.layout
        self.max_model_len = min(cfg.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        self.allocator = BlockAllocator(self.layout.num_blocks, self.layout.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.in_step: set[Sequence] = set()  # sequences in the forward in flight: their blocks are in use
        self._abort_after_step: set[Sequence] = set()
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------------------------

    @property
    def pool_tokens(self) -> int:
        return self.allocator.num_blocks * self.allocator.block_size

    def check(self, token_ids: Seq[int], params: SamplingParams, reserved_blocks: int = 0,
              new_tokens: int | None = None) -> None:
        """ValueError, naming what is wrong, for a request that could never run here."""
        check_request(token_ids, params, self.model_config.vocab_size, self.max_model_len,
                      (self.allocator.num_blocks - reserved_blocks) * self.allocator.block_size, new_tokens)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose KV is still to be computed (a prompt, or a sequence to recompute)."""
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Run a sequence whose KV for every token but the last is already in its blocks (written by a prefill
        worker): it joins the running batch directly."""
        self.scheduler.add_running(seq)

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence (if it still runs) and free its blocks; a sequence in the forward in flight is
        freed when that step ends. Also how a `prefill_only` sequence's kept blocks are handed back."""
        if seq in self.in_step:
            self._abort_after_step.add(seq)
        elif seq.is_finished:
            if seq.block_ids:
                self.scheduler.release(seq)
        else:
            self.scheduler.finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        self.in_step = set(batch.seqs)
        return batch

    def execute(self, batch: ScheduledBatch, layer_hook: LayerHook | None = None
                ) -> list[SampleOutput | SamplingError | None]:
        """The forward and the sampling (the part that may run on another thread)."""
        return self.runner.execute(batch, layer_hook)

    def update(self, batch: ScheduledBatch, samples: list[SampleOutput | SamplingError | None]
               ) -> list[StepOutput]:
        """Account for a finished forward: computed tokens, new tokens, finished sequences."""
        self.in_step = set()
        self.scheduler.commit(batch)
        eos = self.model_config.eos_token_ids
        outputs = []
        for seq, sample in zip(batch.seqs, samples):
            if seq in self._abort_after_step:
                self._abort_after_step.discard(seq)
                self.abort(seq)
                continue
            if sample is None or seq.is_finished:
                continue
            if isinstance(sample, SamplingError):  # this sequence alone fails
                self.scheduler.finish(seq, "abort")
                outputs.append(StepOutput(seq, None, sample))
                continue
            seq.append(sample.token_id, eos, self.max_model_len)
            if seq.finish_reason is not None or seq.prefill_only:
                self.scheduler.finish(seq, seq.finish_reason or "prefilled", free=not seq.prefill_only)
            outputs.append(StepOutput(seq, sample))
        return outputs

    def fail(self, batch: ScheduledBatch) -> list[Sequence]:
        """The step raised: retire every sequence it held (their owners are told), free their blocks."""
        self.in_step = set()
        failed = []
        for seq in batch.seqs:
            self._abort_after_step.discard(seq)
            if not seq.is_finished:
                failed.append(seq)
            self.abort(seq)
        return failed

    def step(self, layer_hook: LayerHook | None = None) -> list[StepOutput]:
        batch = self.schedule()
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("waiting requests cannot be scheduled: the KV pool is held elsewhere")
            return []
        return self.update(batch, self.execute(batch, layer_hook))

    # ---- offline generation --------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str = "") -> Sequence:
        self.check(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params)
        self.add(seq)
        return seq

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[list[int]]:
        """Generate for every prompt (continuously batched); returns output token ids in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            for out in self.step():
                if out.error is not None:
                    raise out.error
        return [s.output_ids for s in seqs]

    def stats(self) -> dict:
        """What a worker reports about its pool and batch."""
        return {"kv_blocks_total": self.allocator.num_blocks, "kv_blocks_used": self.allocator.num_used_blocks,
                "kv_blocks_cached": self.allocator.num_cached_blocks, "block_size": self.allocator.block_size,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "prefix_hit_tokens": self.allocator.prefix_hit_tokens, "max_model_len": self.max_model_len,
                "preemptions_total": self.num_preemptions}
