"""The engine core: one owner for the model runner, the block allocator and the scheduler, and one `step()`.

A step is schedule -> forward + sample -> update. Every role runs this same core: offline generation calls
`step()` in a loop; the serving workers (`engine.engine_loop`) run `schedule` and `update` on their event
loop and `execute` on a model thread, so scheduler state is only ever touched from one thread. What differs
between roles is what they feed in (prompts, or sequences whose KV a prefill worker already wrote) and what they
do with each output (stream it, or ship the prompt's KV).

The methods in the first two sections are the facade the worker roles use (requests, reservations for KV that
comes from elsewhere, a stats snapshot, the prefix cache's changes); the runner, allocator and scheduler behind
it are this core's own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pdserve.engine.block_allocator import BlockAllocator, CacheListener
from pdserve.engine.config import EngineConfig
from pdserve.engine.draft_model import DraftModel
from pdserve.engine.errors import SamplingError
from pdserve.engine.grammar import Grammars
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_runner import LayerHook, ModelRunner, Samples
from pdserve.engine.model_store import resolve_model
from pdserve.engine.request_check import check_request
from pdserve.engine.sampling_params import SampleOutput, SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation import Speculation, worth_checking
from pdserve.kernels.kv_layout import KVLayout

log = logging.getLogger(__name__)

RECHECK_EVERY = 16  # after this many steps in a row with guesses left unchecked, one step checks one more
RECHECK_DRAFTED_EVERY = 64  # the same, where that guess is the draft model's to make
RECHECK_BACKOFF = 16  # while the cost model keeps no guess at all, each such check doubles the wait, up to this factor


@dataclass
class StepOutput:
    """One new token of one sequence, or (`error` set, `sample` None) why the sequence failed this step. A step
    that kept guessed tokens gives a sequence several, in order: all but the last have `more` set."""

    seq: Sequence
    sample: SampleOutput | None
    error: SamplingError | None = None
    more: bool = False

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_id(self) -> int:
        assert self.sample is not None, "a failed step has no token"
        return self.sample.token_id

    @property
    def finish_reason(self) -> str | None:
        return None if self.more else self.seq.finish_reason

    @property
    def finished(self) -> bool:
        return self.seq.is_finished and not self.more


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's pool and queues (what a worker reports to the router)."""

    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # holding a prefix-cache entry (in use or not)
    kv_blocks_evictable: int  # cached blocks no sequence holds: free to take, kept for prefix hits until then
    block_size: int
    running: int
    waiting: int  # to be computed here
    reserving: int  # queued for blocks to receive KV computed elsewhere
    awaiting_kv: int  # blocks reserved, KV being written by another process
    queued_tokens: int  # tokens of waiting sequences not computed yet
    prefilling_tokens: int  # tokens of running sequences not computed yet (chunked prompts in progress)
    prefix_hit_tokens: int
    max_model_len: int
    preemptions_total: int
    speculative_proposed_total: int = 0  # tokens guessed by prompt lookup and checked
    speculative_accepted_total: int = 0  # of those, kept
    speculative_drafted_total: int = 0  # of the proposed, guessed by the draft model
    speculative_draft_accepted_total: int = 0  # of those, kept
    grammar_compiles_total: int = 0  # constraints compiled here (not found among the recently compiled)
    grammar_cache_hits_total: int = 0  # constrained requests that started from a recently compiled constraint
    grammar_compile_seconds_total: float = 0.0


