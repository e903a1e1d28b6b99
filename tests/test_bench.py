"""`pdserve bench`: its statistics on synthetic timings (vLLM's definitions), its load shapes, and a live run."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from pdserve.benchmarks.bench_stats import RequestResult, compute_metrics, format_table, parse_goodput
from pdserve.benchmarks.load_gen import BenchRequest, LlamaCppTarget, make_requests, parse_sse, run_load
from pdserve.benchmarks.roofline import Limits, Row


def req(ttft, latency, output_len, itl=None, prompt_len=10, success=True):
    return RequestResult(prompt_len, output_len, ttft, latency, itl or [], success)


def test_throughputs_and_latency_definitions():
    results = [
        req(0.1, 1.0, 10, [0.1] * 9),
        req(0.3, 2.1, 19, [0.1] * 18, prompt_len=20),
        req(0.0, 0.0, 0, success=False),
    ]
    m = compute_metrics(results, duration_s=4.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 30 and m.total_output_tokens == 29
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(29 / 4)
    assert m.total_token_throughput == pytest.approx(59 / 4)
    # TPOT excludes the first token: (latency - ttft) / (output - 1)
    assert m.tpot_ms.mean == pytest.approx(np.mean([0.9 / 9, 1.8 / 18]) * 1000)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.percentiles["p99"] == pytest.approx(np.percentile([100.0, 300.0], 99))
    assert m.e2el_ms.mean == pytest.approx(1550.0)
    assert m.itl_ms.mean == pytest.approx(100.0)  # every gap of every request, pooled
    assert m.request_goodput is None


def test_roofline_rows_divide_by_the_binding_limit_of_the_run_and_of_their_own_time():
    """A step is bound by its bytes or its flops, whichever takes longer; `beside` uses the limits measured around
    the row itself (a slower minute: a lower limit, a kinder ratio), and is 0 when none were measured."""
    run, slow = Limits(50e9, 100e9, 100e9), Limits(25e9, 100e9, 100e9)
    row = Row("gguf", "decode b=1", ms=4.0, bytes=100e6, flops=1e9, beside=slow)
    row.bind(run)  # 2 ms of reading against 10 ms of arithmetic
    assert (row.limit_ms, row.bound, row.ratio) == (pytest.approx(10.0), "flops", pytest.approx(0.4))
    assert row.ratio_beside == pytest.approx(0.4)  # flops still bind: 4 ms of reading at 25 GB/s
    fast = Row("gguf", "decode b=1", ms=4.0, bytes=100e6, flops=1e6, beside=slow)
    fast.bind(run)
    assert (fast.bound, fast.ratio, fast.ratio_beside) == ("bytes", pytest.approx(2.0), pytest.approx(1.0))
    assert Row("bf16", "prefill 128", 1.0, 0, 1e9).ratio_beside == 0.0


def test_roofline_counts_integer_products_at_the_int8_rate():
    """The linears of a format with int8 activations are held to the int8 GEMM rate, the rest of its flops (a
    prompt's attention) to fp32's; the best of two probes keeps each limit's best."""
    limits = Limits(50e9, 100e9, 800e9)
    row = Row("gguf", "prefill 128", ms=12.0, bytes=0, flops=1.6e9, int_flops=1.2e9)
    row.bind(limits)  # 4 ms of fp32 attention + 1.5 ms of int8 linears
    assert (row.limit_ms, row.bound, row.ratio) == (pytest.approx(5.5), "flops", pytest.approx(12.0 / 5.5))
    b1 = Row("gguf", "decode b=1", ms=4.0, bytes=100e6, flops=0.3e9, int_flops=0.3e9)
    b1.bind(limits)  # 3 ms at fp32's rate would bind; at int8's the 2 ms of reading do
    assert (b1.bound, b1.ratio) == ("bytes", pytest.approx(2.0))
    assert Limits(1, 5, 3).best(Limits(2, 4, 6)) == Limits(2, 5, 6)


def test_single_token_requests_have_no_tpot():
    m = compute_metrics([req(0.2, 0.2, 1)], 1.0)
    assert m.tpot_ms.mean == 0.0 and m.ttft_ms.mean == pytest.approx(200.0)


def test_percentiles_interpolate_like_numpy():
    values = [0.01 * i for i in range(1, 102)]
    m = compute_metrics([req(v, v + 1, 2, [v]) for v in values], 10.0, percentiles=[50, 90, 99, 99.9])
    for p in (50, 90, 99):
        assert m.ttft_ms.percentiles[f"p{p}"] == pytest.approx(np.percentile(np.array(values) * 1000, p))
    assert "p99.9" in m.ttft_ms.percentiles


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        req(0.1, 1.0, 11),  # ttft 100 ms, tpot 90 ms
        req(0.6, 1.1, 11),  # ttft too slow
        req(0.1, 3.1, 11),  # tpot 300 ms too slow
        req(0.2, 0.2, 1),
    ]  # one token: no tpot, ttft ok
    slos = parse_goodput(["ttft:500", "tpot:100"])
    m = compute_metrics(results, 2.0, slos=slos)
    assert m.request_goodput == pytest.approx(2 / 2.0)
    assert compute_metrics(results, 2.0, slos=parse_goodput(["e2el:1050"])).request_goodput == pytest.approx(1.0)
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft:-1"])


