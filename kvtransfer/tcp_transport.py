"""Plain TCP (asyncio sockets, uvloop when installed): the measured baseline and the fallback where UCX is missing."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

import numpy as np

from pdserve.kvtransfer.errors import ListenFailed, PeerDisconnected
from pdserve.kvtransfer.transport import (
    HEADER_LEN,
    MAX_CONNECTIONS,
    Connection,
    Handler,
    Listener,
    Transport,
    decode_header,
    frame,
    header_size,
)

_SOCK_BUF = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


class TCPConnection(Connection):
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"

    async def send_header(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        head = frame(header)
        try:
            await self.loop.sock_sendall(self.sock, head)
            for p in payloads:
                await self.loop.sock_sendall(self.sock, p.data.cast("B"))
        except OSError as e:
            raise PeerDisconnected(f"send to {self.peer} failed: {e}") from e

    async def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = await self.loop.sock_recv_into(self.sock, view[got:])
            except OSError as e:
                raise PeerDisconnected(f"connection to {self.peer} failed: {e}") from e
            if n == 0:
                raise PeerDisconnected(f"{self.peer} closed the connection")
            got += n

    async def recv_header(self) -> dict:
        prefix = bytearray(HEADER_LEN.size)
        await self._fill(memoryview(prefix))
        blob = bytearray(header_size(prefix, self.peer))
        await self._fill(memoryview(blob))
        return decode_header(blob)

    async def recv_into(self, buffer: np.ndarray) -> None:
        await self._fill(buffer.data.cast("B"))

    async def close(self) -> None:
        self.sock.close()


class TCPListener(Listener):
    def __init__(self, sock: socket.socket, handler: Handler, max_connections: int = MAX_CONNECTIONS) -> None:
        self.sock = sock
        self._max = max_connections
        self.host, self.port = sock.getsockname()[:2]
        self._handler = handler
        self._tasks: set[asyncio.Task] = set()
        self._accept = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(self.sock)
            if len(self._tasks) >= self._max:
                conn.close()
                self.refuse(f"{peer[0]}:{peer[1]}", f"{self._max} connections are open (the cap)")
                continue
            _tune(conn)
            task = asyncio.create_task(self._serve(TCPConnection(conn)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: TCPConnection) -> None:
        try:
            await self._handler(conn)
        finally:
            await conn.close()

    async def close(self) -> None:
        self._accept.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(self._accept, *self._tasks, return_exceptions=True)
        self.sock.close()


class TCPTransport(Transport):
    name = "tcp"

    def __init__(self, max_connections: int = MAX_CONNECTIONS) -> None:
        self.max_connections = max_connections

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ListenFailed(f"cannot listen for KV transfers on {host}:{port}: {e.strerror or e}") from None
        sock.listen(64)
        sock.setblocking(False)
        return TCPListener(sock, handler, self.max_connections)

    async def connect(self, host: str, port: int, timeout: float) -> Connection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout)
        except BaseException:
            sock.close()
            raise
        return TCPConnection(sock)
