"""UCX through UCXX (the maintained successor of ucx-py, same asyncio API).

UCX chooses the wire: tcp or shared memory on one host, cuda_ipc / NVLink or RDMA on GPU hosts. Endpoints are
created through a listener with error handling on, so a peer that dies raises an error on this side instead of
aborting the process. One UCX context per process, created on first use (after any fork: start workers with spawn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence

import numpy as np

from pdserve.kvtransfer.errors import ListenFailed, PeerDisconnected, ProtocolError
from pdserve.kvtransfer.transport import MAX_HEADER, Connection, Handler, Listener, Transport, decode_header

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


def _ucxx():
    for k, v in _UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import ucxx

    return ucxx


def _errors():
    ucxx = _ucxx()
    return (ucxx.exceptions.UCXError, ucxx.exceptions.UCXCanceled, ucxx.exceptions.UCXCloseError)


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

    def __init__(self, ep, peer: str) -> None:
        self.ep = ep
        self.peer = peer
        self._errors = _errors()
        self._next_frame: tuple[np.ndarray, asyncio.Future] | None = None

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
        except self._errors as e:
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

    async def close(self) -> None:
        if self._next_frame is not None:
            self._next_frame[1].cancel()
            await asyncio.gather(self._next_frame[1], return_exceptions=True)
            self._next_frame = None
        if not self.ep.closed:
            try:
                await self.ep.close()
            except self._errors:
                self.ep.abort()


class UCXListener(Listener):
    def __init__(self, host: str, handler: Handler, port: int = 0) -> None:
        self.host = host
        self._handler = handler
        self._tasks: set[asyncio.Task] = set()
        ucxx = _ucxx()
        try:
            self._listener = ucxx.create_listener(self._on_endpoint, port=port or None)
        except ucxx.exceptions.UCXError as e:
            raise ListenFailed(f"cannot listen for KV transfers on port {port}: in use or not allowed ({e})") from None
        self.port = self._listener.port

    async def _on_endpoint(self, ep) -> None:
        conn = UCXConnection(ep, "ucx-peer")
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._handler(conn)
        finally:
            await conn.close()
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        self._listener.close()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UCXTransport(Transport):
    name = "ucx"

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        return UCXListener(host, handler, port)

    async def connect(self, host: str, port: int, timeout: float) -> Connection:
        ucxx = _ucxx()
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port), timeout)
        except TimeoutError:
            raise
        except Exception as e:
            raise PeerDisconnected(f"cannot open a UCX endpoint to {host}:{port}: {e!r}") from e
        return UCXConnection(ep, f"{host}:{port}")


def shutdown() -> None:
    import sys

    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()
