"""Every flag of the `pdserve` commands, declared once: one dataclass of options per concern, from which both the
parser (`add_options`) and the argument lists `pdserve up` gives its children (`to_argv`) are made, so a flag,
its default and its help text exist in one place. The engine's defaults are `EngineConfig`'s own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import QUANTIZATIONS, EngineConfig

_ENGINE = EngineConfig()


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (e.g. 512M, 2G)") from None


def parse_count(text: str) -> int:
    """'3' -> 3; a negative number or a non-number is refused by name."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative") from None
    return value


def parse_seconds(text: str) -> float:
    """'5', '0.5' -> seconds; negative or not a number is refused by name."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number of seconds") from None
    return value


def parse_port_range(text: str) -> str:
    """'20000-20099' (or one port) -> itself, checked."""
    lo, _, hi = text.strip().partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range LO-HI (1..65535)")
    return f"{low}-{high}"


def format_size(n: int) -> str:
    """536870912 -> '512M': the form parse_size reads."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def option(
    default: Any,
    help: str,
    *,
    flag: str = "",
    choices: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    parse: typing.Callable[[str], Any] | None = None,
    negate: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag. `env`: variables that override the default (the first
    one set); `negate`: a bool that is True by default and turned off by `flag` (e.g. --no-prefix-caching)."""
    meta = {"help": help, "flag": flag, "choices": choices, "env": env, "parse": parse, "negate": negate}
    return field(default=default, metadata=meta)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _kind(hint: Any) -> type:
    """A field's value type (int, float, str or bool), Optional unwrapped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_options(parser: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """A flag for every field of `cls` (`defaults` replaces a field's default for this command)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = defaults.get(f.name, f.default)
        kind = _kind(hints[f.name])
        raw = next((os.environ[name] for name in meta["env"] if os.environ.get(name)), None)
        if raw is not None:
            default = raw == "1" if kind is bool else (meta["parse"] or kind)(raw)
        help = meta["help"]
        if meta["parse"] is parse_size and isinstance(default, int):
            help += f" (default: {format_size(default)})"
        if kind is bool:
            action = "store_false" if meta["negate"] else "store_true"
            parser.add_argument(_flag(f), dest=f.name, action=action, default=default, help=help)
            continue
        parser.add_argument(
            _flag(f),
            dest=f.name,
            type=meta["parse"] or kind,
            default=default,
            choices=meta["choices"] or None,
            help=help,
        )


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The options of `cls` as the parsed flags give them."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_argv(options: Any, **values: Any) -> list[str]:
    """The flags that give a child process these options (`values` replaces some of them)."""
    argv: list[str] = []
    for f in dataclasses.fields(options):
        value = values.get(f.name, getattr(options, f.name))
        if value is None:
            continue
        if isinstance(value, bool):
            if value != f.metadata["negate"]:  # a store_true flag that is set, or a negating flag that is off
                argv.append(_flag(f))
        else:
            argv += [_flag(f), str(value)]
    return argv


# ---- what the commands share -------------------------------------------------------------------------------