class EngineCore:
    """`receives_kv`: other processes write KV into this engine's blocks (a decode worker), so reservations keep
    a watermark of blocks free and `max_reserving` of them may queue for blocks."""

    def __init__(
        self,
        cfg: EngineConfig,
        model: LlamaForCausalLM | None = None,
        receives_kv: bool = False,
        max_reserving: int = 256,
    ) -> None:
        self.runner = ModelRunner.from_config(cfg, model)
        self.model_config = self.runner.config
        self.max_model_len = min(cfg.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        layout = self.runner.layout
        self.allocator = BlockAllocator(layout.num_blocks, layout.block_size, cfg.enable_prefix_caching)
        self.watermark = max(1, layout.num_blocks // 100) if receives_kv else 0
        self.scheduler = Scheduler(
            self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.watermark, max_reserving
        )
        self._model = cfg.model
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.in_step: set[Sequence] = set()  # sequences in the forward in flight: their blocks are in use
        self._abort_after_step: set[Sequence] = set()
        self.num_preemptions = 0
        self.speculative_tokens = cfg.speculative_tokens
        self.draft_model = DraftModel.from_config(cfg, self.runner) if cfg.speculative_draft != "none" else None
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_drafted = 0
        self.num_draft_accepted = 0
        self._trimmed_steps = 0  # steps in a row whose guesses the cost model trimmed
        self._recheck_scale = 1  # the wait before the next such check, as a multiple of RECHECK_EVERY (or DRAFTED)

    # ---- requests ------------------------------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def kv_cache(self) -> torch.Tensor:
        """The paged KV cache (`layout`'s shape): what a KV sender reads from and a receiver writes into."""
        return self.runner.kv_cache

    @property
    def pool_tokens(self) -> int:
        return self.allocator.num_blocks * self.allocator.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return self.allocator.blocks_needed(num_tokens)

    def check(
        self,
        token_ids: Seq[int],
        params: SamplingParams,
        new_tokens: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """InvalidParameter, naming what is wrong, for a request that could never run here. `new_tokens`: how
        many tokens this engine adds to it (a prefill worker: 1); default what `max_tokens` leaves.
        `num_prompt_tokens`: where the prompt ends, when the rest of `token_ids` were generated already."""
        check_request(
            token_ids,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            (self.allocator.num_blocks - self.watermark) * self.allocator.block_size,
            new_tokens,
            num_prompt_tokens,
        )

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler for this model's tokenizer, built on the first constrained request."""
        with self._grammars_lock:
            if self._grammars is None:
                cfg = self.model_config
                tokenizer = resolve_model(self._model) / "tokenizer.json"
                self._grammars = Grammars(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
            return self._grammars

    def constrain(self, seq: Sequence) -> None:
        """Give a constrained sequence its grammar state, having taken the tokens it generated already (compiles
        a constraint not seen lately: call it off the model thread, `EngineLoop.constrain`). InvalidParameter if
        the constraint does not compile."""
        constraint = seq.params.constraint
        if constraint is not None and seq.grammar is None:
            seq.grammar = self.grammars.state(constraint, seq.output_ids)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose KV is still to be computed (a prompt, or a sequence to recompute)."""
        self.constrain(seq)
        self.scheduler.add(seq)

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for every token of `seq`, which another process will fill (its remote prefill): True when
        reserved now, False when it queues for them (`grant` hands them out later, in arrival order).
        PoolExhausted when that queue is full. `abort` releases a reservation in any state."""
        self.constrain(seq)
        return self.scheduler.reserve(seq)

    def grant(self) -> list[Sequence]:
        """Blocks came back: the queued reservations that got theirs now."""
        return self.scheduler.grant()

    def land(self, seq: Sequence, token_id: int, cached_tokens: int = 0) -> None:
        """A reserved sequence's KV has landed and the process that computed it sampled `token_id`: the sequence
        runs here from that token, or, if that token ended it, is finished and its blocks freed."""
        assert seq.status is SequenceStatus.AWAITING_KV, seq.status
        seq.num_cached_tokens = cached_tokens
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            raise SamplingError(f"the first token ({token_id}) breaks the request's constraint")
        seq.append(token_id, self.model_config.eos_token_ids, self.max_model_len)
        self.scheduler.land(seq)  # its prompt's blocks join the prefix cache even when that token ended it
        if seq.finish_reason is not None:
            self.scheduler.finish(seq, seq.finish_reason)

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
        self._propose()
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        self.in_step = set(batch.seqs)
        return batch

    def _propose(self) -> None:
        """Guess the next tokens of every sequence that speculates and is about to sample (`engine.speculation`),
        then keep the guesses worth their rows in this step."""
        base = 0
        chances: list[tuple[float, int, Sequence]] = []  # (chance of being kept, draft depth or 0, whose)
        price = self._draft_price()
        for seq in self.scheduler.running:
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            base += remaining
            spec = seq.speculation
            if spec is None:
                k = seq.params.speculative_tokens
                k = self.speculative_tokens if k is None else k
                if k <= 0 or seq.prefill_only:
                    continue
                spec = seq.speculation = Speculation(k, drafts=self.draft_model is not None)
            if remaining != 1:
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
            draft = spec.propose(seq.token_ids, room, price)
            drafted = spec.to_draft
            if draft and seq.grammar is not None and not drafted:  # the draft model's follow its grammar as made
                del draft[seq.grammar.valid_prefix(draft) :]
            chances.extend((spec.acceptance ** (j + 1), j + 1 if drafted else 0, seq) for j in range(len(draft)))
        if not chances:
            return
        chances.sort(key=lambda c: -c[0])
        keep = worth_checking(
            base,
            [c for c, _, _ in chances],
            self.runner.step_cost,
            [depth for _, depth, _ in chances],
            self.draft_model.step_cost if self.draft_model is not None else None,
        )
        self._trimmed_steps = self._trimmed_steps + 1 if keep < len(chances) else 0
        # a cost measured in a busy moment must not stop speculation: one more row now and then measures that step
        # size again (less often where that row costs a draft model's forward). Where the model keeps no guess at
        # all (nothing to copy, or a step bound by its arithmetic), such a row is mostly a loss: each one doubles
        # the wait for the next, until a step keeps a guess again (served c=8, gguf, nothing to copy, on a Zen 5:
        # 0.93-1.01x the tokens/s without speculation with a check every 16 steps, 0.95-1.01x with the backoff)
        if keep < len(chances) and self._trimmed_steps >= self._recheck_scale * (
            RECHECK_DRAFTED_EVERY if chances[keep][1] else RECHECK_EVERY
        ):
            if keep == 0:
                self._recheck_scale = min(2 * self._recheck_scale, RECHECK_BACKOFF)
            keep, self._trimmed_steps = keep + 1, 0
        elif keep > 0:
            self._recheck_scale = 1
        keep = min(keep, self.runner.rows_beside(base) - base)  # past it the kernels sum a row in another order
        kept: dict[Sequence, int] = {}
        for _, _, seq in chances[:keep]:
            kept[seq] = kept.get(seq, 0) + 1
        for _, _, seq in chances[keep:]:
            del seq.draft[kept.get(seq, 0) :]

    def _draft_price(self) -> float:
        """A one-row draft forward's cost over a one-row step's, as measured here (0 while either is not)."""
        if self.draft_model is None:
            return 0.0
        draft, step = self.draft_model.step_cost.estimate(1), self.runner.step_cost.estimate(1)
        return draft / step if draft and step else 0.0

    def execute(self, batch: ScheduledBatch, layer_hook: LayerHook | None = None) -> list[Samples]:
        """The draft model's guesses, then the forward and the sampling (the part that may run on another thread)."""
        if self.draft_model is not None:
            drafting = [i for i, s in enumerate(batch.seqs) if s.speculation is not None and s.speculation.to_draft]
            if drafting:
                self.draft_model.guess([batch.seqs[i] for i in drafting])
                for i in drafting:  # a grammar may have ended some guesses early
                    batch.num_new_tokens[i] = 1 + len(batch.seqs[i].draft)
        return self.runner.execute(batch, layer_hook)

    def update(self, batch: ScheduledBatch, samples: list[Samples]) -> list[StepOutput]:
        """Account for a finished forward: computed tokens, new tokens (several for a sequence whose guesses were
        kept), finished sequences."""
        self.in_step = set()
        for i, (seq, sample) in enumerate(zip(batch.seqs, samples)):
            spec = seq.speculation
            if spec is None or not spec.draft:
                continue
            if isinstance(sample, list):  # its last token and the guesses kept have their KV now
                batch.num_new_tokens[i] = len(sample)
                self.num_proposed += len(spec.draft)
                self.num_accepted += len(sample) - 1
                if spec.to_draft:
                    self.num_drafted += len(spec.draft)
                    self.num_draft_accepted += len(sample) - 1
                spec.settle(len(sample) - 1)
            else:
                spec.draft = []
        self.scheduler.commit(batch)
        outputs = []
        for seq, sample in zip(batch.seqs, samples):
            if seq in self._abort_after_step:
                self._abort_after_step.discard(seq)
                self.abort(seq)
                continue
            if sample is None or seq.is_finished:
                continue
            outputs.extend(self._take(seq, sample))
        return outputs

    def _take(self, seq: Sequence, samples: list[SampleOutput] | SamplingError) -> list[StepOutput]:
        """Append a sequence's new tokens in order until one ends it; a token its grammar refuses fails it alone."""
        eos = self.model_config.eos_token_ids
        outputs = []
        for sample in [samples] if isinstance(samples, SamplingError) else samples:
            if seq.grammar is not None and not isinstance(sample, SamplingError):
                if not seq.grammar.accept(sample.token_id):
                    sample = SamplingError(f"token {sample.token_id} breaks the constraint: {seq.grammar.error}")
            if isinstance(sample, SamplingError):
                self.scheduler.finish(seq, "abort")
                outputs.append(StepOutput(seq, None, sample))
                break
            seq.append(sample.token_id, eos, self.max_model_len)
            if seq.finish_reason is not None or seq.prefill_only:
                self.scheduler.finish(seq, seq.finish_reason or "prefilled", free=not seq.prefill_only)
            outputs.append(StepOutput(seq, sample, more=True))
            if seq.is_finished:
                break
        if outputs:
            outputs[-1].more = False
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
        plist = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            for out in self.step():
                if out.error is not None:
                    raise out.error
        return [s.output_ids for s in seqs]

    # ---- what it holds ---------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Safe to call from another thread (a metrics scrape): it copies the queues before reading them."""
        sched, alloc = self.scheduler, self.allocator
        g = self._grammars  # not the property: a scrape must not build the compiler
        return EngineStats(
            kv_blocks_total=alloc.num_blocks,
            kv_blocks_used=alloc.num_used_blocks,
            kv_blocks_cached=alloc.num_cached_blocks,
            kv_blocks_evictable=alloc.num_evictable_blocks,
            block_size=alloc.block_size,
            running=len(sched.running),
            waiting=len(sched.waiting),
            reserving=len(sched.reserving),
            awaiting_kv=len(sched.awaiting_kv),
            queued_tokens=sum(len(s.token_ids) - s.num_computed_tokens for s in list(sched.waiting)),
            prefilling_tokens=sum(len(s.token_ids) - s.num_computed_tokens for s in list(sched.running)),
            prefix_hit_tokens=alloc.prefix_hit_tokens,
            max_model_len=self.max_model_len,
            preemptions_total=self.num_preemptions,
            speculative_proposed_total=self.num_proposed,
            speculative_accepted_total=self.num_accepted,
            speculative_drafted_total=self.num_drafted,
            speculative_draft_accepted_total=self.num_draft_accepted,
            grammar_compiles_total=g.compiles if g else 0,
            grammar_cache_hits_total=g.hits if g else 0,
            grammar_compile_seconds_total=g.compile_seconds if g else 0.0,
        )

    def pending_chunks(self) -> list[tuple[int, int]]:
        """(tokens still to compute, tokens already computed) of every sequence waiting or running a prompt: what a
        backlog estimate needs. Safe from another thread, like `stats`."""
        sched = self.scheduler
        seqs = list(sched.waiting) + list(sched.running)
        return [(n, s.num_computed_tokens) for s in seqs if (n := len(s.token_ids) - s.num_computed_tokens) > 0]

    @property
    def num_awaiting_kv(self) -> int:
        """Sequences whose KV another process is computing for this engine now."""
        return len(self.scheduler.awaiting_kv)

    def subscribe_cache(self, listener: CacheListener) -> Callable[[], None]:
        """Call `listener(stored, removed)` with the block hashes the prefix cache gains and loses; returns the
        call that unsubscribes."""
        return self.allocator.subscribe(listener)

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now."""
        return self.allocator.cached_hashes()
