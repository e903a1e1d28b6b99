"""Runs one scheduled batch: flattens it into the forward's inputs, runs the model, samples.

Owns the model weights, the paged KV cache tensor and the attention backend of one worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine import weight_format
from pdserve.engine.attention import AttentionMetadata, select_backend
from pdserve.engine.config import EngineConfig, ModelConfig, parse_dtype
from pdserve.engine.errors import SamplingError
from pdserve.engine.grammar import GrammarState
from pdserve.engine.host_memory import keep_freed_memory, weights_into_huge_pages, zeros_in_huge_pages
from pdserve.engine.kv_cache import plan_kv_cache
from pdserve.engine.model import LlamaForCausalLM, load_model
from pdserve.engine.model_store import cache_dir, gguf_source, resolve_model
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SampleOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.speculation import StepCost
from pdserve.kernels import cpu_decoder_layer, cpu_elementwise, cpu_isa, quant_linear
from pdserve.kernels.kv_layout import KVLayout

log = logging.getLogger(__name__)

LayerHook = Callable[[int], None]
Samples = list[SampleOutput] | SamplingError | None
"""What a step gives one sequence of its batch: its new tokens in order (one, or more where guesses were kept),
the SamplingError that fails it alone, or None when it does not sample this step."""


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_rows: list[int]  # which batch entry each of those rows belongs to (several for a speculating one)


def cpu_formats(
    model: LlamaForCausalLM, cfg: EngineConfig, quantization: str, dtype: torch.dtype, gguf: Path | None
) -> tuple[quant_linear.CpuLinear | None, cpu_elementwise.CpuElementwise | None]:
    """Put a CPU model's linears in `quantization`'s format and its element-wise steps on the C kernels where they
    run (logged); the kernel libraries it loaded."""
    wants_kernels = quantization != "none" or dtype == torch.bfloat16
    kernels = quant_linear.load(cache_dir() / "kernels") if wants_kernels else None
    log.info("%s", weight_format.apply(model, quantization, dtype, kernels, gguf, cfg.activations))
    log.info("%s", weights_into_huge_pages(model).describe())
    ops = cpu_elementwise.load(cache_dir() / "kernels") if cfg.fused_elementwise else None
    if ops is not None and dtype == torch.bfloat16:
        model.use_ops(ops.rms_norm, ops.apply_rope, ops.silu_and_mul)
        log.info("element-wise steps: one-pass C kernels (%s)", cpu_elementwise.SOURCE.name)
    return kernels, ops


def fuse_decode_layers(model: LlamaForCausalLM, backend: str, kv_cache: torch.Tensor) -> str:
    """Bind `model`'s pure decode steps to the C layer stack where everything it runs is what the eager layers would
    run (cpu_linear.c, the C element-wise ops, the C attention); say which."""
    eager = "layer by layer in torch and ctypes calls ({})".format
    weights = model.layer_weights()
    if isinstance(weights, str):
        return eager(weights)
    if backend != "cpu":
        return eager(f"attention backend {backend}")
    shape = model.layer_shape()
    why = shape.unsupported() or next(filter(None, (w.unsupported(shape) for w in weights)), None)
    if why is not None:
        return eager(why)
    lib = cpu_decoder_layer.load(cache_dir() / "kernels")
    if lib is None:
        return eager(f"{cpu_decoder_layer.SOURCE.name} not built")
    max_rows = min(lin.bf16_rows for w in weights for lin in (w.qkv, w.o, w.gate_up, w.down))  # bf16 rows
    layers = cpu_decoder_layer.DecodeLayers(lib, shape, weights, max_rows)
    if not layers.supports_cache(kv_cache):
        return eager("a KV cache the C layer does not take")
    model.decode_layers = layers
    return f"the layer stack in one C call ({cpu_decoder_layer.SOURCE.name}) for up to {max_rows} rows"


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        layout: KVLayout,
        attention_backend: str = "auto",
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.layout = layout
        self.device = torch.device(device)
        cpu = self.device.type == "cpu"
        self.kv_cache = zeros_in_huge_pages(layout.shape, layout.torch_dtype) if cpu else layout.allocate(self.device)
        self.backend = select_backend(attention_backend, self.device, layout.block_size, layout.torch_dtype)
        self.sampler = Sampler(self.config.vocab_size, self.config.eos_token_ids)
        self.step_cost = StepCost()  # what decode steps took by their rows: what a guess row costs here
        self.invariant_rows = self._invariant_rows()
        self._span_starts, self._span_limit = self._invariant_spans()

    def _invariant_rows(self) -> int | None:
        """The most rows a step may have with each row's logits those it gets alone, by the C linear kernels this
        model runs (`QuantLinear.invariant_rows`); None where torch runs every linear (no bound is claimed: the
        tests check fp32 against itself with and without guesses)."""
        rows = [m.invariant_rows for m in self.model.modules() if isinstance(m, quant_linear.QuantLinear)]
        return min(rows) if rows else None

    def _invariant_spans(self) -> tuple[list[int], int | None]:
        """Every linear's spans of row counts with the same arithmetic per row (`QuantLinear.invariant_spans`),
        intersected: where a span starts in any of them, and the last row count all of them vouch for."""
        spans = [m.invariant_spans for m in self.model.modules() if isinstance(m, quant_linear.QuantLinear)]
        if not spans:
            return [], None
        return sorted({first for each in spans for first, _ in each}), min(each[-1][1] for each in spans)

    def rows_beside(self, base: int) -> int:
        """The most rows a step of `base` rows may grow to with guess rows while every row's logits stay what the
        step of `base` rows gives it (its span of row counts); `base` where none may be added, unbounded (a large
        number) where torch runs every linear."""
        if self._span_limit is None:
            return 1 << 30
        if base > self._span_limit:
            return base
        return min([first - 1 for first in self._span_starts if first > base] + [self._span_limit])

    @classmethod
    def from_config(cls, cfg: EngineConfig, model: LlamaForCausalLM | None = None) -> ModelRunner:
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        dtype = parse_dtype(cfg.dtype)
        path = resolve_model(cfg.model) if model is None or cfg.quantization == "gguf" else None
        gguf = gguf_source(path) if path is not None else None
        if model is None and path is not None:  # the GGUF's own blocks replace the linears: never dequantized
            model = load_model(path, dtype, gguf=gguf, linears=cfg.quantization != "gguf" or cfg.device != "cpu")
        assert model is not None
        device = torch.device(
            "cuda"
            if cfg.device == "auto" and torch.cuda.is_available()
            else "cpu"
            if cfg.device == "auto"
            else cfg.device
        )
        if device.type == "cpu":
            keep_freed_memory()
        if device.type != "cpu":
            model = model.to(device)
        weight_format.check(cfg.quantization, device.type)
        kernels: quant_linear.CpuLinear | None = None
        ops: cpu_elementwise.CpuElementwise | None = None
        if device.type == "cpu":
            log.info("CPU level %s (%s)", cpu_isa.level(), f"capped by {cpu_isa.ENV}" if cpu_isa.cap() else "detected")
            kernels, ops = cpu_formats(model, cfg, cfg.quantization, dtype, gguf)
        layout = plan_kv_cache(
            model.config,
            dtype,
            cfg.block_size,
            cfg.kv_cache_memory,
            cfg.num_blocks,
            device.type,
            weight_format.fingerprint(cfg.quantization, cfg.activations),
        )
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            layout.num_blocks,
            layout.block_size,
            layout.num_blocks * layout.block_nbytes / 2**20,
        )
        runner = cls(model, layout, cfg.attention_backend, device)
        if ops is not None:
            runner.sampler.argmax = ops.argmax
            log.info("greedy sampling: argmax_rows (%s)", cpu_elementwise.SOURCE.name)
        if ops is not None and dtype == torch.bfloat16 and kernels is not None and cfg.fused_decode_layers:
            log.info("decode steps: %s", fuse_decode_layers(runner.model, runner.backend.name, runner.kv_cache))
        return runner

    def prepare(self, batch: ScheduledBatch) -> BatchInputs:
        """A speculating sequence's last token and its guesses go in as one-token queries of their own over its
        blocks (each sees the cache up to its position), so a step stays a decode step for the attention kernels
        and the C layer stack, and every guess gets its logits."""
        bs = self.layout.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables_of: list[list[int]] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            begin = seq.num_computed_tokens
            table = seq.block_ids
            draft = seq.draft
            if draft:
                ids.extend(seq.token_ids[begin:] + draft)
                pos = range(begin, begin + n)
                for p in pos:
                    starts.append(starts[-1] + 1)
                    seq_lens.append(p + 1)
                    tables_of.append(table)
                    logits_indices.append(starts[-1] - 1)
                    sample_rows.append(i)
            else:
                ids.extend(seq.token_ids[begin : begin + n])
                pos = range(begin, begin + n)
                starts.append(starts[-1] + n)
                seq_lens.append(begin + n)
                tables_of.append(table)
                if batch.samples(i):
                    logits_indices.append(starts[-1] - 1)
                    sample_rows.append(i)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
        tables = torch.zeros(len(tables_of), max(max((len(t) for t in tables_of), default=1), 1), dtype=torch.long)
        for i, table in enumerate(tables_of):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables.to(dev),
        )
        return BatchInputs(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_rows,
        )

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs, layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Logits `[len(sample_rows), vocab]` for the sampling rows; writes every new token's K/V."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend, layer_hook)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def execute(self, batch: ScheduledBatch, layer_hook: LayerHook | None = None) -> list[Samples]:
        """Run the batch; per sequence, what it samples (`Samples`)."""
        start = time.perf_counter()
        inputs = self.prepare(batch)
        logits = self.forward(inputs, layer_hook)
        out: list[Samples] = [None] * len(batch.seqs)
        if not inputs.sample_rows:
            return out
        decode_shape = len(inputs.sample_rows) == len(inputs.input_ids)  # every row one token, every row sampled
        # row j of a speculating sequence samples as if its first j guesses were already its tokens
        tokens: list[list[int]] = []
        grammars: list[GrammarState | None] = []
        offset = 0
        for k, i in enumerate(inputs.sample_rows):
            seq = batch.seqs[i]
            offset = offset + 1 if k and inputs.sample_rows[k - 1] == i else 0
            guessed = seq.draft[:offset]
            tokens.append(seq.token_ids + guessed if guessed else seq.token_ids)
            grammars.append(seq.grammar.fork(guessed) if guessed and seq.grammar is not None else seq.grammar)
        seqs = [batch.seqs[i] for i in inputs.sample_rows]
        samples = self.sampler.sample(
            logits, [s.params for s in seqs], tokens, [s.num_prompt_tokens for s in seqs], grammars
        )
        ended: set[int] = set()  # speculating sequences whose run of kept guesses is over
        for i, sample in zip(inputs.sample_rows, samples):
            picked = out[i]
            if picked is None:
                out[i] = sample if isinstance(sample, SamplingError) else [sample]
            elif i in ended or not isinstance(picked, list):
                continue
            elif isinstance(sample, SamplingError) or picked[-1].token_id != batch.seqs[i].draft[len(picked) - 1]:
                ended.add(i)  # a failed row past the first ends the run: it is computed again next step
            else:
                picked.append(sample)
        if decode_shape:
            self.step_cost.observe(len(inputs.sample_rows), time.perf_counter() - start)
        return out
