"""The `pdserve` command: run one service, the whole stack, or a client.

    pdserve up [--prompt TEXT]          gateway + prefill + decode workers on this machine
    pdserve gateway|prefill|decode      one service (what a container runs)
    pdserve generate TEXT               stream a completion from a running gateway
    pdserve generate --local TEXT       run the engine in this process instead
    pdserve bench | traces | health     load generator, trace viewer, health probe

Errors a person can act on (a missing model, a busy port, a stack that is not running) end the command with
one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from pdserve.cli.clients import cmd_bench, cmd_generate, cmd_health, cmd_traces
from pdserve.cli.errors import CLIError
from pdserve.cli.services import cmd_gateway, cmd_worker
from pdserve.cli.up import cmd_up

# prompts up to this many tokens are prefilled on the decode worker: measured on CPU (README, "Routing"), local
# prefill won below ~128-256 tokens and lost at 256 and above
LOCAL_PREFILL_DEFAULT = 128


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


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---- arguments -----------------------------------------------------------------------------------------------


def _logging_args(p: argparse.ArgumentParser, suppress: bool) -> None:
    """On the root parser with defaults; on every subcommand with SUPPRESS, so either position works."""
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    p.add_argument("--log-level", default=default(os.environ.get("PDSERVE_LOG_LEVEL", "INFO")),
                   help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", default=default(os.environ.get("PDSERVE_LOG_FORMAT", "text")),
                   choices=["text", "json"],
                   help="json: one JSON object per line (request lines carry request_id and trace_id)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="model directory, .gguf file, or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_size, default=parse_size("512M"),
                   help="KV pool size, e.g. 512M, 2G")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this worker")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flash-attn", "triton", "cpu", "torch"],
                   help="auto: flash-attn > triton > torch on a GPU, cpu > torch on a CPU, by what the "
                        "machine supports (logged at start-up)")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto: where the weights and the KV cache live "
                                                   "(KV between workers is staged through host memory)")
    p.add_argument("--kv-transport", default=os.environ.get("PDSERVE_KV_TRANSPORT", "ucx"), choices=["ucx", "tcp"])


def _observability_args(p: argparse.ArgumentParser, metrics_port: int) -> None:
    from pdserve.tracing import TracingConfig

    env = TracingConfig.from_env()
    p.add_argument("--metrics-port", type=int, default=metrics_port,
                   help="HTTP port of /metrics (Prometheus); -1 turns it off" +
                        (" (up: the gateway's; workers take the next ones)" if metrics_port == 9400 else ""))
    p.add_argument("--metrics-host", default=None, help="address /metrics binds (default: --host)")
    p.add_argument("--otlp-endpoint", default=env.endpoint,
                   help="OTLP trace collector, e.g. http://127.0.0.1:4318 (default $OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "unset: tracing off)")
    p.add_argument("--otlp-protocol", default=env.protocol, choices=["http/protobuf", "grpc"])
    p.add_argument("--trace-sample-ratio", type=float, default=env.sample_ratio,
                   help="fraction of requests traced (parent-based)")


def _tls_args(p: argparse.ArgumentParser, role: str) -> None:
    what = {"server": "this service's certificate (server identity, and client identity toward other services)",
            "client": "a client certificate, where the server asks for one"}[role]
    p.add_argument("--tls-cert", default=os.environ.get("PDSERVE_TLS_CERT"), help=f"PEM file: {what}")
    p.add_argument("--tls-key", default=os.environ.get("PDSERVE_TLS_KEY"), help="PEM file: its private key")
    p.add_argument("--tls-ca", default=os.environ.get("PDSERVE_TLS_CA"),
                   help="PEM file: the CA that signs the services' certificates (verifies the servers called; "
                        "workers also require callers to present a certificate it signed)" if role == "server" else
                   "PEM file: the CA to verify the server with (turns TLS on)")
    p.add_argument("--tls-server-name", default=os.environ.get("PDSERVE_TLS_SERVER_NAME"),
                   help="check the certificates of the services called against this name, not the address "
                        "dialled (workers found by DNS are dialled by IP)")


def _local_prefill_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-prefill-max-tokens", type=int, default=LOCAL_PREFILL_DEFAULT,
                   help="conditional disaggregation: prompts up to this many tokens are prefilled by the decode "
                        "worker itself while its prefill backlog is short (0: always on a prefill worker)")


def _routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", default="kv-aware", choices=["kv-aware", "load"],
                   help="kv-aware: prefill worker by prefix-cache overlap weighed against its queue; load: queue only")
    p.add_argument("--overlap-weight", type=float, default=1.0,
                   help="kv-aware score: overlap_weight * cached blocks - queued tokens / block size")


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-port", type=int, default=int(os.environ.get("PDSERVE_HTTP_PORT", "8000")),
                   help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                        "/v1/models); -1 turns it off")
    p.add_argument("--http-host", default=None, help="address the HTTP API binds (default: --host)")


def _api_key_arg(p: argparse.ArgumentParser, server: bool) -> None:
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require this key on the public API (gRPC metadata 'authorization: Bearer <key>', HTTP "
                        "'Authorization: Bearer <key>'); default $PDSERVE_API_KEY" if server else
                   "send this API key (default $PDSERVE_API_KEY)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    _logging_args(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, allow_abbrev=False)
        _logging_args(p, suppress=True)
        return p

    up = command("up", "start gateway + prefill + decode workers on this machine (runs in the foreground)")
    _engine_args(up)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="the gateway's gRPC port")
    up.add_argument("--prefill-workers", type=int, default=1)
    up.add_argument("--decode-workers", type=int, default=1)
    up.add_argument("--colocated", action="store_true",
                    help="no disaggregation: --decode-workers workers that each prefill and decode themselves")
    up.add_argument("--prefill-port", type=int, default=50061, help="first prefill worker port")
    up.add_argument("--decode-port", type=int, default=50071, help="first decode worker port")
    up.add_argument("--prompt", default=None, help="answer this prompt once the stack is up")
    up.add_argument("--exit-after-prompt", action="store_true", help="stop the stack after answering --prompt")
    _observability_args(up, 9400)
    _tls_args(up, "server")
    _api_key_arg(up, server=True)
    _http_args(up)
    _routing_args(up)
    _local_prefill_arg(up)

    gw = command("gateway", "the public gRPC API")
    gw.add_argument("--model", default="default")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=50051)
    gw.add_argument("--prefill", default=os.environ.get("PDSERVE_PREFILL", ""),
                    help="comma-separated host:port list of prefill workers")
    gw.add_argument("--decode", default=os.environ.get("PDSERVE_DECODE", ""),
                    help="comma-separated host:port list of decode workers")
    gw.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for one worker of each role before serving anyway")
    gw.add_argument("--poll-interval", type=float, default=1.0,
                    help="seconds between GetStats polls of every worker (load and health for routing)")
    gw.add_argument("--discover", action="store_true", default=os.environ.get("PDSERVE_DISCOVER") == "1",
                    help="treat --prefill/--decode as DNS names and follow every address they resolve to "
                         "(compose --scale, Kubernetes headless services)")
    gw.add_argument("--max-prompt-bytes", type=parse_size, default=parse_size("1M"),
                    help="refuse longer prompts before tokenizing them")
    _routing_args(gw)
    _http_args(gw)
    _observability_args(gw, 9400)
    _tls_args(gw, "server")
    _api_key_arg(gw, server=True)

    roles = {"prefill": "a prefill worker", "decode": "a decode worker",
             "colocated": "a worker that prefills and decodes itself (no KV transfer; the gateway treats it as a "
                          "decode worker and needs no --prefill)"}
    for role, text in roles.items():
        w = command(role, text)
        _engine_args(w)
        w.add_argument("--host", default="127.0.0.1")
        w.add_argument("--port", type=int, default=50061 if role == "prefill" else 50071)
        w.add_argument("--reflection", action="store_true",
                       help="serve gRPC reflection (off by default: workers are internal services)")
        _observability_args(w, 9401 if role == "prefill" else 9402)
        _tls_args(w, "server")
        if role == "decode":
            w.add_argument("--kv-host", default=None,
                           help="address prefill workers use to reach this worker's KV receiver (default: --host)")
            w.add_argument("--kv-port", type=int, default=0,
                           help="port of the KV receiver (0: any free port; fix it where a firewall or a "
                                "Kubernetes containerPort must name it)")
            w.add_argument("--prefill", default=os.environ.get("PDSERVE_PREFILL", ""),
                           help="comma-separated host:port list (DNS names allowed) of the prefill workers this "
                                "worker may dial; empty: any the gateway names")
            _local_prefill_arg(w)
            w.add_argument("--threads-while-prefilling", type=int, default=None,
                           help="torch threads while a prefill worker computes prompts for this worker (default: "
                                "--threads throughout); for a prefill worker on the same cores")
        if role != "prefill":
            w.add_argument("--max-queued", type=int, default=256,
                           help="requests that may wait for KV blocks before RESOURCE_EXHAUSTED")

    tr = command("traces", "receive OTLP/HTTP traces and print each request's span tree")
    tr.add_argument("--host", default="127.0.0.1")
    tr.add_argument("--port", type=int, default=4318)
    tr.add_argument("--quiet", type=float, default=8.0, help="print a trace once it has been quiet this long (s)")

    from pdserve.benchmarks.load_gen import add_arguments as bench_arguments

    bench = command("bench", "load-test the gateway (or any OpenAI-compatible server): vLLM's metrics")
    bench_arguments(bench)

    hc = command("health", "exit 0 when a service answers gRPC health SERVING (container healthcheck)")
    hc.add_argument("--address", default=os.environ.get("PDSERVE_HEALTH_ADDRESS", "127.0.0.1:50051"))
    hc.add_argument("--timeout", type=float, default=3.0)
    _tls_args(hc, "client")

    gen = command("generate", "stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    gen.add_argument("--local", action="store_true", help="run the engine in this process, no services")
    gen.add_argument("--model", default="default")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="cpu", help="with --local: cpu, cuda[:N] or auto")
    _sampling_args(gen)
    _tls_args(gen, "client")
    _api_key_arg(gen, server=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve.kvtransfer.errors import ListenFailed
    from pdserve.grpc_server import PortInUse
    from pdserve.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, args.command)

    handlers = {"up": cmd_up, "gateway": cmd_gateway, "prefill": cmd_worker, "decode": cmd_worker,
                "colocated": cmd_worker, "generate": cmd_generate, "traces": cmd_traces, "health": cmd_health,
                "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (CLIError, PortInUse, ListenFailed, FileNotFoundError) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
