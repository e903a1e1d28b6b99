"""Running one service in this process: `pdserve gateway | prefill | decode | colocated`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cli.errors import CLIError
from pdserve.config import COMMANDS, ColocatedConfig, DecodeConfig, GatewayConfig, PrefillConfig
from pdserve.engine.speculation import MAX_SPECULATIVE_TOKENS
from pdserve.flags import from_args
from pdserve.options import EngineOptions, ObservabilityOptions, ServerOptions, TLSOptions

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pdserve.decode_service.worker import DecodeWorker
    from pdserve.engine.config import EngineConfig
    from pdserve.metrics_server import MetricsServer
    from pdserve.prefill_service.worker import PrefillWorker
    from pdserve.security import TLSConfig
    from pdserve.tracing import Tracing

log = logging.getLogger("pdserve")


def cpu_computes(dtype: str) -> bool:
    """Whether this CPU (at its PDSERVE_CPU_ISA level) has the instructions oneDNN needs to compute `dtype` fast:
    bf16 from AVX-512 BW/VL/DQ (or AMX / AVX-NE-CONVERT), fp16 from AVX-512-FP16 or AMX-FP16. Without them torch's
    half-precision matmuls ran at under 1 GFLOP/s on an AVX2-only EPYC (float32: 19)."""
    from pdserve.kernels import cpu_isa

    flags = cpu_isa.cpu_flags()
    if dtype == "bfloat16":
        return cpu_isa.level() == "avx512" or (cpu_isa.cap() is None and bool({"amx_bf16", "avx_ne_convert"} & flags))
    if dtype == "float16":
        return cpu_isa.level() == "avx512" and bool({"avx512_fp16", "amx_fp16"} & flags)
    return True


def c_kernels_run_here() -> bool:
    """Whether the engine's C kernels (cpu_linear.c and the fused bf16 decode layer) run on this CPU at speed: an
    x86 CPU at the avx2 or avx512 level, and a C compiler to build them or a prebuilt library for the level."""
    import os

    from pdserve.engine.model_store import cache_dir
    from pdserve.kernels import c_build, cpu_isa

    if cpu_isa.level() not in ("avx2", "avx512"):
        return False
    prebuilt = Path(os.environ.get(c_build.PREBUILT_ENV) or cache_dir() / "kernels" / "prebuilt")
    return c_build._compiler()[0] is not None or prebuilt.is_dir()


def model_and_dtype(model: str, dtype: str, device: str = "cpu") -> tuple[str, str]:
    """Resolve the model directory, and 'auto' to the dtype that runs fastest here (logged). On a GPU, the
    checkpoint's. On a CPU, the checkpoint's half precision where oneDNN computes it natively; else bfloat16 where
    the engine's C kernels run (their bf16 decode step reads half of fp32's bytes and, on an AVX2-only Zen 3,
    took 23 ms where fp32's took 99), else float32. Exactness against transformers needs --dtype float32."""
    import json

    from pdserve.engine.model_store import resolve_model

    path = resolve_model(model)
    if dtype != "auto":
        return str(path), dtype
    cfg = json.loads((path / "config.json").read_text())
    checkpoint = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if not (device == "cpu" or (device == "auto" and not _has_cuda())):
        log.info("--dtype auto: %s (the checkpoint's)", checkpoint)
        return str(path), checkpoint
    if checkpoint in ("bfloat16", "float16") and cpu_computes(checkpoint):
        log.info("--dtype auto: %s (the checkpoint's, which this CPU computes natively)", checkpoint)
        return str(path), checkpoint
    if c_kernels_run_here():
        log.info(
            "--dtype auto: bfloat16 (the checkpoint is %s): the engine's C kernels decode bf16 at half of fp32's "
            "bytes here; --dtype float32 keeps the fp32 product",
            checkpoint,
        )
        return str(path), "bfloat16"
    log.info("--dtype auto: float32 (the checkpoint is %s, and the C kernels do not run here)", checkpoint)
    return str(path), "float32"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cgroup_paths(proc_cgroup: Path = Path("/proc/self/cgroup")) -> dict[str, str]:
    """controller ("" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    except (OSError, ValueError):
        pass
    return paths


def _read_quota(folder: Path) -> float | None | bool:
    """The CPU quota in `folder` (v2 cpu.max, or v1 cfs files): CPUs, None for unlimited, False when not there."""
    try:
        quota, period = ((folder / "cpu.max").read_text().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return False
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time this process's cgroup may use (cgroup v2 `cpu.max`, or v1 `cfs_quota_us /
    cfs_period_us`); None when unlimited or unreadable. The process's own cgroup first (a host, or a container
    without a cgroup namespace), then the mount's root (a container sees its own cgroup there)."""
    paths = _cgroup_paths(proc_cgroup)
    folders = []
    if "" in paths:
        folders.append(root / paths[""].lstrip("/"))
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if "cpu" in paths:
            folders.append(root / mount / paths["cpu"].lstrip("/"))
    folders += [root, root / "cpu", root / "cpu,cpuacct"]
    for folder in folders:
        found = _read_quota(folder)
        if found is not False:
            return found
    return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """How many threads this process can keep busy: its CPU affinity, lowered to its cgroup's CPU quota (a
    container's `--cpus` / a pod's CPU limit), rounded up; and a line saying which bound applied. Threads beyond
    the quota only get throttled by the kernel's CFS."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(root)
    if quota is not None and math.ceil(quota) < affinity:
        return max(1, math.ceil(quota)), f"the cgroup's CPU quota of {quota:g} CPUs ({affinity} CPUs in affinity)"
    return affinity, f"{affinity} CPUs in affinity" + (f", cgroup quota {quota:g}" if quota is not None else "")


def available_memory() -> int | None:
    """Bytes this process can still get: the kernel's MemAvailable, lowered to the cgroup's limit if there is one
    (a container); None where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            text = Path(limit).read_text().strip()
            if text != "max" and int(text) < 1 << 60:
                found.append(int(text) - int(Path(usage).read_text().strip()))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def check_quantization(quantization: str, device: str, path: str, model: str, flag: str = "--quantization") -> None:
    """CLIError for weights a worker could not hold: quantized on a GPU, or `gguf` for a model not from a GGUF."""
    from pdserve.engine.model_store import gguf_source

    if quantization != "none" and device != "cpu":
        raise CLIError(f"{flag} {quantization} runs on a CPU only; with --device {device} use none")
    if quantization == "gguf" and gguf_source(Path(path)) is None:
        raise CLIError(f"{flag} gguf needs a model that is a .gguf file (or 'default'); {model!r} is not")


