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
import difflib
import os
import re
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from pdserve.cli.clients import cmd_bench, cmd_generate, cmd_health, cmd_traces
from pdserve.cli.errors import CLIError
from pdserve.cli.planning import add_plan_arguments, cmd_plan, cmd_profile
from pdserve.cli.services import cmd_gateway, cmd_worker
from pdserve.cli.up import cmd_up
from pdserve.config import COMMANDS
from pdserve.engine.config import QUANTIZATIONS
from pdserve.flags import add_config, add_options
from pdserve.kernels import cpu_isa
from pdserve.options import APIKeyOptions, EngineOptions, TLSOptions


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---- arguments -----------------------------------------------------------------------------------------------


class _Help(argparse.HelpFormatter):
    """Help text with each flag's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS, [])
        if shown and action.option_strings and "(default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistyped flag is reported by the subcommand it was meant for (its usage, not the top
    level's) with the closest flags it has, and a mistyped command with the closest commands."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = getattr(self, "commands", {}).get(getattr(ns, "command", ""), self)
            flags = [s for a in sub._actions for s in a.option_strings]
            hints = sorted(
                {
                    m
                    for e in extras
                    for m in difflib.get_close_matches(e.split("=")[0], flags, 3, 0.75)
                    if e.startswith("-")
                }
            )
            sub.error(
                f"unrecognized arguments: {' '.join(extras)}"
                + (f" (did you mean {', '.join(hints)}?)" if hints else "")
            )
        return ns

    def error(self, message: str) -> NoReturn:
        match = re.search(r"invalid choice: '([^']*)'", message)
        if match and getattr(self, "commands", None):
            hints = difflib.get_close_matches(match.group(1), list(self.commands), 3, 0.5)
            if hints:
                message += f"; did you mean {' or '.join(hints)}?"
        super().error(message)


def _logging_args(p: argparse.ArgumentParser, suppress: bool) -> None:
    """On the root parser with defaults; on every subcommand with SUPPRESS, so either position works."""
    default = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    p.add_argument(
        "--log-level", default=default(os.environ.get("PDSERVE_LOG_LEVEL", "INFO")), help="DEBUG, INFO, WARNING, ERROR"
    )
    p.add_argument(
        "--log-format",
        default=default(os.environ.get("PDSERVE_LOG_FORMAT", "text")),
        choices=["text", "json"],
        help="json: one JSON object per line (request lines carry request_id and trace_id)",
    )


def _read_api_key(args: argparse.Namespace) -> None:
    """--api-key-file into args.api_key: the key's first line, refused when empty or unreadable."""
    path = getattr(args, "api_key_file", None)
    if not path:
        return
    if getattr(args, "api_key", None) and "PDSERVE_API_KEY" not in os.environ:
        raise CLIError("give the API key once: --api-key or --api-key-file")
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise CLIError(f"--api-key-file {path}: {e.strerror or e}") from None
    if not key or "\n" in key:
        raise CLIError(f"--api-key-file {path}: the file must hold the key alone, on one line")
    args.api_key = key


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: the smallest set of tokens whose probabilities add up to this",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the request's random stream")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Disaggregated prefill/decode LLM serving", allow_abbrev=False)
    parser.commands = {}
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    _logging_args(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, allow_abbrev=False, formatter_class=_Help)
        _logging_args(p, suppress=True)
        parser.commands[name] = p
        return p

    services = {
        "up": "start gateway + prefill + decode workers on this machine (runs in the foreground)",
        "gateway": "the public gRPC API and the OpenAI-compatible HTTP API",
        "prefill": "a prefill worker",
        "decode": "a decode worker",
        "colocated": "a worker that prefills and decodes itself (no KV transfer; the gateway treats it as a "
        "decode worker and needs no --prefill)",
    }
    for name, text in services.items():
        config, defaults = COMMANDS[name]
        add_config(command(name, text), config, **defaults)

    _tool_commands(command)
    return parser


def _tool_commands(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The commands that are not services: trace viewer, load generator, health probe, profiler, planner, client."""
    tr = command("traces", "receive OTLP/HTTP traces and print each request's span tree")
    tr.add_argument("--host", default="127.0.0.1", help="address to listen on")
    tr.add_argument("--port", type=int, default=4318, help="OTLP/HTTP port")
    tr.add_argument("--quiet", type=float, default=8.0, help="print a trace once it has been quiet this long (s)")

    from pdserve.benchmarks.load_gen import add_arguments as bench_arguments

    bench = command("bench", "load-test the gateway (or any OpenAI-compatible server): vLLM's metrics")
    bench_arguments(bench)

    hc = command("health", "exit 0 when a service answers gRPC health SERVING (container healthcheck)")
    hc.add_argument(
        "--address",
        default=os.environ.get("PDSERVE_HEALTH_ADDRESS", "127.0.0.1:50051"),
        help="host:port of the service",
    )
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_options(hc, TLSOptions)

    prof = command("profile", "time this machine's prefill, decode and KV transfer steps; write a profile (JSON)")
    add_options(prof, EngineOptions)
    prof.add_argument("--out", type=Path, default=Path("profile.json"), help="where the profile goes")
    prof.add_argument("--quick", action="store_true", help="a smaller grid: prompts up to 256 tokens, batches up to 8")

    plan = command("plan", "simulate a workload on each prefill:decode split and recommend one")
    add_plan_arguments(plan)

    gen = command("generate", "stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    gen.add_argument("--local", action="store_true", help="run the engine in this process, no services")
    gen.add_argument("--model", default="default", help="with --local: the model")
    gen.add_argument("--dtype", default="auto", help="with --local: auto, float32, bfloat16, float16")
    gen.add_argument("--device", default="cpu", help="with --local: cpu, cuda[:N] or auto")
    gen.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="with --local: CPU weight format (none, q8_0, q4_0, gguf: the .gguf file's own types)",
    )
    _sampling_args(gen)
    add_options(gen, TLSOptions)
    add_options(gen, APIKeyOptions)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # first: --help and a mistyped flag answer before any service's imports

    from pdserve.engine.errors import InvalidParameter
    from pdserve.grpc_server import PortInUse
    from pdserve.kvtransfer.errors import ListenFailed
    from pdserve.logs import configure_logging

    given = sys.argv[1:] if argv is None else argv
    args.log_level_given = "PDSERVE_LOG_LEVEL" in os.environ or any(a.startswith("--log-level") for a in given)
    configure_logging(args.log_level, args.log_format, args.command)
    try:
        cpu_isa.apply_cap()  # before anything imports torch: its kernels read the cap once, at import
    except ValueError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 1

    try:
        _read_api_key(args)
    except CLIError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 1

    handlers = {
        "up": cmd_up,
        "gateway": cmd_gateway,
        "prefill": cmd_worker,
        "decode": cmd_worker,
        "colocated": cmd_worker,
        "generate": cmd_generate,
        "traces": cmd_traces,
        "health": cmd_health,
        "bench": cmd_bench,
        "profile": cmd_profile,
        "plan": cmd_plan,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (CLIError, PortInUse, ListenFailed, FileNotFoundError, InvalidParameter) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
