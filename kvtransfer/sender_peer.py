"""One sender's connection to one receiver: a writer task that sends queued messages in order (several requests
share the connection; layer messages of one request queued together go as one), a reader task for the receiver's
acknowledgements, and the byte budget that makes a fast forward pass wait for a slow wire."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.kvtransfer.errors import PeerDisconnected, TransferError, TransferTimeout
from pdserve.kvtransfer.messages import Bye, Done, Error, Layer, Message
from pdserve.kvtransfer.registered import RegisteredCache
from pdserve.kvtransfer.transport import Connection

if TYPE_CHECKING:
    from pdserve.kvtransfer.sender import Outgoing

log = logging.getLogger(__name__)


@dataclass
class Queued:
    """One message waiting for the connection's writer, with its payloads and the budget bytes they hold."""

    message: Message
    payloads: tuple[np.ndarray, ...] = ()
    nbytes: int = 0
    ready: torch.cuda.Event | None = None  # device memory: the forward's writes are done once this has passed


class ByteBudget:
    """Bounds bytes queued but not yet sent; blocks producer threads, never the event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, block: bool) -> None:
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class Peer:
    """One connection to one receiver, its writer and reader tasks, and the requests riding on it. `on_broken`
    tells the owner once when the connection becomes unusable."""

    def __init__(
        self,
        address: str,
        conn: Connection,
        budget: ByteBudget,
        timeout: float,
        on_broken: Callable[[Peer], None],
        read_by: RegisteredCache | None = None,
    ) -> None:
        self.address = address
        self.read_by = read_by  # this cache, when the receiver reads from it (one-sided)
        self.conn = conn
        self.budget = budget
        self.timeout = timeout
        self.on_broken = on_broken
        self.requests: dict[str, Outgoing] = {}
        self.queue: asyncio.Queue[Queued | None] = asyncio.Queue()  # None: stop writing
        self.broken: TransferError | None = None
        self.writer = asyncio.create_task(self._write_loop())
        self.reader = asyncio.create_task(self._read_loop())

    def put(self, item: Queued) -> None:
        self.queue.put_nowait(item)

    async def _write_loop(self) -> None:
        """Send whatever is queued as one batch of messages, in queue order; on a pipelined transport the next
        batch is posted without waiting for the previous one to complete."""
        inflight: set[asyncio.Future] = set()
        try:
            while True:
                got = [await self.queue.get()]
                while not self.queue.empty():
                    got.append(self.queue.get_nowait())
                stop = None in got
                items = coalesce([i for i in got if i is not None])
                nbytes = sum(i.nbytes for i in items)
                if self.broken is not None or not items:
                    self.budget.release(nbytes)
                elif self.conn.pipelined and not stop:
                    task = asyncio.ensure_future(self._send(items, nbytes))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                else:
                    await asyncio.gather(*inflight)
                    await self._send(items, nbytes)
                if stop:
                    await asyncio.gather(*inflight)
                    return
        finally:
            for t in inflight:
                t.cancel()

    async def _send(self, items: list[Queued], nbytes: int) -> None:
        try:
            for i in items:
                if i.ready is not None:  # a layer is announced only once the GPU has written it
                    await asyncio.to_thread(i.ready.synchronize)
            if self.read_by is not None:
                self.read_by.announced()
            await asyncio.wait_for(self.conn.send_many([(i.message, i.payloads) for i in items]), self.timeout)
        except PeerDisconnected as e:
            self.fail(PeerDisconnected(f"sending KV to {self.address} failed: {e!r}"))
        except TimeoutError:
            self.fail(TransferTimeout(f"receiver {self.address} did not take KV for {self.timeout:.1f}s"))
        finally:
            self.budget.release(nbytes)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.conn.recv()
                req = self.requests.get(msg.req) if isinstance(msg, (Done, Error)) else None
                if req is None or req.done.done():
                    continue
                if isinstance(msg, Done):
                    now = time.perf_counter()
                    req.stats.seconds = now - (req.first or req.started)
                    req.stats.tail_seconds = now - (req.last or req.started)
                    req.done.set_result(req.stats)
                elif isinstance(msg, Error):
                    req.done.set_exception(TransferError(f"receiver refused request {req.request_id}: {msg.error}"))
        except TransferError as e:
            self.fail(e)

    def fail(self, error: TransferError) -> None:
        """The connection is unusable: fail every request on it; the owner forgets it and closes it."""
        if self.broken is not None:
            return
        self.broken = error
        log.warning("KV connection to %s failed: %s", self.address, error)
        for req in list(self.requests.values()):
            if not req.done.done():
                req.done.set_exception(error)
                req.done.exception()
        self.on_broken(self)

    async def drain(self, timeout: float) -> None:
        """Let the writer send what is queued plus a goodbye, then stop it."""
        self.put(Queued(Bye()))
        self.queue.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self.writer), timeout)
        except TimeoutError:
            pass

    async def close(self) -> None:
        for t in (self.writer, self.reader):
            t.cancel()
        await asyncio.gather(self.writer, self.reader, return_exceptions=True)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None:
                self.budget.release(item.nbytes)
        if self.read_by is not None:
            self.read_by.serving(-1)
            self.read_by = None
        await self.conn.close()


def coalesce(items: list[Queued]) -> list[Queued]:
    """Merge queued layer messages of the same request into one message (fewer round trips at the receiver)."""
    out: list[Queued] = []
    for item in items:
        prev = out[-1].message if out else None
        msg = item.message
        if isinstance(prev, Layer) and isinstance(msg, Layer) and prev.req == msg.req:
            out[-1] = Queued(
                Layer(msg.req, prev.layers + msg.layers, msg.blocks),
                out[-1].payloads + item.payloads,
                out[-1].nbytes + item.nbytes,
                item.ready or out[-1].ready,  # one stream: the later event implies the earlier
            )
        else:
            out.append(item)
    return out