def test_table_has_vllm_rows():
    text = format_table(compute_metrics([req(0.1, 1.0, 10, [0.1] * 9)], 1.0, [50, 99], parse_goodput(["ttft:1"])))
    for row in (
        "Successful requests:",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "P50 E2EL (ms):",
    ):
        assert row in text


def test_prompts_are_exact_shared_and_reproducible():
    a = make_requests(20, [32, 512], 16, seed=1, weights=[3, 1], prefix_len=8, vocab=(100, 200))
    b = make_requests(20, [32, 512], 16, seed=1, weights=[3, 1], prefix_len=8, vocab=(100, 200))
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert {len(r.prompt_ids) for r in a} == {40, 520}
    assert len({tuple(r.prompt_ids[:8]) for r in a}) == 1
    assert all(100 <= t < 200 for r in a for t in r.prompt_ids)
    spread = make_requests(50, [100], 4, seed=2, range_ratio=0.5)
    assert all(50 <= len(r.prompt_ids) <= 150 for r in spread) and len({len(r.prompt_ids) for r in spread}) > 5


async def test_llama_cpp_requests_carry_text_and_ban_eos():
    """llama-cpp-python's server takes text prompts and has no ignore_eos: the ids go as their decoded text and
    EOS is banned by a logit bias, so its rows produce the same number of tokens as the others."""
    target = LlamaCppTarget("http://127.0.0.1:1", "smollm2", 2, lambda ids: " ".join(map(str, ids)))
    try:
        body = target.body(BenchRequest([5, 6, 7], 16, temperature=0.0))
    finally:
        await target.close()
    assert body["prompt"] == "5 6 7" and body["max_tokens"] == 16 and body["stream"] is True
    assert body["logit_bias"] == {"2": -1e4} and "ignore_eos" not in body and "stream_options" not in body


