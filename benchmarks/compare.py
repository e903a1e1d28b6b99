"""One run, one machine: HF `generate`, pdserve colocated, pdserve disaggregated, vLLM (CPU), vLLM
disaggregated (NixlConnector) and llama.cpp (llama-cpp-python's server, the GGUF as it is), all serving
SmolLM2-135M with the same prompts and output length.

    taskset -c 0-1 python -m pdserve.benchmarks.compare --out benchmarks/results

Run it under `taskset`: every process it starts (servers and the load generator) inherits that core set.
vLLM and llama.cpp run from their own venvs (`--vllm-python`, `--llamacpp-python`; see README for the installs);
llama-cpp-python's server runs one sequence at a time, so it gets concurrency 1 only. Systems that cannot start are
reported as skipped with the reason. Writes `runs.jsonl` (every bench run), `summary.md` and `compare.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdserve.benchmarks.bench_stats import compute_metrics
from pdserve.benchmarks.load_gen import (
    GrpcTarget,
    LlamaCppTarget,
    OpenAIDisaggTarget,
    OpenAITarget,
    make_requests,
    run_load,
)

SYSTEMS = ("hf", "pdserve-colocated", "pdserve-disagg", "vllm", "vllm-disagg", "llama.cpp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout:.0f}s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def spawn(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )


@contextlib.contextmanager
def pdserve_up(
    log: Path,
    dtype: str,
    quantization: str,
    colocated: bool,
    activations: str = "q8",
    model: str = "default",
    metrics_port: int = -1,
    extra: Sequence[str] = (),
) -> Iterator[tuple[str, int]]:
    """`pdserve up` (gateway and workers, or one colocated worker behind the gateway) on free loopback ports,
    logging to `log`; yields the gateway's gRPC address and its HTTP port once it serves, and stops it all after.
    `metrics_port`: where the gateway's /metrics goes (the workers' on the ports after it); -1: none. `extra`: more
    flags of `up`."""
    port, http = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "--log-level",
        "WARNING",
        "up",
        "--model",
        model,
        "--dtype",
        dtype,
        "--quantization",
        quantization,
        "--activations",
        activations,
        "--port",
        str(port),
        "--prefill-port",
        str(free_port()),
        "--decode-port",
        str(free_port()),
        "--metrics-port",
        str(metrics_port),
        "--kv-cache-memory",
        "1G",
        "--max-num-seqs",
        "64",
        "--http-port",
        str(http),
        *extra,
    ]
    if colocated:
        argv.append("--colocated")
    proc = spawn(argv, log, {"UCX_NET_DEVICES": "lo"})
    try:
        deadline = time.monotonic() + 600
        while "serving;" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not start (see {log})")
            time.sleep(1)
        yield f"127.0.0.1:{port}", http
    finally:
        stop([proc])


async def load_target(make_target, reqs, concurrency: int, warm):
    """Targets open their channels/sessions inside the running loop, and are closed after."""
    target = make_target()
    try:
        return await run_load(target, reqs, concurrency, float("inf"), 0, warm)
    finally:
        await target.close()


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs = self.out / "runs.jsonl"
        self.skipped: dict[str, str] = {}

    def requests(self, n: int, seed: int, input_lens=None, weights=None):
        a = self.args
        return make_requests(n, input_lens or [a.input_len], a.output_len, seed, weights, vocab=(1000, 40000))

    def record(self, system: str, concurrency: int, metrics: dict, extra: dict | None = None) -> None:
        row = {
            "system": system,
            "concurrency": concurrency,
            "input_len": self.args.input_len,
            "output_len": self.args.output_len,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **(extra or {}),
            **metrics,
        }
        with self.runs.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{system:>18} c={concurrency:<3} out tok/s {metrics['output_throughput']:8.1f}  "
            f"TTFT p50 {metrics['ttft_ms']['median']:8.0f} ms  ITL p50 {metrics['itl_ms']['median']:6.1f} ms  "
            f"p99 {metrics['itl_ms']['percentiles']['p99']:6.1f} ms  failed {metrics['failed']}",
            flush=True,
        )

    def sweep(
        self,
        system: str,
        target,
        label_extra: dict | None = None,
        concurrency: list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        prompts: int = 0,
    ) -> None:
        """`prompts` picks the prompt set: a row that runs after another on the same server takes its own, or
        a server with a prefix cache would skip prefilling what it already saw and look faster than it is."""
        for c in concurrency or self.args.concurrency:
            n = self.args.c1_requests if c == 1 else self.args.num_requests
            reqs = self.requests(n, seed=c + 10_000 * prompts)
            for r in reqs:
                r.temperature, r.top_p = temperature, top_p
            warm = self.requests(2, seed=1000 + c + 10_000 * prompts)
            for w in warm:
                w.output_len = 8
            results, duration, peak = asyncio.run(load_target(target, reqs, c, warm))
            self.record(system, c, compute_metrics(results, duration, [50, 90, 99], None, peak).as_dict(), label_extra)

    def sampled(self, system: str, target) -> None:
        """The top concurrency again with temperature 0.8 and top_p 0.95: what sampling costs."""
        self.sweep(
            system + " (sampled)",
            target,
            {"sampling": "temperature 0.8, top_p 0.95"},
            [max(self.args.concurrency)],
            temperature=0.8,
            top_p=0.95,
            prompts=1,
        )

    def mixed(self, system: str, target) -> None:
        """Long and short prompts together: what disaggregation is for (decode ITL shielded from prefills)."""
        a = self.args
        reqs = make_requests(
            a.mixed_requests,
            [a.mixed_short, a.mixed_long],
            a.mixed_output,
            7,
            [1 - a.mixed_long_fraction, a.mixed_long_fraction],
            vocab=(1000, 40000),
        )
        results, duration, peak = asyncio.run(load_target(target, reqs, a.mixed_concurrency, []))
        self.record(
            system + " (mixed)",
            a.mixed_concurrency,
            compute_metrics(results, duration, [50, 90, 99], None, peak).as_dict(),
            {
                "load": f"{a.mixed_requests} req, {int(a.mixed_long_fraction * 100)}% {a.mixed_long}-token "
                f"prompts, rest {a.mixed_short}, {a.mixed_output} out"
            },
        )

    # ---- systems ---------------------------------------------------------------------------------------------

    def hf(self) -> None:
        """transformers.generate, static batches; batch 1 one request after another is the naive server."""
        import torch
        from transformers import AutoModelForCausalLM

        from pdserve.engine.model_store import resolve_model, transformers_dir

        model = AutoModelForCausalLM.from_pretrained(
            str(transformers_dir(resolve_model(None))), dtype=torch.bfloat16
        ).eval()
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        out_len = self.args.output_len
        for batch in self.args.concurrency:
            n = self.args.c1_requests if batch == 1 else self.args.num_requests
            n = max(batch, n // batch * batch) if batch > 1 else min(n, self.args.hf_c1_requests)
            prompts = [r.prompt_ids for r in self.requests(n, seed=batch)]
            model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            start = time.perf_counter()
            with torch.inference_mode():
                for i in range(0, n, batch):
                    ids = torch.tensor(prompts[i : i + batch])
                    model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=out_len,
                        min_new_tokens=out_len,
                        do_sample=False,
                        pad_token_id=0,
                    )
            elapsed = time.perf_counter() - start
            metrics = {
                "output_throughput": n * out_len / elapsed,
                "completed": n,
                "failed": 0,
                "duration_s": elapsed,
                "ttft_ms": {"median": float("nan")},
                "itl_ms": {"median": float("nan"), "percentiles": {"p99": float("nan")}},
            }
            self.record("hf-generate", batch, metrics, {"note": "static batches, no streaming"})

    def pdserve(self, colocated: bool) -> None:
        for quantization in self.args.quantization:
            self._pdserve(colocated, quantization)

    def _pdserve(self, colocated: bool, quantization: str) -> None:
        name = "pdserve-colocated" if colocated else "pdserve-disagg"
        if quantization != "none":
            name += f" ({quantization})"
        log = self.out / (name.replace(" (", "-").rstrip(")") + ".log")
        with pdserve_up(log, self.args.dtype, quantization, colocated) as (address, http):
            self.sweep(name, lambda: GrpcTarget(address))
            top = [max(self.args.concurrency)]
            self.sampled(name, lambda: GrpcTarget(address))
            if colocated:  # the same engine behind the OpenAI-compatible HTTP front door
                self.sweep(name + " (http)", lambda: OpenAITarget(f"http://127.0.0.1:{http}", ""), {}, top, prompts=2)
            if self.args.mixed_requests:
                self.mixed(name, lambda: GrpcTarget(address))

    def _vllm_env(self, bind: str) -> dict:
        return {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "TRANSFORMERS_OFFLINE": "1",
        }

    def _vllm_argv(self, port: int) -> list[str]:
        from pdserve.engine.model_store import resolve_model, transformers_dir

        return [
            self.args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(transformers_dir(resolve_model(None))),
            "--served-model-name",
            "smollm2",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    def vllm(self) -> None:
        port = free_port()
        proc = spawn(self._vllm_argv(port), self.out / "vllm.log", self._vllm_env(self.args.vllm_bind))
        try:
            wait_http(f"http://127.0.0.1:{port}/health", proc, 900)
            url = f"http://127.0.0.1:{port}"
            self.sweep("vllm", lambda: OpenAITarget(url, "smollm2"))
            self.sampled("vllm", lambda: OpenAITarget(url, "smollm2"))
        finally:
            stop([proc])

    def vllm_disagg(self) -> None:
        ports = [free_port(), free_port()]
        procs = []
        try:
            for role, port, side, bind in (
                ("kv_producer", ports[0], 5601, self.args.vllm_prefill_bind),
                ("kv_consumer", ports[1], 5602, self.args.vllm_decode_bind),
            ):
                cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})
                env = {**self._vllm_env(bind), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), "VLLM_CPU_KVCACHE_SPACE": "2"}
                procs.append(
                    spawn([*self._vllm_argv(port), "--kv-transfer-config", cfg], self.out / f"vllm-{role}.log", env)
                )
            for port, proc in zip(ports, procs):
                wait_http(f"http://127.0.0.1:{port}/health", proc, 900)
            prefill, decode = (f"http://127.0.0.1:{p}" for p in ports)
            self.sweep("vllm-disagg", lambda: OpenAIDisaggTarget(prefill, decode, "smollm2"))
        finally:
            stop(procs)

    def llamacpp(self) -> None:
        """The bundled GGUF as llama.cpp computes it (int8-quantized activations against the 4-bit weights), at
        concurrency 1: llama-cpp-python's server holds one sequence at a time. EOS is masked out by logit_bias,
        as `ignore_eos` does for the others."""
        from transformers import AutoTokenizer

        from pdserve.engine.model_store import gguf_source, resolve_model

        model = resolve_model(None)
        gguf = gguf_source(model)
        if gguf is None:
            raise RuntimeError("no GGUF behind the default model")
        port, threads = free_port(), len(os.sched_getaffinity(0))
        argv = [self.args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2"]
        argv += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        proc = spawn(argv, self.out / "llamacpp.log")
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 300)
            tokenizer = AutoTokenizer.from_pretrained(str(model))
            if tokenizer.eos_token_id is None:
                raise RuntimeError("the default model's tokenizer names no EOS token")
            eos, url = int(tokenizer.eos_token_id), f"http://127.0.0.1:{port}"
            self.sweep(
                "llama.cpp",
                lambda: LlamaCppTarget(url, "smollm2", eos, lambda ids: str(tokenizer.decode(ids))),
                {"note": "one sequence at a time; prompts as text"},
                [1],
            )
        finally:
            stop([proc])

    def run(self) -> None:
        for system in self.args.systems:
            try:
                {
                    "hf": self.hf,
                    "pdserve-colocated": lambda: self.pdserve(True),
                    "pdserve-disagg": lambda: self.pdserve(False),
                    "vllm": self.vllm,
                    "vllm-disagg": self.vllm_disagg,
                    "llama.cpp": self.llamacpp,
                }[system]()
            except Exception as e:  # noqa: BLE001 - one system failing must not lose the others' numbers
                self.skipped[system] = f"{type(e).__name__}: {e}"
                print(f"{system}: skipped: {self.skipped[system]}", flush=True)
        (self.out / "skipped.json").write_text(json.dumps(self.skipped, indent=1))


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_markdown(rows: list[dict]) -> str:
    lines = [
        "| system | concurrency | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ttft, itl = r.get("ttft_ms", {}), r.get("itl_ms", {})
        tpot = r.get("tpot_ms", {})

        def f(x):
            return "-" if x is None or x != x else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

        lines.append(
            f"| {r['system']} | {r['concurrency']} | {r['output_throughput']:.1f} | "
            f"{f(ttft.get('median'))} / {f(ttft.get('percentiles', {}).get('p99'))} | "
            f"{f(itl.get('median'))} / {f(itl.get('percentiles', {}).get('p99'))} | "
            f"{f(tpot.get('median'))} | {r.get('failed', 0)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if "(mixed)" not in s]
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {system: palette[i % len(palette)] for i, system in enumerate(systems)}
    for system in systems:
        rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        style = {"marker": "o", "label": system, "color": colors[system], "linestyle": "--" if "(" in system else "-"}
        axes[0].plot(xs, [r["output_throughput"] for r in rs], **style)
        if system != "hf-generate":  # static batches: no streaming, so no TTFT or ITL
            axes[1].plot(xs, [r["ttft_ms"]["median"] / 1000 for r in rs], **style)
            axes[2].plot(xs, [r["itl_ms"]["median"] for r in rs], **style)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (s)", "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (HF: batch size)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M (bf16 unless marked), 128-token prompts, 128 tokens out, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--c1-requests", type=int, default=16, help="requests at concurrency 1 (they run one by one)")
    ap.add_argument("--hf-c1-requests", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mixed-requests", type=int, default=40, help="0 skips the mixed long/short load")
    ap.add_argument("--mixed-concurrency", type=int, default=8)
    ap.add_argument("--mixed-short", type=int, default=64)
    ap.add_argument("--mixed-long", type=int, default=1024)
    ap.add_argument("--mixed-long-fraction", type=float, default=0.25)
    ap.add_argument("--mixed-output", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="pdserve's --dtype")
    ap.add_argument(
        "--quantization", nargs="+", default=["none"], help="pdserve's weight formats, one run each (none, gguf, ...)"
    )
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for aggregated vLLM")
    ap.add_argument("--vllm-prefill-bind", default="0")
    ap.add_argument("--vllm-decode-bind", default="1")
    ap.add_argument("--report-only", action="store_true", help="rebuild summary.md and compare.png from runs.jsonl")
    args = ap.parse_args()
    runner = Runner(args)
    if not args.report_only:
        runner.run()
    rows = load_rows(runner.runs)
    (args.out / "summary.md").write_text(summary_markdown(rows) + "\n")
    plot(rows, args.out / "compare.png")
    print(summary_markdown(rows))


if __name__ == "__main__":
    main()
