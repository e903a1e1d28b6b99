"""What every pdserve gRPC server has: grpc.aio on uvloop, health, optional reflection, graceful stop."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from pdserve.security import TLSConfig

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 << 20
_MESSAGE_SIZES = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
KEEPALIVE_S = 10
# Between services: a peer that stops answering (a stopped or wedged process, a host gone) fails its calls after
# two keepalive periods rather than when their deadline passes; and a peer that comes back is redialled within a
# second: gRPC's default reconnect backoff grows to two minutes, so a worker down for a while took tens of seconds
# to be routed to again.
CHANNEL_OPTIONS = [
    *_MESSAGE_SIZES,
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_S * 1000),  # gRPC's own default (a minute) outlasts keepalive's
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# One port, one server: without this, gRPC's default SO_REUSEPORT lets a second server start on a busy port and
# silently take part of its traffic. The servers accept the services' keepalive pings during long calls.
SERVER_OPTIONS = [
    *_MESSAGE_SIZES,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class _Malformed:
    """What a request that does not parse deserializes to, so the handler can answer INVALID_ARGUMENT (gRPC
    itself would answer a deserializer's exception with UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class RejectMalformed(grpc.aio.ServerInterceptor):
    """Requests that are not valid protobuf (e.g. a string field holding invalid UTF-8) get INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(raw: bytes):
            try:
                return parse(raw)
            except Exception as e:  # noqa: BLE001 - whatever the parser says is the caller's input
                return _Malformed(e)

        async def refuse(request: _Malformed, context) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{details.method}: the request does not parse: {request.error}"
            )

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await inner(request, context)

            return handler._replace(request_deserializer=deserialize, unary_unary=unary)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Malformed):
                await refuse(request, context)
            result = inner_stream(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:
                await result

        return handler._replace(request_deserializer=deserialize, unary_stream=stream)


class PortInUse(OSError):
    """The address a server was told to listen on is taken (or not this machine's)."""


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _add_reflection(server: grpc.aio.Server, names: list[str]) -> None:
    """Reflection under both names clients ask for: `grpc.reflection.v1` (newer grpcurl asks it first) and
    `v1alpha`. The two protocols are the same messages under two package names, so one servicer answers both."""
    services = [*names, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = reflection.aio.ReflectionServicer(services)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                REFLECTION_V1,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    ),
                },
            )
        ]
    )


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: list[str] = field(default_factory=list)
    failed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    async def serving(self) -> None:
        """Health says SERVING, for the server as a whole and each of its services."""
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def fail(self, error: BaseException) -> None:
        """The service can no longer serve: health says NOT_SERVING at once and `failed` resolves, so the process
        shuts down instead of answering health checks while doing nothing."""
        asyncio.ensure_future(self.health.enter_graceful_shutdown())
        if not self.failed.done():
            self.failed.set_result(error)


def check_free(host: str, port: int) -> None:
    """PortInUse, naming the address, when it cannot be bound (checked before a server tries: gRPC would log a
    multi-line complaint of its own)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise PortInUse(f"cannot listen on {host}:{port}: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT does not count
        try:
            s.bind(address)
        except OSError as e:
            raise PortInUse(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def open_channel(
    address: str, tls: TLSConfig | None = None, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
) -> grpc.aio.Channel:
    """A channel to another pdserve service: TLS (presenting this service's certificate) when configured."""
    creds = tls.channel_credentials() if tls is not None else None
    if tls is None or creds is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=list(interceptors) or None)
    return grpc.aio.secure_channel(
        address, creds, options=[*CHANNEL_OPTIONS, *tls.channel_options()], interceptors=list(interceptors) or None
    )


async def start_server(
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    enable_reflection: bool = True,
    serving: bool = True,
    tls: TLSConfig | None = None,
    require_client_cert: bool = False,
) -> RunningServer:
    """Start a server with health and, unless disabled, reflection; health says SERVING at once, or (`serving`
    False) once the caller calls `serving()`. With `tls`, the port speaks TLS (and, with `require_client_cert`
    and a CA, only to callers holding a certificate it signed). Raises PortInUse, naming the address, when it
    cannot listen there."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*interceptors, RejectMalformed()])
    register(server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    if enable_reflection:
        _add_reflection(server, names)
    check_free(host, port)
    creds = tls.server_credentials(require_client_cert) if tls is not None else None
    try:
        bound = (
            server.add_secure_port(f"{host}:{port}", creds)
            if creds is not None
            else server.add_insecure_port(f"{host}:{port}")
        )
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise PortInUse(f"cannot listen on {host}:{port}: the port is in use or the address is not this machine's")
    await server.start()
    running = RunningServer(server, bound, health_servicer, names)
    if serving:
        await running.serving()
    else:
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return running


async def serve_until_signal(stop: Callable[[], Awaitable[None]], fatal: asyncio.Future | None = None) -> int:
    """Run until SIGINT/SIGTERM (exit status 0) or until `fatal` resolves (1), then call `stop` (which lets
    in-flight requests finish)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    waiters: list[asyncio.Future] = [asyncio.ensure_future(done.wait())]
    if fatal is not None:
        waiters.append(fatal)
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    failed = fatal is not None and fatal.done()
    log.info("shutting down" + (f" after a fatal error: {fatal.result()!r}" if fatal is not None and failed else ""))
    await stop()
    for w in waiters:
        if not w.done():
            w.cancel()
    return 1 if failed else 0