def test_sse_events_split_across_reads():
    stream = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}], "usage": null}\n\ndata: {"choi'
    events, rest = parse_sse(stream)
    assert [e["choices"][0]["text"] for e in events] == ["a", "b"]
    events, rest = parse_sse(rest + b'ces": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    assert events == [{"choices": [], "usage": {"completion_tokens": 2}}, "[DONE]"] and rest == b""


async def test_concurrency_cap_and_order():
    live = peak = 0

    async def send(r: BenchRequest) -> RequestResult:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)
        live -= 1
        return RequestResult(len(r.prompt_ids), r.output_len, 0.001, 0.01, [], True)

    reqs = [BenchRequest([1] * (i + 1), 3) for i in range(12)]
    results, duration, seen = await run_load(send, reqs, max_concurrency=3, request_rate=float("inf"), seed=0)
    assert peak == seen == 3
    assert [r.prompt_len for r in results] == list(range(1, 13))
    results, _, _ = await run_load(
        send, reqs[:4], max_concurrency=None, request_rate=200.0, seed=0, warmups=[BenchRequest([1], 1)]
    )
    assert len(results) == 4


@pytest.mark.slow
async def test_bench_against_a_live_stack(observed_stack, tmp_path):
    import argparse

    from pdserve.benchmarks.load_gen import add_arguments, bench

    stack, _, _ = observed_stack
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "runs.jsonl"
    args = p.parse_args(
        [
            "--address",
            stack.gateway,
            "--num-requests",
            "6",
            "--max-concurrency",
            "3",
            "--input-len",
            "12,40",
            "--output-len",
            "5",
            "--num-warmups",
            "1",
            "--label",
            "smoke",
            "--goodput",
            "ttft:60000",
            "--result-json",
            str(out),
            "--vocab-range",
            "1000,40000",
        ]
    )
    record = await bench(args)
    assert record["completed"] == 6 and record["failed"] == 0
    assert record["total_output_tokens"] == 30
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])
    assert record["max_concurrent_requests"] <= 3
    assert record["ttft_ms"]["mean"] > 0 and record["itl_ms"]["mean"] > 0
    assert json.loads(out.read_text())["label"] == "smoke"


@pytest.mark.slow
async def test_bench_openai_backend_against_pdserve_http_api(observed_stack):
    """`pdserve bench --backend openai` drives pdserve's own OpenAI-compatible API: exact token counts."""
    import argparse

    from pdserve.benchmarks.load_gen import add_arguments, bench

    stack, _, _ = observed_stack
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            stack.http,
            "--num-requests",
            "4",
            "--max-concurrency",
            "2",
            "--input-len",
            "20",
            "--output-len",
            "6",
            "--num-warmups",
            "0",
            "--vocab-range",
            "1000,40000",
        ]
    )
    record = await bench(args)
    assert record["completed"] == 4 and record["failed"] == 0
    assert record["total_output_tokens"] == 24


@pytest.mark.parametrize("in_cache", [False, True])
def test_decode_attention_benchmark_divides_by_its_bytes_and_flops(in_cache):
    from pdserve.benchmarks.decode_attention import measure

    r = measure(
        batch=2,
        context=20,
        heads=4,
        kv_heads=2,
        head_dim=32,
        layers=2,
        block_size=16,
        dtype=torch.bfloat16,
        between_mb=0.5,
        in_cache=in_cache,
        reps=1,
        limits=(1e10, 1e11),
    )
    assert r.kv_bytes == 2 * 2 * 20 * 2 * 32 * 2  # K and V, batch 2, context 20, 2 KV heads of 32, bf16
    assert r.flops == 2 * 2 * 2 * 4 * 20 * 32
    assert r.us_per_layer > 0
    assert r.bytes_ratio == pytest.approx(r.us_per_layer * 1e-6 / (r.kv_bytes / 1e10))
    assert r.flops_ratio == pytest.approx(r.us_per_layer * 1e-6 / (r.flops / 1e11))


def test_decode_attention_benchmark_with_guesses_counts_every_row():
    """Each sequence's 1 + g rows: K and V read once per sequence (its context and guesses), flops for every row."""
    from pdserve.benchmarks.decode_attention import measure

    r = measure(2, 20, 4, 2, 32, 1, 16, torch.bfloat16, 0.0, True, 1, limits=(1e10, 1e11), guesses=3)
    assert r.kv_bytes == 2 * 2 * 23 * 2 * 32 * 2
    assert r.flops == 2 * 2 * 2 * 4 * 32 * (20 + 21 + 22 + 23)
    assert r.us_per_layer > 0


def test_grpc_stream_benchmark_receives_every_paced_message():
    from pdserve.benchmarks.grpc_stream import measure

    r = measure(streams=3, tokens_per_message=2, steps=5, step_s=0.001)  # raises unless 5 messages on each stream
    assert (r.messages, r.tokens_per_message) == (15, 2)
    assert r.server_cpu_s > 0 and r.client_cpu_s > 0 and r.wall_s > 0
    assert r.per_message_us(r.client_cpu_s) == pytest.approx(r.client_cpu_s / 15 * 1e6)
    assert r.per_step_us(r.server_cpu_s) == pytest.approx(r.server_cpu_s / 5 * 1e6)


