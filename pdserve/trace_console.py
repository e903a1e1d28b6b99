"""`pdserve traces`: a tiny OTLP/HTTP trace receiver that prints each request's span tree, for a trace view
without Docker or a browser (Jaeger and Phoenix are the graphical ones). The tests use the same receiver to
check what the services export.
"""

from __future__ import annotations

import gzip
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto


@dataclass
class ReceivedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list[tuple[int, str, dict]] = field(default_factory=list)  # (time ns, name, attributes)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OTLPReceiver:
    """Accepts OTLP/HTTP protobuf exports on host:port (0: any free port) and keeps every span."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, on_spans=None) -> None:
        self.spans: list[ReceivedSpan] = []
        self.on_spans = on_spans
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            s.name,
                            service,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            SpanProto.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                            [
                                (e.time_unix_nano, e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events
                            ],
                        )
                    )
        with self._lock:
            self.spans.extend(spans)
        if self.on_spans:
            self.on_spans(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def forget(self, trace_ids: set[str]) -> None:
        with self._lock:
            self.spans = [s for s in self.spans if s.trace_id not in trace_ids]

    def wait_for(self, predicate, timeout: float = 30.0) -> list[ReceivedSpan]:
        """Poll (bounded) until predicate(spans) is true; returns the spans."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans not complete after {timeout}s: {sorted(s.name for s in spans)}")
            time.sleep(0.2)


def format_tree(spans: list[ReceivedSpan]) -> str:
    """One trace as an indented tree: offset from the root's start, duration, service, name, key attributes."""
    if not spans:
        return ""
    children: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    t0 = min(s.start_ns for s in spans)
    lines = [f"trace {spans[0].trace_id}"]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            attrs = " ".join(
                f"{k.split('.', 1)[-1]}={_short(v)}"
                for k, v in s.attributes.items()
                if k.startswith(("pdserve.", "kv.")) and k != "pdserve.request_id"
            )
            lines.append(
                f"{(s.start_ns - t0) / 1e6:9.1f} ms {(s.end_ns - s.start_ns) / 1e6:9.1f} ms  "
                f"{'  ' * depth}{s.name} [{s.service}] {attrs}".rstrip()
            )
            for at, name, attributes in s.events:
                fields = " ".join(f"{k.split('.', 1)[-1]}={_short(v)}" for k, v in attributes.items())
                lines.append(f"{(at - t0) / 1e6:9.1f} ms {'':>12} {'  ' * (depth + 1)}* {name} {fields}".rstrip())
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


class TraceConsole:
    """Prints a trace once no span of it has arrived for `quiet` seconds (spans of one trace come in batches
    from several processes)."""

    def __init__(self, quiet: float = 8.0, out=None) -> None:
        import sys

        self.quiet = quiet
        self.out = out or sys.stdout
        self._pending: dict[str, float] = {}
        self._lock = threading.Lock()

    def seen(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            for s in spans:
                self._pending[s.trace_id] = time.monotonic()

    def flush_ready(self, receiver: OTLPReceiver, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            ready = [t for t, last in self._pending.items() if force or now - last >= self.quiet]
            for t in ready:
                del self._pending[t]
        for t in ready:
            print(format_tree(receiver.trace(t)) + "\n", file=self.out, flush=True)
        if ready:  # printed traces are not kept: a long-running console does not grow
            receiver.forget(set(ready))


def serve_console(host: str, port: int, quiet: float = 8.0) -> None:
    """Run until Ctrl-C or SIGTERM, printing each finished trace. SIGTERM gets a handler of its own: as a
    container's PID 1 (compose, k8s) the kernel drops signals whose disposition is the default, so `docker stop`
    would otherwise wait out its grace period and kill."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    console = TraceConsole(quiet)
    with OTLPReceiver(host, port, on_spans=console.seen) as receiver:
        print(
            f"OTLP/HTTP traces on {receiver.endpoint} (point services at it with --otlp-endpoint); Ctrl-C stops",
            flush=True,
        )
        try:
            while not stop.wait(0.5):
                console.flush_ready(receiver)
        except KeyboardInterrupt:
            pass
        console.flush_ready(receiver, force=True)