@dataclass
class EngineOptions:
    """One engine (a worker process); the flags of `up`, `prefill`, `decode` and `colocated`."""

    model: str = option(
        "default", "model directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)", env=("PDSERVE_MODEL",)
    )
    dtype: str = option("auto", "auto (the checkpoint's), float32, bfloat16, float16")
    quantization: str = option(
        "none",
        "CPU weight format: none (--dtype), q8_0 or q4_0 (quantized at load), gguf (a .gguf model's own tensor "
        "types, as the file holds them); a GPU runs none",
        choices=QUANTIZATIONS,
        env=("PDSERVE_QUANTIZATION",),
    )
    block_size: int = option(_ENGINE.block_size, "tokens per KV-cache block")
    kv_cache_memory: int = option(_ENGINE.kv_cache_memory, "KV pool size per worker, e.g. 512M, 2G", parse=parse_size)
    max_num_seqs: int = option(_ENGINE.max_num_seqs, "sequences in one continuous batch at most")
    max_num_batched_tokens: int = option(
        _ENGINE.max_num_batched_tokens, "tokens in one forward step at most (long prompts are chunked to fit)"
    )
    max_model_len: int | None = option(
        _ENGINE.max_model_len, "context length limit (default: the model's), prompt plus output"
    )
    prefix_caching: bool = option(
        _ENGINE.enable_prefix_caching, "turn automatic prefix caching off", flag="--no-prefix-caching", negate=True
    )
    threads: int | None = option(
        _ENGINE.num_threads,
        "torch threads for this worker (default: up shares the cores among the workers; one worker takes them all)",
    )
    attention_backend: str = option(
        _ENGINE.attention_backend,
        "auto: flash-attn > triton > torch on a GPU, "
        "cpu > torch on a CPU, by what the machine supports (logged at start-up)",
        choices=("auto", "flash-attn", "triton", "cpu", "torch"),
    )
    device: str = option(
        _ENGINE.device,
        "cpu, cuda[:N] or auto: where the weights and the KV cache live (KV "
        "between workers is staged through host memory)",
    )
    kv_transport: str = option(
        "ucx", "how KV moves between workers", choices=("ucx", "tcp"), env=("PDSERVE_KV_TRANSPORT",)
    )
    kv_plane: str = option(
        "auto",
        "with ucx: one-sided (each cache registered once; decode reads prefill's blocks straight into its own), "
        "staged (blocks copied through messages), or auto: one-sided where NIXL can register the cache's memory "
        "(logged at start-up)",
        choices=("auto", "one-sided", "staged"),
        env=("PDSERVE_KV_PLANE",),
    )
    kv_data_ports: str | None = option(
        None,
        "TCP port range LO-HI for UCX's data paths (default: any free port; pin it where a firewall or a "
        "NetworkPolicy must allow them; each worker takes one port per network interface it uses)",
        env=("PDSERVE_KV_DATA_PORTS",),
        parse=parse_port_range,
    )


