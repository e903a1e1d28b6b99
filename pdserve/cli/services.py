"""Running one service in this process: `pdserve gateway | prefill | decode | colocated`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cli.errors import CLIError
from pdserve.cli.options import DecodeOptions, EngineOptions, LocalPrefillOptions, QueueOptions, from_args

if TYPE_CHECKING:
    from pdserve.decode_service.worker import DecodeWorker
    from pdserve.engine.config import EngineConfig
    from pdserve.prefill_service.worker import PrefillWorker

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


def model_and_dtype(model: str, dtype: str, device: str = "cpu") -> tuple[str, str]:
    """Resolve the model directory, and 'auto' to the dtype its checkpoint was saved in, lowered to float32 on a CPU
    that does not compute that half precision well (logged): the default must run well on any CPU."""
    import json

    from pdserve.engine.model_store import resolve_model

    path = resolve_model(model)
    if dtype == "auto":
        cfg = json.loads((path / "config.json").read_text())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        on_cpu = device == "cpu" or (device == "auto" and not _has_cuda())
        if on_cpu and not cpu_computes(dtype):
            log.info("--dtype auto: the checkpoint is %s, which this CPU does not compute well: float32", dtype)
            dtype = "float32"
        else:
            log.info("--dtype auto: %s (the checkpoint's)", dtype)
    return str(path), dtype


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


def check_quantization(quantization: str, device: str, path: str, model: str) -> None:
    """CLIError for weights a worker could not hold: quantized on a GPU, or `gguf` for a model not from a GGUF."""
    from pdserve.engine.model_store import gguf_source

    if quantization != "none" and device != "cpu":
        raise CLIError(f"--quantization {quantization} runs on a CPU only; with --device {device} use none")
    if quantization == "gguf" and gguf_source(Path(path)) is None:
        raise CLIError(f"--quantization gguf needs a model that is a .gguf file (or 'default'); {model!r} is not")


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
    )


def _default_threads() -> int:
    threads, why = usable_cpus()
    log.info("torch threads: %d (%s; --threads overrides)", threads, why)
    return threads


def routable(host: str) -> str:
    """An address other hosts can reach: a wildcard bind address becomes this host's own address (its name's, or
    else the address of the interface its default route uses)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks the route
                address = s.getsockname()[0]
            except OSError:
                address = "127.0.0.1"
        log.warning("host name %s does not resolve (%s); advertising %s", socket.gethostname(), e, address)
        return address


def tls_config(args: argparse.Namespace, serving: bool = False):
    """The TLS files the flags name (None when TLS is off), checked before anything starts. A service
    (`serving`) given a CA but no certificate of its own is refused: it would serve plaintext while its peers
    expect TLS."""
    from pdserve.security import TLSConfig

    tls = TLSConfig(
        getattr(args, "tls_cert", None),
        getattr(args, "tls_key", None),
        getattr(args, "tls_ca", None),
        getattr(args, "tls_server_name", None),
    )
    try:
        tls.check()
    except ValueError as e:
        raise CLIError(str(e)) from None
    if serving and tls.ca and not tls.enabled:
        raise CLIError("--tls-ca turns TLS on: a service also needs its own --tls-cert and --tls-key")
    return tls if (tls.enabled or tls.ca) else None


def metrics_host(args: argparse.Namespace, secured: bool) -> str:
    """Where /metrics binds: --metrics-host; else, for a service whose API is secured (TLS, an API key), only
    this host (plaintext, unauthenticated figures stay off the network unless asked for); else --host."""
    if args.metrics_host:
        return args.metrics_host
    return "127.0.0.1" if secured else args.host


def _tracing(args: argparse.Namespace):
    from pdserve.tracing import Tracing, TracingConfig

    config = TracingConfig(args.otlp_endpoint, args.otlp_protocol, args.trace_sample_ratio)
    return Tracing(f"pdserve-{args.command}", config, instance=f"{args.host}:{args.port}")


def _metrics_server(args: argparse.Namespace, registry, secured: bool):
    from pdserve.metrics_server import MetricsServer

    if args.metrics_port < 0:
        return None
    host = metrics_host(args, secured)
    try:
        server = MetricsServer(registry, host, args.metrics_port).start()
    except OSError as e:
        raise CLIError(f"cannot serve /metrics on {host}:{args.metrics_port}: {e.strerror or e}") from None
    if secured and not args.metrics_host:
        log.info("metrics on %s (this host only: the API is secured; --metrics-host exposes them)", server.url)
    else:
        log.info("metrics on %s", server.url)
    return server


