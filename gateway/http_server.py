"""uvicorn inside the gateway's event loop, with the guards it lacks against slow or too many clients: a cap on open
connections and a deadline for each request's head (the body's is the app's)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Iterator

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.grpc_server import PortInUse, check_free
from pdserve.options import HTTPOptions
from pdserve.security import TLSConfig

log = logging.getLogger(__name__)


def max_connections(options: HTTPOptions) -> int:
    """Connections open at once: --http-max-connections, else half of this process's file-descriptor limit."""
    if options.http_max_connections > 0:
        return options.http_max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) // 2)


class HTTPServer:
    """uvicorn serving the app inside the gateway's own event loop (its signals stay the gateway's), on
    `options.http_port` of `host`."""

    def __init__(self, app: FastAPI, host: str, options: HTTPOptions, tls: TLSConfig | None) -> None:
        port = options.http_port
        guarded = type(
            "GuardedH11",
            (_GuardedH11,),
            {"max_connections": max_connections(options), "header_timeout": options.http_header_timeout},
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=guarded,
            h11_max_incomplete_event_size=64 << 10,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=tls.cert if tls and tls.enabled else None,
            ssl_keyfile=tls.key if tls and tls.enabled else None,
            timeout_graceful_shutdown=30,
        )
        self.server = _Server(config)
        self.host, self.port = host, port
        self._task: asyncio.Task | None = None

    async def start(self) -> HTTPServer:
        check_free(self.host, self.port)
        self._task = asyncio.create_task(self.server.serve(), name="http")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise PortInUse(f"cannot listen on {self.host}:{self.port}")
            await asyncio.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.exit()
        await asyncio.gather(self._task, return_exceptions=True)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with what it lacks against slow or too many clients: a connection past the cap is
    closed at once, and one that has not sent a whole request head within `header_timeout` (at the start, or
    between requests on a kept-alive connection) is closed."""

    max_connections = 1024
    header_timeout = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            transport.abort()
            log.debug("HTTP connection refused: %d are open (the cap)", self.max_connections)
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():
            if self._head_timer is None:
                self._arm()
        else:
            self._disarm()

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the gateway's own stop it), ticking once a second (the Date header's
    resolution) instead of ten times, and leaving its loop as soon as it is told to exit."""

    TICK_S = 1.0

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()

    def exit(self) -> None:
        self.should_exit = True
        self._exit.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        ticks = 0
        while not await self.on_tick(ticks):  # a multiple of 10: every tick refreshes the Date header
            ticks = (ticks + 10) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), self.TICK_S)