@dataclass
class ObservabilityOptions:
    metrics_port: int = option(
        9400, "HTTP port of /metrics (Prometheus); -1 turns it off (up: the gateway's; workers take the next ones)"
    )
    metrics_host: str | None = option(
        None,
        "address /metrics binds (default: --host; 127.0.0.1 when the API is secured by TLS or an API key)",
        env=("PDSERVE_METRICS_HOST",),
    )
    otlp_endpoint: str | None = option(
        None,
        "OTLP trace collector, e.g. http://127.0.0.1:4318 (default $OTEL_EXPORTER_OTLP_ENDPOINT; unset: tracing off)",
        env=("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    otlp_protocol: str = option(
        "http/protobuf",
        "OTLP wire protocol",
        choices=("http/protobuf", "grpc"),
        env=("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    )
    trace_sample_ratio: float = option(
        1.0, "fraction of requests traced (parent-based)", env=("OTEL_TRACES_SAMPLER_ARG",)
    )


@dataclass
class TLSOptions:
    tls_cert: str | None = option(
        None,
        "PEM file: this process's certificate (a service's identity, also toward "
        "the services it calls; a client's, where the server asks for one)",
        env=("PDSERVE_TLS_CERT",),
    )
    tls_key: str | None = option(None, "PEM file: its private key", env=("PDSERVE_TLS_KEY",))
    tls_ca: str | None = option(
        None,
        "PEM file: the CA that signs the services' certificates (turns TLS on for "
        "calls; workers also require callers to present a certificate it signed)",
        env=("PDSERVE_TLS_CA",),
    )
    tls_server_name: str | None = option(
        None,
        "check the certificates of the services called against this name, "
        "not the address dialled (workers found by DNS are dialled by IP)",
        env=("PDSERVE_TLS_SERVER_NAME",),
    )


@dataclass
class HTTPOptions:
    http_port: int = option(
        8000,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models); -1 turns it off",
        env=("PDSERVE_HTTP_PORT",),
    )
    http_host: str | None = option(None, "address the HTTP API binds (default: --host)")
    http_max_body: int = option(4 << 20, "larger HTTP request bodies get 413 before they are read", parse=parse_size)
    http_header_timeout: float = option(
        10.0, "seconds an HTTP client may take to send a request's headers before its connection is closed"
    )
    http_max_connections: int = option(
        0, "HTTP connections open at once; more are closed at once (0: half the process's file-descriptor limit)"
    )


@dataclass
class RoutingOptions:
    routing: str = option(
        "kv-aware",
        "kv-aware: prefill worker by prefix-cache overlap weighed against its queue; load: queue only",
        choices=("kv-aware", "load"),
    )
    overlap_weight: float = option(1.0, "kv-aware score: overlap_weight * cached blocks - queued tokens / block size")


# prompts up to this many tokens are prefilled on the decode worker: measured on CPU (docs/ARCHITECTURE.md,
# "Routing"), local prefill won below ~128-256 tokens and lost at 256 and above
LOCAL_PREFILL_DEFAULT = 128


@dataclass
class LocalPrefillOptions:
    local_prefill_max_tokens: int = option(
        LOCAL_PREFILL_DEFAULT,
        "conditional disaggregation: prompts up to "
        "this many tokens are prefilled by the decode worker itself while its "
        "prefill backlog is short (0: always on a prefill worker)",
    )


@dataclass
class DecodeOptions:
    """A decode worker's own flags, beyond the engine's."""

    kv_host: str | None = option(
        None, "address prefill workers use to reach this worker's KV receiver (default: --host)"
    )
    kv_port: int = option(
        0,
        "port of the KV receiver (0: any free port; fix it where a firewall or a Kubernetes "
        "containerPort must name it)",
    )
    prefill: str = option(
        "",
        "comma-separated host:port list (DNS names allowed) of the prefill workers this "
        "worker may dial; empty: any the gateway names",
        env=("PDSERVE_PREFILL",),
    )
    threads_while_prefilling: int | None = option(
        None,
        "torch threads while a prefill worker computes prompts "
        "for this worker (default: --threads throughout); for a prefill "
        "worker on the same cores",
    )


@dataclass
class MigrationOptions:
    """What the gateway does when a decode stream breaks after its first token."""

    migration_limit: int = option(
        3,
        "times a stream may move to another decode worker after its first token when its worker dies or "
        "drains (prompt and tokens so far are resubmitted; 0: the stream fails, naming the worker)",
        parse=parse_count,
    )
    migration_max_tokens: int = option(
        32768,
        "a stream moves only while its prompt plus the tokens generated so far, all prefilled again, fit this",
        parse=parse_count,
    )
    worker_wait: float = option(
        10.0,
        "seconds a request, or a stream handed back or broken, waits for a healthy worker (one restarting, "
        "one not yet answering) before it fails UNAVAILABLE; 0: fail at once",
        parse=parse_seconds,
    )


@dataclass
class DrainOptions:
    drain_grace: float = option(
        5.0,
        "on SIGTERM: seconds the streams in flight get to finish; the rest are handed back to the gateway, "
        "which moves them to other decode workers",
        parse=parse_seconds,
    )


@dataclass
class QueueOptions:
    max_queued: int = option(256, "requests that may wait for KV blocks before RESOURCE_EXHAUSTED")


@dataclass
class GatewayOptions:
    """The gateway's own flags, beyond routing, HTTP and observability."""

    prefill: str = option("", "comma-separated host:port list of prefill workers", env=("PDSERVE_PREFILL",))
    decode: str = option("", "comma-separated host:port list of decode workers", env=("PDSERVE_DECODE",))
    ready_timeout: float = option(600.0, "seconds to wait for one worker of each role before serving anyway")
    poll_interval: float = option(1.0, "seconds between GetStats polls of every worker (load and health for routing)")
    discover: bool = option(
        False,
        "treat --prefill/--decode as DNS names and follow every address they resolve "
        "to (compose --scale, Kubernetes headless services)",
        env=("PDSERVE_DISCOVER",),
    )
    max_prompt_bytes: int = option(1 << 20, "refuse longer prompts before tokenizing them", parse=parse_size)


@dataclass
class UpOptions:
    """What `pdserve up` starts."""

    prefill_workers: int = option(1, "prefill worker processes")
    decode_workers: int = option(1, "decode worker processes")
    colocated: bool = option(
        False, "no disaggregation: --decode-workers workers that each prefill and decode themselves"
    )
    prefill_port: int = option(50061, "first prefill worker's port (the others take the next ones)")
    decode_port: int = option(50071, "first decode worker's port (the others take the next ones)")
    prompt: str | None = option(None, "answer this prompt once the stack is up")
    exit_after_prompt: bool = option(False, "stop the stack after answering --prompt")
