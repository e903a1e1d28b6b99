"""What every pdserve gRPC server has: grpc.aio on uvloop, health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def start_server(host: str, port: int, register: Callable[[grpc.aio.Server], None],
                       service_names: Iterable[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
                       ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Start a server with health (all services SERVING) and reflection; returns it and its bound port."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=list(interceptors) or None)
    register(server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def serve_until_signal(stop: Callable[[], Awaitable[None]]) -> None:
    """Run until SIGINT/SIGTERM, then call `stop` (which lets in-flight requests finish)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    log.info("shutting down")
    await stop()
