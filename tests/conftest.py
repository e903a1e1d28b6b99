"""Shared fixtures: the real default model (converted once, cached) and a tiny random Llama saved as an HF dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.kernels import cpu_isa

cpu_isa.apply_cap()  # PDSERVE_CPU_ISA=avx2 make test: this machine runs the paths of an AVX2-only CPU, torch's too

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel is defined, once per process. Without CUDA the kernel tests run
# through the interpreter; with CUDA it stays unset so every kernel runs compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# the stack tests `make test-busy` runs beside CPU hogs (PDSERVE_TEST_HOGS=N); test_under_load has its own
BUSY_MODULES = {"test_pipeline", "test_migration", "test_faults", "test_hardening"}


@pytest.fixture(autouse=True, scope="module")
def _busy_machine(request):
    """With PDSERVE_TEST_HOGS=N, N processes spin on this run's cores for as long as a stack test module runs."""
    from tests.hogs import cpu_hogs, hogs_requested

    count = hogs_requested()
    if not count or request.module.__name__.rsplit(".", 1)[-1] not in BUSY_MODULES:
        yield
        return
    with cpu_hogs(count, seconds=3600.0):
        yield


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from pdserve.engine.model_store import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer GQA Llama with random weights, written by `transformers` itself (separate q/k/v, tied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The default model in transformers, fp32: the oracle every end-to-end test compares against."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.model_store import transformers_dir

    return AutoModelForCausalLM.from_pretrained(str(transformers_dir(model_dir)), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from pdserve.gateway.tokenizer import Tokenizer

    return Tokenizer(model_dir)


EOS = 2  # the default model's end-of-sequence id


def until_eos(tokens: list[int]) -> list[int]:
    """`tokens` up to and including the first EOS: where a server that honours EOS stops."""
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding with `transformers` (KV cache on, EOS not special), one prompt at a time."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="session")
def observed_stack(tmp_path_factory):
    """One prefill, decode and gateway exporting traces to an OTLP receiver here, /metrics on free ports, and
    JSON logs in files: (stack, receiver, log_dir)."""
    from pdserve.trace_console import OTLPReceiver
    from tests.stack import start_stack

    logs = tmp_path_factory.mktemp("logs")
    with OTLPReceiver() as otlp:
        stack = start_stack(
            observe=["--otlp-endpoint", otlp.endpoint],
            log_dir=logs,
            env={"OTEL_BSP_SCHEDULE_DELAY": "100", "PDSERVE_LOG_LEVEL": "INFO", "PDSERVE_LOG_FORMAT": "json"},
        )
        try:
            yield stack, otlp, logs
        finally:
            stack.stop()