def engine_config(options: EngineOptions, copies: int = 1) -> EngineConfig:
    """The engine configuration the flags describe, checked before any weights load: a budget that holds no
    KV block or more than this machine has free (for `copies` workers), a bad dtype, block size or context
    length fail here, in one line."""
    from pdserve.engine.config import EngineConfig, ModelConfig, parse_dtype
    from pdserve.engine.kv_cache import plan_kv_cache

    path, dtype = model_and_dtype(options.model, options.dtype, options.device)
    try:
        layout = plan_kv_cache(
            ModelConfig.from_dir(Path(path)), parse_dtype(dtype), options.block_size, options.kv_cache_memory
        )  # the weights' format does not change a block's size
    except ValueError as e:
        raise CLIError(str(e)) from None
    check_quantization(options.quantization, options.device, path, options.model)
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(options, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= options.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise CLIError(f"--speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}]")
    check_quantization(options.speculative_draft, options.device, path, options.model, "--speculative-draft")
    if options.max_model_len is not None and options.max_model_len < 1:
        raise CLIError("--max-model-len must be >= 1 (leave it out for the model's own context length)")
    free = available_memory()
    if free is not None and options.kv_cache_memory * copies > free:
        each = f"{copies} workers x " if copies > 1 else ""
        raise CLIError(
            f"--kv-cache-memory {each}{options.kv_cache_memory / 2**30:.1f} GiB is more than the "
            f"{free / 2**30:.1f} GiB of memory free here; ask for less (e.g. --kv-cache-memory 512M)"
        )
    if layout.num_blocks < 2:
        raise CLIError(
            f"--kv-cache-memory {options.kv_cache_memory} B holds {layout.num_blocks} KV block; "
            f"need at least 2 ({layout.block_nbytes} B each)"
        )
    return EngineConfig(
        model=path,
        dtype=dtype,
        block_size=options.block_size,
        kv_cache_memory=options.kv_cache_memory,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=options.max_model_len,
        enable_prefix_caching=options.prefix_caching,
        num_threads=options.threads or _default_threads(),
        attention_backend=options.attention_backend,
        device=options.device,
        quantization=options.quantization,
        activations=options.activations,
        speculative_tokens=options.speculative_tokens,
        speculative_draft=options.speculative_draft,
    )


def _default_threads() -> int:
    threads, why = usable_cpus()
    log.info("torch threads: %d (%s; --threads overrides)", threads, why)
    return threads


def tls_config(options: TLSOptions, serving: bool = False) -> TLSConfig | None:
    """The TLS files the flags name (None when TLS is off), checked before anything starts. A service
    (`serving`) given a CA but no certificate of its own is refused: it would serve plaintext while its peers
    expect TLS."""
    from pdserve.security import TLSConfig

    tls = TLSConfig(options.tls_cert, options.tls_key, options.tls_ca, options.tls_server_name)
    try:
        tls.check()
    except ValueError as e:
        raise CLIError(str(e)) from None
    if serving and tls.ca and not tls.enabled:
        raise CLIError("--tls-ca turns TLS on: a service also needs its own --tls-cert and --tls-key")
    return tls if (tls.enabled or tls.ca) else None


def metrics_host(server: ServerOptions, observe: ObservabilityOptions, secured: bool) -> str:
    """Where /metrics binds: --metrics-host; else, for a service whose API is secured (TLS, an API key), only
    this host (plaintext, unauthenticated figures stay off the network unless asked for); else --host."""
    if observe.metrics_host:
        return observe.metrics_host
    return "127.0.0.1" if secured else server.host


def _tracing(command: str, server: ServerOptions, observe: ObservabilityOptions) -> Tracing:
    from pdserve.tracing import Tracing, TracingConfig

    config = TracingConfig(observe.otlp_endpoint, observe.otlp_protocol, observe.trace_sample_ratio)
    return Tracing(f"pdserve-{command}", config, instance=f"{server.host}:{server.port}")


def _metrics_server(
    server: ServerOptions, observe: ObservabilityOptions, registry: CollectorRegistry, secured: bool
) -> MetricsServer | None:
    from pdserve.metrics_server import MetricsServer

    if observe.metrics_port < 0:
        return None
    host = metrics_host(server, observe, secured)
    try:
        metrics = MetricsServer(registry, host, observe.metrics_port).start()
    except OSError as e:
        raise CLIError(f"cannot serve /metrics on {host}:{observe.metrics_port}: {e.strerror or e}") from None
    if secured and not observe.metrics_host:
        log.info("metrics on %s (this host only: the API is secured; --metrics-host exposes them)", metrics.url)
    else:
        log.info("metrics on %s", metrics.url)
    return metrics


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    from pdserve.grpc_server import install_uvloop

    install_uvloop()
    return asyncio.run(main())


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.grpc_server import serve_until_signal

    command = args.command
    options: PrefillConfig | DecodeConfig | ColocatedConfig = from_args(COMMANDS[command][0], args)
    cfg: PrefillConfig | DecodeConfig = options.as_decode() if isinstance(options, ColocatedConfig) else options
    engine = engine_config(cfg.engine)
    tls = tls_config(cfg.tls, serving=True)
    if cfg.engine.kv_transport == "ucx" and command != "colocated":
        from pdserve.kvtransfer.ucx_transport import restrict_to

        restrict_to(cfg.server.host, cfg.engine.kv_data_ports)

    async def main() -> int:
        tracing = _tracing(command, cfg.server, cfg.observability)
        clients = None
        worker: PrefillWorker | DecodeWorker
        if isinstance(cfg, PrefillConfig):
            from pdserve.prefill_service.server import serve as serve_prefill

            running, worker = await serve_prefill(cfg, engine, tls, tracing)
        else:
            from pdserve.decode_service.server import serve as serve_decode

            running, worker, clients = await serve_decode(cfg, engine, tls, tracing, command == "colocated")
        metrics = _metrics_server(cfg.server, cfg.observability, worker.metrics.registry, tls is not None)
        print(f"pdserve {command} ready on {cfg.server.host}:{running.port}", flush=True)

        async def stop() -> None:
            from pdserve.kvtransfer.backends import shutdown_transports

            await worker.close()  # new requests are refused by name; those in flight finish
            if isinstance(cfg, PrefillConfig):
                await running.server.stop(grace=30)
            else:
                from pdserve.decode_service.server import drain

                await drain(running, worker, cfg.drain.drain_grace)  # type: ignore[arg-type]
            await worker.stop()
            if clients is not None:
                await clients.close()
            shutdown_transports()
            if metrics is not None:
                metrics.stop()
            tracing.shutdown()

        return await serve_until_signal(stop, running.failed)

    from pdserve.kvtransfer.backends import shutdown_transports

    try:
        return _run(main)
    finally:
        shutdown_transports()  # also when start-up failed: UCX's notifier thread would keep the process alive


def cmd_gateway(args: argparse.Namespace) -> int:
    from pdserve.engine.model_store import resolve_model
    from pdserve.gateway.server import serve
    from pdserve.grpc_server import serve_until_signal

    cfg = from_args(GatewayConfig, args)
    model_dir = resolve_model(cfg.model.model)
    tls = tls_config(cfg.tls)
    if tls is not None and not tls.enabled:
        log.warning("--tls-ca without --tls-cert: calls to workers use TLS, but the public port serves plaintext")
    if not cfg.gateway.decode_addresses:
        raise CLIError("give the decode workers with --decode host:port[,host:port...] (or $PDSERVE_DECODE)")
    secured = tls is not None or bool(cfg.api_key.api_key)

    async def main() -> int:
        from pdserve.gateway.metrics import GatewayMetrics

        tracing, gateway_metrics = _tracing("gateway", cfg.server, cfg.observability), GatewayMetrics()
        running, router, request_path, http = await serve(cfg, model_dir, tls, tracing, gateway_metrics)
        metrics = _metrics_server(cfg.server, cfg.observability, gateway_metrics.registry, secured)
        print(
            f"pdserve gateway ready on {cfg.server.host}:{running.port}"
            + (f", OpenAI API on {http.url}" if http else ""),
            flush=True,
        )

        async def stop() -> None:
            if http is not None:
                await http.stop()
            await running.server.stop(grace=30)
            await router.close()
            request_path.close()
            if metrics is not None:
                metrics.stop()
            tracing.shutdown()

        return await serve_until_signal(stop, running.failed)

    return _run(main)
