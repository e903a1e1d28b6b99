"""The draft model of speculative decoding: the served model itself with its linears in a cheaper weight format.

It guesses a sequence's next tokens greedily, one forward per guess, and the target checks them all in its next
step (`engine.speculation`). A draft of the same model has the same layers, heads and tokenizer, so it needs no KV
cache of its own: it reads the target's paged cache, whose KV up to the sequence's last token the target wrote,
and writes its own K/V for the positions it guesses into the slots the target's checking step then overwrites
with the target's own before any row of that step reads them (each layer writes its rows' K/V, then attends). The
target's tokens therefore never depend on the draft; only how many guesses are kept does.

On a CPU a 4-bit draft reads about a quarter of the bytes of a bf16 target per forward, and decode is bound by
those bytes: the draft's guesses cost about a quarter of a target step each, and the same weights guess the target's
tokens most of the time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig, parse_dtype
from pdserve.engine.grammar import allowed_tokens
from pdserve.engine.model import LlamaForCausalLM, load_model
from pdserve.engine.model_runner import ModelRunner, cpu_formats, fuse_decode_layers
from pdserve.engine.model_store import gguf_source, resolve_model
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculation import TO_DRAFT, StepCost

log = logging.getLogger(__name__)

DRAFT_FORMATS = ("gguf", "q4_0", "q8_0")  # what `speculative_draft` may name ("none": no draft model)


class DraftModel:
    """Guesses with `model` over `target`'s KV cache, with `target`'s attention backend."""

    def __init__(self, model: LlamaForCausalLM, target: ModelRunner) -> None:
        if model.config != target.config:
            raise ValueError("a draft model must have the target's shape: it reads and writes the target's KV cache")
        self.model = model
        self.target = target
        self.step_cost = StepCost()  # what a draft forward costs by its rows: what a drafted guess costs here

    @classmethod
    def from_config(cls, cfg: EngineConfig, target: ModelRunner) -> DraftModel:
        """`cfg.model` loaded again with its linears in `cfg.speculative_draft` (one of DRAFT_FORMATS), on the CPU."""
        fmt = cfg.speculative_draft
        if fmt not in DRAFT_FORMATS:
            raise ValueError(f"speculative_draft {fmt!r} is not one of {DRAFT_FORMATS}")
        if target.device.type != "cpu":
            raise ValueError("a draft model runs on a CPU only (its weight formats are the CPU's)")
        path = resolve_model(cfg.model)
        gguf = gguf_source(path)
        if fmt == "gguf" and gguf is None:
            raise ValueError(f"speculative_draft gguf needs a model that is a .gguf file; {cfg.model!r} is not")
        dtype = parse_dtype(cfg.dtype)
        model = load_model(path, dtype, gguf=gguf, linears=fmt != "gguf")
        kernels, ops = cpu_formats(model, cfg, fmt, dtype, gguf)
        if ops is not None and kernels is not None and dtype == torch.bfloat16 and cfg.fused_decode_layers:
            log.info("draft steps: %s", fuse_decode_layers(model, target.backend.name, target.kv_cache))
        log.info("speculation: draft model %s with %s weights, over the target's KV cache", path.name, fmt)
        return cls(model, target)

    @torch.inference_mode()
    def guess(self, seqs: Seq[Sequence]) -> None:
        """Replace every `TO_DRAFT` guess of `seqs` (each about to sample its next token, with blocks for its
        guesses) by the draft's greedy token, one forward per guess position over the sequences guessing that far;
        a constrained sequence's guesses end early where its grammar allows nothing more."""
        bs = self.target.layout.block_size
        states = {s: s.grammar.fork(()) for s in seqs if s.grammar is not None}
        tables = torch.zeros(len(seqs), max(len(s.block_ids) for s in seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.long)
        depth = 0
        while index := [i for i, s in enumerate(seqs) if len(s.draft) > depth]:
            start = time.perf_counter()
            rows = [seqs[i] for i in index]
            tokens = [s.token_ids[-1] if depth == 0 else s.draft[depth - 1] for s in rows]
            positions = [len(s.token_ids) - 1 + depth for s in rows]
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(
                    [s.block_ids[p // bs] * bs + p % bs for s, p in zip(rows, positions)], dtype=torch.long
                ),
                query_start_loc=list(range(len(rows) + 1)),
                seq_lens=[p + 1 for p in positions],
                block_tables=tables if len(index) == len(seqs) else tables[index],
            )
            hidden = self.model(
                torch.tensor(tokens, dtype=torch.long),
                torch.tensor(positions, dtype=torch.long),
                self.target.kv_cache,
                meta,
                self.target.backend,
            )
            logits = self.model.compute_logits(hidden)
            picks: list[int] = logits.argmax(dim=-1).tolist()
            ended: set[int] = set()  # rows whose grammar allows nothing more: their guesses end here
            refused = [i for i, s in enumerate(rows) if s in states and not states[s].allows(picks[i])]
            if refused:  # a constrained guess is the best token its grammar allows after the guesses before it
                allowed = torch.from_numpy(allowed_tokens([states[rows[i]] for i in refused], logits.shape[-1]))
                masked = logits[refused].float().masked_fill(~allowed, float("-inf"))
                finite = torch.isfinite(masked.amax(-1)).tolist()
                for i, token, ok in zip(refused, masked.argmax(-1).tolist(), finite):
                    picks[i] = token
                    if not ok:
                        ended.add(i)
            for i, (s, token) in enumerate(zip(rows, picks)):
                assert s.draft[depth] == TO_DRAFT, "a draft model fills only the guesses left to it"
                if i in ended:
                    del s.draft[depth:]
                    continue
                s.draft[depth] = token
                if s in states:
                    states[s].accept(token)
            self.step_cost.observe(len(rows), time.perf_counter() - start)
            depth += 1
