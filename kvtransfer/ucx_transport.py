"""UCX through UCXX (the maintained successor of ucx-py, same asyncio API).

UCX chooses the wire: tcp or shared memory on one host, cuda_ipc / NVLink or RDMA on GPU hosts. Peers meet at a
*door*: a plain TCP socket this module owns, bound exactly where the receiver was told to listen. A sender connects,
both sides swap UCX worker addresses and the tag each receives on, and each opens an endpoint (error handling on) to
the other's worker address; the door connection stays open as the pair's liveness signal, and when it ends, or the
peer sends anything more on it, both endpoints are aborted (which cancels every receive posted into the cache).
UCX's own sockaddr listener is not used: it binds every interface and a peer that sends it junk leaves its socket
in CLOSE-WAIT with UCX's threads spinning. The door bounds what a stranger can cost: a handshake deadline, a size
cap, a connection cap. One UCX context per process, created on first use (after any fork: start workers with spawn).
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import socket
import struct
import sys
from collections.abc import Sequence

import numpy as np

from pdserve.kvtransfer.errors import ListenFailed, PeerDisconnected, ProtocolError
from pdserve.kvtransfer.transport import (
    MAX_CONNECTIONS,
    MAX_HEADER,
    Connection,
    Handler,
    Listener,
    Transport,
    decode_header,
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

HANDSHAKE_TIMEOUT = 5.0
_MAGIC = b"PDKV1"
_HELLO = struct.Struct("!5sQI")  # magic, the tag this side receives on, length of its UCX worker address
_MAX_ADDRESS = 64 << 10


def _ucxx():
    for k, v in _UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import ucxx

    return ucxx


def _errors():
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


_FRAME = 512  # header bytes travel in fixed-size frames, so a pre-posted frame receive always fits the next one
_FRAME_BODY = _FRAME - 4


def _frames(header: dict) -> list[np.ndarray]:
    """The first frame holds the header's length and its first bytes; longer headers continue in more frames."""
    blob = json.dumps(header).encode()
    if len(blob) > MAX_HEADER:
        raise ProtocolError(f"header of {len(blob)} bytes (at most {MAX_HEADER})")
    first = np.zeros(_FRAME, dtype=np.uint8)
    first[:4] = np.frombuffer(np.uint32(len(blob)).tobytes(), dtype=np.uint8)
    head = np.frombuffer(blob[:_FRAME_BODY], dtype=np.uint8)
    first[4 : 4 + head.size] = head
    frames = [first]
    for start in range(_FRAME_BODY, len(blob), _FRAME):
        frame = np.zeros(_FRAME, dtype=np.uint8)
        chunk = np.frombuffer(blob[start : start + _FRAME], dtype=np.uint8)
        frame[: chunk.size] = chunk
        frames.append(frame)
    return frames