def _run(main) -> int:
    from pdserve.grpc_server import install_uvloop

    install_uvloop()
    return asyncio.run(main())


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.grpc_server import serve_until_signal

    engine = from_args(EngineOptions, args)
    cfg = engine_config(engine)
    tls = tls_config(args, serving=True)
    if engine.kv_transport == "ucx" and args.command != "colocated":
        from pdserve.kvtransfer.ucx_transport import restrict_to

        restrict_to(args.host, engine.kv_data_ports)

    async def main() -> int:
        tracing = _tracing(args)
        clients = None
        worker: PrefillWorker | DecodeWorker
        if args.command == "prefill":
            from pdserve.prefill_service.server import serve as serve_prefill

            running, worker = await serve_prefill(
                cfg,
                args.host,
                args.port,
                args.kv_transport,
                tracing=tracing,
                reflection=args.reflection,
                tls=tls,
                kv_plane=engine.kv_plane,
            )
        else:
            from pdserve.decode_service.server import serve as serve_decode

            colocated = args.command == "colocated"
            decode = DecodeOptions() if colocated else from_args(DecodeOptions, args)
            local = LocalPrefillOptions(0) if colocated else from_args(LocalPrefillOptions, args)
            running, worker, clients = await serve_decode(
                cfg,
                args.host,
                args.port,
                args.kv_transport,
                "" if colocated else routable(decode.kv_host or args.host),
                kv_port=decode.kv_port,
                kv_bind=args.host,
                max_queued=from_args(QueueOptions, args).max_queued,
                tracing=tracing,
                colocated=colocated,
                reflection=args.reflection,
                tls=tls,
                allowed_prefill=[a for a in decode.prefill.split(",") if a],
                local_prefill_max_tokens=local.local_prefill_max_tokens,
                threads_while_prefilling=decode.threads_while_prefilling,
                kv_plane=engine.kv_plane,
            )
        metrics = _metrics_server(args, worker.metrics.registry, tls is not None)
        print(f"pdserve {args.command} ready on {args.host}:{running.port}", flush=True)

        async def stop() -> None:
            from pdserve.kvtransfer.backends import shutdown_transports

            await worker.close()  # new requests are refused by name; those in flight finish
            if args.command == "prefill":
                await running.server.stop(grace=30)
            else:
                from pdserve.decode_service.server import drain

                await drain(running, worker, args.drain_grace)  # type: ignore[arg-type]
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
    from pdserve.gateway.openai_api import HTTPLimits
    from pdserve.gateway.server import serve
    from pdserve.grpc_server import serve_until_signal

    path = resolve_model(args.model)
    tls = tls_config(args)
    if tls is not None and not tls.enabled:
        log.warning("--tls-ca without --tls-cert: calls to workers use TLS, but the public port serves plaintext")
    prefill = [a for a in args.prefill.split(",") if a]
    decode = [a for a in args.decode.split(",") if a]
    if not decode:
        raise CLIError("give the decode workers with --decode host:port[,host:port...] (or $PDSERVE_DECODE)")

    async def main() -> int:
        from pdserve.gateway.metrics import GatewayMetrics

        tracing, gateway_metrics = _tracing(args), GatewayMetrics()
        running, router, request_path, http = await serve(
            path,
            args.host,
            args.port,
            prefill,
            decode,
            args.ready_timeout,
            tracing=tracing,
            metrics=gateway_metrics,
            discover=args.discover,
            poll_interval=args.poll_interval,
            tls=tls,
            api_key=args.api_key,
            max_prompt_bytes=args.max_prompt_bytes,
            http_host=args.http_host,
            http_limits=HTTPLimits(args.http_max_body, args.http_header_timeout, 30.0, args.http_max_connections),
            http_port=args.http_port,
            kv_aware=args.routing == "kv-aware",
            overlap_weight=args.overlap_weight,
            migration_limit=args.migration_limit,
            migration_max_tokens=args.migration_max_tokens,
            worker_wait=args.worker_wait,
        )
        metrics = _metrics_server(args, gateway_metrics.registry, tls is not None or bool(args.api_key))
        print(
            f"pdserve gateway ready on {args.host}:{running.port}" + (f", OpenAI API on {http.url}" if http else ""),
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
