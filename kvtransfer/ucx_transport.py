"""UCX through UCXX (the maintained successor of ucx-py, same asyncio API).

UCX chooses the wire: tcp or shared memory on one host, cuda_ipc / NVLink or RDMA on GPU hosts. Peers meet at a
*door*: a plain TCP socket this module owns, bound exactly where the receiver was told to listen. A sender connects,
both sides swap UCX worker addresses and the tag each receives on, and each opens an endpoint (error handling on) to
the other's worker address. From then on the door carries the messages' headers and the endpoints their payloads;
the door is also the pair's liveness signal: when it ends or carries a frame that breaks the protocol, both
endpoints are aborted (which cancels every receive posted into the cache).
UCX's own sockaddr listener is not used: it binds every interface and a peer that sends it junk leaves its socket
in CLOSE-WAIT with UCX's threads spinning. The door bounds what a stranger can cost: a handshake deadline, a size
cap, a connection cap. One UCX context per process, created on first use (after any fork: start workers with spawn).
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import ipaddress
import logging
import os
import secrets
import socket
import struct
import sys
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np

from pdserve.kvtransfer.errors import ListenFailed, PeerDisconnected, ProtocolError
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

log = logging.getLogger(__name__)

# Larger TCP segments double UCX's loopback/TCP bandwidth (measured ~0.5 -> ~1.1 GB/s). Python futures completed
# by ucxx's notifier thread let a pending receive sleep; without them every pending receive busy-polls a core.
# The user's environment wins over these.
_UCX_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
}

# ucxx's progress thread arms the worker and sleeps in epoll_wait until UCX has an event or a submission signals
# it; the wait's timeout only bounds how late anything that raises no event is seen. ucxx's own 1 ms woke the
# thread 1,000 times a second with nothing to do: 3% of a core on a Sapphire Rapids VM, 36-48% on an EPYC one.
# Idle, it wakes once a second (what an empty wake-up costs varies tenfold between hosts); stopping the thread
# signals it, so shutdown does not wait for the timeout.
PROGRESS_WAIT_MS = 1000
HANDSHAKE_TIMEOUT = 5.0
_MAGIC = b"PDKV1"
_HELLO = struct.Struct("!5sQI")  # magic, the tag this side receives on, length of its UCX worker address
_MAX_ADDRESS = 64 << 10


def _ucxx() -> Any:
    for k, v in _UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import ucxx

    return ucxx


@functools.cache
def _context() -> Any:
    """ucxx with this process's UCX context made, its progress thread sleeping up to PROGRESS_WAIT_MS."""
    ucxx = _ucxx()
    ctx = ucxx.core._get_ctx()
    if ctx.progress_mode == "thread":  # started by the context with a 1 ms wait: start it again with ours
        ctx.worker.stop_progress_thread()
        ctx.worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_WAIT_MS)
    return ucxx


def _errors() -> tuple[type[BaseException], ...]:
    ucxx = _ucxx()
    return (ucxx.exceptions.UCXError, ucxx.exceptions.UCXCanceled, ucxx.exceptions.UCXCloseError)


def interface_of(host: str) -> str | None:
    """The network interface that holds `host`'s address ('lo' for loopback); None for a wildcard or an address
    no interface here holds."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host)) if host else None
    except (OSError, ValueError):
        return None
    if ip is None or ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(req[20:24]) == str(ip):
                return name
    finally:
        probe.close()
    return None


def restrict_to(host: str, port_range: str | None = None) -> None:
    """Keep this process's UCX data paths on `host`'s interface and, when given, in `port_range` ('LO-HI'). Only
    effective before UCX starts in this process; the user's own UCX_NET_DEVICES / UCX_TCP_PORT_RANGE win."""
    if "ucxx" in sys.modules and sys.modules["ucxx"].core._ctx is not None:
        log.warning("UCX already started in this process: its data paths are not restricted to %s", host)
        return
    device = interface_of(host)
    if device is not None:
        os.environ.setdefault("UCX_NET_DEVICES", device)
    if port_range:
        os.environ.setdefault("UCX_TCP_PORT_RANGE", port_range)
    log.info(
        "UCX data paths: devices %s, TCP ports %s",
        os.environ.get("UCX_NET_DEVICES", "all"),
        os.environ.get("UCX_TCP_PORT_RANGE", "any"),
    )


