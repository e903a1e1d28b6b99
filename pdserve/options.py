"""Every flag of the `pdserve` commands, declared once: one frozen dataclass of options per concern (`pdserve.flags`
makes each field a flag). The engine's defaults are `EngineConfig`'s own. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ACTIVATIONS, QUANTIZATIONS, EngineConfig
from pdserve.flags import option, parse_count, parse_port_range, parse_seconds, parse_size

_ENGINE = EngineConfig()


@dataclass(frozen=True)
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
    activations: str = option(
        _ENGINE.activations,
        "what Q8_0 and 4-bit weights multiply: q8 (activations quantized to int8 per block of 32, integer dot "
        "products, as llama.cpp computes) or exact (the activations as they are: the product of the dequantized "
        "weights)",
        choices=ACTIVATIONS,
        env=("PDSERVE_ACTIVATIONS",),
    )
    speculative_tokens: int = option(
        _ENGINE.speculative_tokens,
        "decode: guess up to this many tokens per step from the sequence's own text (prompt lookup) and check them "
        "in the same step; the output is what it would be without (0: off; a request's speculative_tokens overrides)",
        env=("PDSERVE_SPECULATIVE_TOKENS",),
    )
    speculative_draft: str = option(
        _ENGINE.speculative_draft,
        "decode: a draft model guesses where prompt lookup finds nothing: the served model again with its linears "
        "in this format (gguf: the .gguf file's own; q4_0, q8_0: quantized at load), reading the same KV cache; "
        "none: lookup only. Guesses are checked as lookup's are, so the output is the same",
        choices=("none", "gguf", "q4_0", "q8_0"),
        env=("PDSERVE_SPECULATIVE_DRAFT",),
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    http_body_timeout: float = option(
        30.0, "seconds an HTTP client may take to send a request's body before it gets 408", parse=parse_seconds
    )
    http_max_connections: int = option(
        0, "HTTP connections open at once; more are closed at once (0: half the process's file-descriptor limit)"
    )


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class LocalPrefillOptions:
    local_prefill_max_tokens: int = option(
        LOCAL_PREFILL_DEFAULT,
        "conditional disaggregation: prompts up to "
        "this many tokens are prefilled by the decode worker itself while its "
        "prefill backlog is short (0: always on a prefill worker)",
    )


@dataclass(frozen=True)
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
    threads_while_prefilling: int | None = option(
        None,
        "torch threads while a prefill worker computes prompts "
        "for this worker (default: --threads throughout); for a prefill "
        "worker on the same cores",
    )


@dataclass(frozen=True)
class PrefillWorkersOptions:
    """The prefill workers a service works with: one flag, one meaning, for the gateway and the decode workers."""

    prefill: str = option(
        "",
        "comma-separated host:port list (DNS names allowed) of the prefill workers: the gateway routes prompts to "
        "them; a decode worker dials only them (empty: any the gateway names)",
        env=("PDSERVE_PREFILL",),
    )

    @property
    def addresses(self) -> list[str]:
        return [a for a in self.prefill.split(",") if a]


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class DrainOptions:
    drain_grace: float = option(
        5.0,
        "on SIGTERM: seconds the streams in flight get to finish; the rest are handed back to the gateway, "
        "which moves them to other decode workers",
        parse=parse_seconds,
    )


@dataclass(frozen=True)
class QueueOptions:
    max_queued: int = option(256, "requests that may wait for KV blocks before RESOURCE_EXHAUSTED")


@dataclass(frozen=True)
class GatewayOptions:
    """The gateway's own flags, beyond routing, HTTP and observability."""

    decode: str = option("", "comma-separated host:port list of decode workers", env=("PDSERVE_DECODE",))
    ready_timeout: float = option(600.0, "seconds to wait for one worker of each role before serving anyway")
    poll_interval: float = option(1.0, "seconds between GetStats polls of every worker (load and health for routing)")
    idle_poll_interval: float = option(
        5.0,
        "seconds between those polls once no request came for 3 of them (an idle stack hardly wakes); the next "
        "request brings back --poll-interval at once",
    )
    discover: bool = option(
        False,
        "treat --prefill/--decode as DNS names and follow every address they resolve "
        "to (compose --scale, Kubernetes headless services)",
        env=("PDSERVE_DISCOVER",),
    )
    max_prompt_bytes: int = option(1 << 20, "refuse longer prompts before tokenizing them", parse=parse_size)

    @property
    def decode_addresses(self) -> list[str]:
        return [a for a in self.decode.split(",") if a]


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class ServerOptions:
    """Where a service listens (each command gives its own default port)."""

    host: str = option("127.0.0.1", "address this service binds")
    port: int = option(0, "its gRPC port")


@dataclass(frozen=True)
class APIKeyOptions:
    api_key: str | None = option(
        None,
        "the public API's key: a service requires it, a client sends it (gRPC metadata 'authorization: Bearer "
        "<key>', HTTP 'Authorization: Bearer <key>')",
        env=("PDSERVE_API_KEY",),
    )
    api_key_file: str | None = option(
        None, "read the API key from this file (keeps it out of `ps`)", env=("PDSERVE_API_KEY_FILE",)
    )


@dataclass(frozen=True)
class WorkerOptions:
    reflection: bool = option(False, "serve gRPC reflection (off by default: workers are internal services)")


@dataclass(frozen=True)
class TokenizerOptions:
    model: str = option(
        "default",
        "the model whose tokenizer and chat template to use ('default': SmolLM2-135M-Instruct); workers serving "
        "another model are not routed to",
        env=("PDSERVE_MODEL",),
    )