class UCXConnection(Connection):
    pipelined = True  # UCX keeps the order of sends posted on one endpoint with one tag

    def __init__(self, ep, peer: str, door: asyncio.StreamWriter | None = None) -> None:
        self.ep = ep
        self.peer = peer
        self._door = door
        self._errors = _errors()
        self._next_frame: tuple[np.ndarray, asyncio.Future] | None = None
        self._watch: asyncio.Task | None = None

    async def send_header(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None:
        await self.send_headers([(header, payloads)])

    async def send_headers(self, messages: Sequence[tuple[dict, Sequence[np.ndarray]]]) -> None:
        """Post every send at once (UCX keeps per-tag order) and wait for all: no round trip per message."""
        buffers: list[np.ndarray] = []
        for header, payloads in messages:
            buffers += _frames(header)
            buffers += [p for p in payloads if p.nbytes]
        await self._all(self.ep.send(b) for b in buffers)

    async def _all(self, ops) -> None:
        tasks = [asyncio.ensure_future(op) for op in ops]
        try:
            await asyncio.gather(*tasks)
        except (*self._errors, AttributeError) as e:  # ucxx: AttributeError once the endpoint was aborted
            raise PeerDisconnected(f"UCX connection to {self.peer} failed: {e!r}") from e
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    def _post_frame(self) -> tuple[np.ndarray, asyncio.Future]:
        frame = np.empty(_FRAME, dtype=np.uint8)
        return frame, asyncio.ensure_future(self.ep.recv(frame))

    async def recv_header(self) -> dict:
        frame, fut = self._next_frame or self._post_frame()
        self._next_frame = None
        await self._all([fut])
        size = int(frame[:4].view(np.uint32)[0])
        if size > MAX_HEADER:
            raise ProtocolError(f"{self.peer} announced a {size}-byte header (at most {MAX_HEADER})")
        blob = frame[4 : 4 + min(size, _FRAME_BODY)].tobytes()
        if size > _FRAME_BODY:
            more = [np.empty(_FRAME, dtype=np.uint8) for _ in range(-(-(size - _FRAME_BODY) // _FRAME))]
            await self._all([asyncio.ensure_future(self.ep.recv(f)) for f in more])
            blob += b"".join(f.tobytes() for f in more)[: size - _FRAME_BODY]
        return decode_header(blob)

    async def recv_into(self, buffer: np.ndarray) -> None:
        await self.recv_many([buffer])

    async def recv_many(self, buffers: Sequence[np.ndarray]) -> None:
        """Post the payload receives and, behind them, the next header's, so that one is already waiting."""
        ops = [asyncio.ensure_future(self.ep.recv(b)) for b in buffers if b.nbytes]
        if self._next_frame is None:
            self._next_frame = self._post_frame()
        await self._all(ops)

    def watch_door(self, reader: asyncio.StreamReader) -> None:
        """Abort the endpoint once the door connection ends or carries anything after the handshake: every
        receive still posted is cancelled, so its waiter sees the peer gone."""

        async def watch() -> None:
            try:
                await reader.read(1)
            except OSError:
                pass
            self.abort()

        self._watch = asyncio.get_running_loop().create_task(watch())

    async def linger(self, timeout: float) -> None:
        """Wait, at most `timeout`, for the peer to close its end: the door closing aborts the peer's endpoint,
        so a side that ends the conversation (a receiver refusing a layout) lets its last message be read first."""
        if self._watch is not None:
            await asyncio.wait([self._watch], timeout=timeout)

    def abort(self) -> None:
        if not self.ep.closed:
            self.ep.abort(period=10**8)
        if self._door is not None:
            self._door.close()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._next_frame is not None:
            self._next_frame[1].cancel()
            await asyncio.gather(self._next_frame[1], return_exceptions=True)
            self._next_frame = None
        if not self.ep.closed:
            try:
                await self.ep.close()
            except self._errors:
                self.ep.abort()
        if self._door is not None:
            self._door.close()
            await asyncio.gather(self._door.wait_closed(), return_exceptions=True)


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


async def _endpoint(peer_address: bytes, send_tag: int, recv_tag: int):
    """A ucxx endpoint to a worker address that sends on the peer's tag and receives on ours."""
    ucxx = _ucxx()
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
        self._address = bytes(_ucxx().get_worker_address().tobytes())
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
                conn = UCXConnection(await _endpoint(address, tag, my_tag), peer, writer)
                writer.write(_hello(my_tag, self._address))
                await asyncio.wait_for(writer.drain(), HANDSHAKE_TIMEOUT)
            except (TimeoutError, ProtocolError, OSError, *_errors()) as e:
                self.refuse(peer, repr(e))
                return
            conn.watch_door(reader)
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
        ucxx = _ucxx()
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
            conn = UCXConnection(await _endpoint(address, tag, my_tag), f"{host}:{port}", writer)
        except BaseException as e:
            writer.close()
            if isinstance(e, ProtocolError | OSError | _errors()):
                raise PeerDisconnected(f"KV handshake with {host}:{port} failed: {e!r}") from e
            raise
        conn.watch_door(reader)
        return conn


def shutdown() -> None:
    import sys

    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()