QUEUED_HEADERS = 64  # headers read off the door ahead of the reader; more wait in TCP (the peer's send blocks)


class UCXConnection(Connection):
    """Headers travel on the door, payloads on the UCX endpoint. A header is a few hundred bytes, and a tagged UCX
    message costs a round of ucxx's progress and notifier threads on each side (0.2-1.8 ms each way on a busy
    2-core host, against ~0.1 ms on the socket): the one-sided plane's messages are all headers. Payloads keep
    their order on one tag, and the receiver posts each one's receive after reading its header."""

    pipelined = True  # UCX keeps the order of sends posted on one endpoint with one tag; the door is a stream

    def __init__(self, ep: Any, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.ep = ep
        self.peer = peer
        self._writer = writer
        self._errors = _errors()
        self._headers: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUED_HEADERS)
        self._ended: Exception | None = None
        self._closing = False
        self._door = asyncio.get_running_loop().create_task(self._read_door(reader))

    async def _read_door(self, reader: asyncio.StreamReader) -> None:
        """Read headers off the door until it ends or breaks the protocol; then abort the endpoint, which
        cancels every receive still posted (into the cache, too), so its waiter sees the peer gone."""
        try:
            while True:
                size = header_size(await reader.readexactly(HEADER_LEN.size), self.peer)
                await self._headers.put(await reader.readexactly(size))
        except ProtocolError as e:
            self._ended = e
        except (asyncio.IncompleteReadError, OSError) as e:
            self._ended = PeerDisconnected(f"{self.peer} closed the KV connection ({e!r})")
        finally:
            if self._ended is None:
                self._ended = PeerDisconnected(f"the KV connection to {self.peer} was closed")
            if not self._closing:
                self.abort()
            if not self._headers.full():
                self._headers.put_nowait(None)  # wakes a waiting reader; a full queue has none waiting

    async def send_header(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        await self.send_headers([(header, payloads)])

    async def send_headers(self, messages: Sequence[tuple[dict, Sequence[np.ndarray]]]) -> None:
        """Write every header and post every payload send at once, in order; wait for all."""
        if self._ended is not None:
            raise PeerDisconnected(f"UCX connection to {self.peer} is closed: {self._ended}")
        heads = b"".join(frame(header) for header, _ in messages)  # all or none: a refused header writes nothing
        buffers = [p for _, payloads in messages for p in payloads if p.nbytes]
        self._writer.write(heads)
        tasks = [asyncio.ensure_future(self.ep.send(b)) for b in buffers]
        await self._all(tasks, self._writer.drain())

    async def _all(self, tasks: list[asyncio.Future], *more: Awaitable[None]) -> None:
        everything = tasks + [asyncio.ensure_future(m) for m in more]
        try:
            await asyncio.gather(*everything)
        except self._errors + (AttributeError, OSError) as e:  # ucxx: AttributeError once the endpoint was aborted
            raise PeerDisconnected(f"UCX connection to {self.peer} failed: {e!r}") from e
        finally:
            for t in everything:
                if not t.done():
                    t.cancel()

    async def recv_header(self) -> dict:
        blob = None if self._headers.empty() and self._ended is not None else await self._headers.get()
        if blob is None:
            assert self._ended is not None
            if not self._headers.full():
                self._headers.put_nowait(None)  # every later call sees the end too
            raise self._ended
        return decode_header(blob)

    async def recv_into(self, buffer: np.ndarray) -> None:
        await self.recv_many([buffer])

    async def recv_many(self, buffers: Sequence[np.ndarray]) -> None:
        await self._all([asyncio.ensure_future(self.ep.recv(b)) for b in buffers if b.nbytes])

    async def linger(self, timeout: float) -> None:
        """Wait, at most `timeout`, for the peer to close its end: the door closing aborts the peer's endpoint,
        so a side that ends the conversation (a receiver refusing a layout) lets its last message be read first."""
        await asyncio.wait([self._door], timeout=timeout)

    def abort(self) -> None:
        if not self.ep.closed:
            self.ep.abort(period=10**8)
        self._writer.close()

    async def close(self) -> None:
        self._closing = True
        self._door.cancel()
        await asyncio.gather(self._door, return_exceptions=True)
        if not self.ep.closed:
            try:
                await self.ep.close()
            except self._errors:
                self.ep.abort()
        self._writer.close()
        await asyncio.gather(self._writer.wait_closed(), return_exceptions=True)


async def _read_hello(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The peer's receive tag and UCX worker address; ProtocolError for anything else."""
    try:
        magic, tag, size = _HELLO.unpack(await reader.readexactly(_HELLO.size))
        if magic != _MAGIC or not 0 < size <= _MAX_ADDRESS:
            raise ProtocolError("not a pdserve KV peer")
        return tag, await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ProtocolError("the peer closed during the handshake") from None


def _hello(tag: int, address: bytes) -> bytes:
    return _HELLO.pack(_MAGIC, tag, len(address)) + address


async def _endpoint(peer_address: bytes, send_tag: int, recv_tag: int) -> Any:
    """A ucxx endpoint to a worker address that sends on the peer's tag and receives on ours."""
    ucxx = _context()
    ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(peer_address))
    ep._tags = {"msg_send": send_tag, "msg_recv": recv_tag}  # ucxx leaves address endpoints untagged
    return ep


def _tag() -> int:
    return secrets.randbits(64) | 1


class UCXListener(Listener):
    def __init__(self, handler: Handler, max_connections: int) -> None:
        self._handler = handler
        self._max = max_connections
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> UCXListener:
        try:
            self._server = await asyncio.start_server(self._on_door, host, port, reuse_address=True, backlog=128)
        except OSError as e:
            raise ListenFailed(f"cannot listen for KV transfers on {host}:{port}: {e.strerror or e}") from None
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        self._address = bytes(_context().get_worker_address().tobytes())
        return self

    async def _on_door(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._door(reader, writer)
        except asyncio.CancelledError:
            pass  # the listener closes; asyncio would log a cancelled connection callback as an error

    async def _door(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        host, port = writer.get_extra_info("peername")[:2]
        peer = f"{host}:{port}"
        if len(self._tasks) >= self._max:
            self.refuse(peer, f"{self._max} connections are open (the cap)")
            writer.close()
            return
        self._tasks.add(task)
        conn: UCXConnection | None = None
        try:
            try:
                tag, address = await asyncio.wait_for(_read_hello(reader), HANDSHAKE_TIMEOUT)
                my_tag = _tag()
                conn = UCXConnection(await _endpoint(address, tag, my_tag), peer, reader, writer)
                writer.write(_hello(my_tag, self._address))
                await asyncio.wait_for(writer.drain(), HANDSHAKE_TIMEOUT)
            except (TimeoutError, ProtocolError, OSError) + _errors() as e:
                self.refuse(peer, repr(e))
                return
            await self._handler(conn)
            await conn.linger(HANDSHAKE_TIMEOUT)
        finally:
            if conn is not None:
                await conn.close()
            writer.close()
            self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UCXTransport(Transport):
    name = "ucx"

    def __init__(self, max_connections: int = MAX_CONNECTIONS) -> None:
        self.max_connections = max_connections

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        return await UCXListener(handler, self.max_connections).start(host, port)

    async def connect(self, host: str, port: int, timeout: float) -> Connection:
        ucxx = _context()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except TimeoutError:
            raise
        except OSError as e:
            raise PeerDisconnected(f"cannot reach the KV receiver at {host}:{port}: {e.strerror or e}") from e
        try:
            my_tag = _tag()
            writer.write(_hello(my_tag, bytes(ucxx.get_worker_address().tobytes())))
            await asyncio.wait_for(writer.drain(), timeout)
            tag, address = await asyncio.wait_for(_read_hello(reader), timeout)
            conn = UCXConnection(await _endpoint(address, tag, my_tag), f"{host}:{port}", reader, writer)
        except BaseException as e:
            writer.close()
            if isinstance(e, ProtocolError | OSError | _errors()):
                raise PeerDisconnected(f"KV handshake with {host}:{port} failed: {e!r}") from e
            raise
        return conn


def shutdown() -> None:
    import sys

    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()