def test_kernel_instructions_counts_the_integer_products_below_the_fp32_path(tmp_path):
    """Counted at -march=x86-64-v3 under valgrind: int8 activations against Q4_1 execute fewer instructions per
    weight byte than the fp32 path over the same blocks, at one row and at eight."""
    import shutil
    import subprocess

    from pdserve.benchmarks import kernel_instructions as ki
    from pdserve.kernels import c_build, cpu_isa

    if shutil.which("valgrind") is None or c_build._compiler()[0] is None:
        pytest.skip("needs valgrind and a C compiler")
    if cpu_isa.detected() == "portable":
        pytest.skip("an x86-64-v3 build needs an AVX2 CPU to run")
    binary = tmp_path / "kernel_instructions"
    flags = [f for f in c_build.flags(cpu_isa.MARCH["avx2"]) if f not in ("-shared", "-fPIC")]
    subprocess.run(["cc", *flags, str(ki.HARNESS), str(ki.SOURCE), "-o", str(binary), "-lm"], check=True)
    for rows in (1, 8):
        per_byte = {}
        for name in ("q4_1", "q4_1_q8"):
            one, nbytes = ki.count(binary, ki.PACKINGS[name], rows, 1)
            two, _ = ki.count(binary, ki.PACKINGS[name], rows, 2)
            assert nbytes == 2211840  # one layer of the built-in model in Q4_1
            per_byte[name] = (two - one) / nbytes
        assert 0 < per_byte["q4_1_q8"] < 0.75 * per_byte["q4_1"], (rows, per_byte)


def test_the_idle_benchmark_counts_a_thread_that_sleeps_and_wakes():
    """A thread that sleeps 10 ms at a time shows each wake-up in its own blocking switches, and `window` sums
    the threads of one name (Python 3.11 names them all after the process: "python")."""
    import os
    import threading
    import time

    from pdserve.benchmarks.idle import threads, window

    stop = threading.Event()

    def napper() -> None:
        while not stop.wait(0.01):
            pass

    t = threading.Thread(target=napper)
    t.start()
    try:
        time.sleep(0.05)
        before = threads(os.getpid())[t.native_id]
        by_name = window({"me": os.getpid()}, 0.5)["me"]
        after = threads(os.getpid())[t.native_id]
    finally:
        stop.set()
        t.join()
    assert after.switches - before.switches >= 20 and after.run_ns >= before.run_ns
    assert sum(w for w, _ in by_name.values()) >= 20, by_name


def test_linear_rows_times_each_point_on_both_builds_and_checks_they_agree(tmp_path, monkeypatch, capsys):
    """Against a copy of this checkout's kernels every point is timed on both builds (their results equal), and a
    build whose products differ is refused rather than timed."""
    import shutil
    import sys

    from pdserve.benchmarks import linear_rows
    from pdserve.kernels import c_build, quant_linear

    if c_build._compiler()[0] is None:
        pytest.skip("needs a C compiler")
    other = tmp_path / "kernels"
    shutil.copytree(quant_linear.SOURCE.parent, other, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    argv = ["linear_rows", "--rows", "1", "3", "--rounds", "1", "--against", str(other)]
    monkeypatch.setattr(sys, "argv", argv)
    linear_rows.main()
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x" in line.split("|")[1]
    ]
    assert len(rows) == 2 * len(linear_rows.SHAPES)
    assert all(float(r.split("|")[-2]) > 0 for r in rows)  # other / this
    q8 = other / "cpu_linear_q8.h"
    q8.write_text(q8.read_text().replace("d = amax / 127.0f", "d = amax / 126.0f"))  # another quantization
    with pytest.raises(SystemExit, match="the builds differ"):
        linear_rows.main()
