"""The prefill side: pushes one request's KV to a receiver layer by layer, while the forward pass goes on.

`begin` opens (or reuses) the one connection to that receiver — a handshake checks the layout fingerprint
first — and registers the request. `send_layer` is called from the forward pass's thread as soon as layer l
is written: it snapshots the layer's blocks (a view when they are one contiguous run, else a packed copy) and
queues one message. A single writer task per connection sends queued messages in order, so several requests
share the connection; in-flight bytes are bounded, which makes a fast forward wait for a slow wire.
`finish` waits for the receiver's acknowledgement that every layer landed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.kernels.cache_ops import gather_blocks
from pdserve.kernels.kv_layout import KVLayout, LayoutMismatch
from pdserve.kvtransfer.errors import PeerDisconnected, TransferCancelled, TransferError, TransferTimeout
from pdserve.kvtransfer.receiver import contiguous_run
from pdserve.kvtransfer.stats import StatsHook, TransferStats
from pdserve.kvtransfer.transport import Connection, Transport, as_bytes, parse_address, to_host

log = logging.getLogger(__name__)


@dataclass
class _Outgoing:
    request_id: str
    peer: "_Peer"
    src_block_ids: list[int]
    dst_block_ids: list[int]
    src_run: tuple[int, int] | None
    done: asyncio.Future
    stats: TransferStats
    started: float = field(default_factory=time.perf_counter)


class _ByteBudget:
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


class _Peer:
    """One connection to one receiver, its writer and reader tasks, and the requests riding on it."""

    def __init__(self, address: str, conn: Connection, sender: "KVSender") -> None:
        self.address = address
        self.conn = conn
        self.sender = sender
        self.requests: dict[str, _Outgoing] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.broken: TransferError | None = None
        self.writer = asyncio.create_task(self._write_loop())
        self.reader = asyncio.create_task(self._read_loop())

    async def _write_loop(self) -> None:
        """Send whatever is queued as one batch of messages, in queue order; on a pipelined transport the next
        batch is posted without waiting for the previous one to complete."""
        inflight: set[asyncio.Task] = set()
        try:
            while True:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                stop = None in items
                items = _coalesce([i for i in items if i is not None])
                nbytes = sum(n for _, _, n in items)
                if self.broken is not None or not items:
                    self.sender._budget.release(nbytes)
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

    async def _send(self, items: list, nbytes: int) -> None:
        try:
            await asyncio.wait_for(self.conn.send_many([(h, p) for h, p, _ in items]), self.sender.timeout)
        except (PeerDisconnected, asyncio.TimeoutError) as e:
            self.fail(PeerDisconnected(f"sending KV to {self.address} failed: {e!r}")
                      if isinstance(e, PeerDisconnected) else
                      TransferTimeout(f"receiver {self.address} did not take KV for {self.sender.timeout:.1f}s"))
        finally:
            self.sender._budget.release(nbytes)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.conn.recv_header()
                req = self.requests.get(msg.get("req", ""))
                if req is None or req.done.done():
                    continue
                if msg["type"] == "done":
                    req.stats.seconds = time.perf_counter() - req.started
                    req.done.set_result(req.stats)
                elif msg["type"] == "error":
                    req.done.set_exception(TransferError(f"receiver refused request {req.request_id}: {msg['error']}"))
        except PeerDisconnected as e:
            self.fail(e)

    def fail(self, error: TransferError) -> None:
        """The connection is unusable: fail every request on it and forget it."""
        if self.broken is None:
            self.broken = error
            log.warning("KV connection to %s failed: %s", self.address, error)
        for req in list(self.requests.values()):
            if not req.done.done():
                req.done.set_exception(error)
                req.done.exception()
        if self.sender._peers.get(self.address) is self:
            del self.sender._peers[self.address]
        task = asyncio.ensure_future(self.close())
        self.sender._closing.add(task)
        task.add_done_callback(self.sender._closing.discard)

    async def drain(self, timeout: float) -> None:
        """Let the writer send what is queued plus a goodbye, then stop it."""
        self.queue.put_nowait(({"type": "bye"}, (), 0))
        self.queue.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self.writer), timeout)
        except asyncio.TimeoutError:
            pass

    async def close(self) -> None:
        for t in (self.writer, self.reader):
            t.cancel()
        await asyncio.gather(self.writer, self.reader, return_exceptions=True)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None:
                self.sender._budget.release(item[2])
        await self.conn.close()


def _coalesce(items: list) -> list:
    """Merge queued layer messages of the same request into one message (fewer round trips at the receiver)."""
    out: list = []
    for header, payloads, nbytes in items:
        prev = out[-1][0] if out else None
        if prev is not None and header["type"] == "layer" and prev["type"] == "layer" and prev["req"] == header["req"]:
            prev["layers"] = prev["layers"] + header["layers"]
            out[-1] = (prev, out[-1][1] + payloads, out[-1][2] + nbytes)
        else:
            out.append((dict(header), tuple(payloads), nbytes))
    return out


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, transport: Transport, timeout: float = 30.0,
                 max_inflight_bytes: int = 256 << 20, on_complete: StatsHook | None = None) -> None:
        self.cache = kv_cache
        self.layout = layout
        self.transport = transport
        self.timeout = timeout
        self.on_complete = on_complete
        self._budget = _ByteBudget(max_inflight_bytes)
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._requests: dict[str, _Outgoing] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Future] = set()

    def connected(self, address: str) -> bool:
        return address in self._peers

    async def connect(self, address: str) -> None:
        """Open the connection to the receiver at `address` (handshake included) unless it is open already."""
        if address in self._peers:
            return
        await self._peer(address)

    async def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            if address in self._peers:
                return self._peers[address]
            scheme, host, port = parse_address(address)
            if scheme != self.transport.name:
                raise TransferError(f"address {address} needs transport {scheme!r}, this sender has "
                                    f"{self.transport.name!r}")
            try:
                conn = await self.transport.connect(host, port, self.timeout)
            except (OSError, asyncio.TimeoutError, PeerDisconnected) as e:
                raise PeerDisconnected(f"cannot connect to KV receiver {address}: {e!r}") from e
            try:
                await asyncio.wait_for(conn.send({"type": "hello", "layout": self.layout.to_dict()}), self.timeout)
                reply = await asyncio.wait_for(conn.recv_header(), self.timeout)
            except asyncio.TimeoutError:
                await conn.close()
                raise TransferTimeout(f"KV receiver {address} did not answer the handshake in {self.timeout:.1f}s")
            except BaseException:
                await conn.close()
                raise
            if reply.get("type") != "hello_ok":
                await conn.close()
                raise LayoutMismatch(f"KV receiver {address} refused this sender: {reply.get('error')}")
            peer = _Peer(address, conn, self)
            self._peers[address] = peer
            return peer

    def begin(self, request_id: str, address: str, src_block_ids: list[int], dst_block_ids: list[int],
              secret: str, trace: dict | None = None) -> None:
        """Register the transfer's block mapping on the open connection to `address` (see `connect`), with the
        secret the receiver gave out for it."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"request {request_id}: {len(src_block_ids)} source blocks for "
                             f"{len(dst_block_ids)} destination blocks")
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already being sent")
        peer = self._peers.get(address)
        if peer is None:
            raise PeerDisconnected(f"no open KV connection to {address}")
        self._loop = asyncio.get_running_loop()
        req = _Outgoing(request_id, peer, list(src_block_ids), list(dst_block_ids), contiguous_run(src_block_ids),
                        self._loop.create_future(),
                        TransferStats(request_id, self.transport.name, blocks=len(src_block_ids),
                                      started_at=time.time(), trace=dict(trace or {})))
        peer.requests[request_id] = req
        self._requests[request_id] = req
        begin = {"type": "begin", "req": request_id, "blocks": req.dst_block_ids, "secret": secret}
        if req.stats.trace:
            begin["trace"] = req.stats.trace
        peer.queue.put_nowait((begin, (), 0))

    def send_layer(self, request_id: str, layer: int) -> None:
        """Queue layer `layer` of a begun request. Thread-safe; call it right after the layer's KV is written."""
        req = self._requests.get(request_id)
        if req is None or req.done.done():
            return
        kv_layer = self.cache[layer]
        if req.src_run is not None:
            packed = kv_layer[:, req.src_run[0]:req.src_run[1]]
        else:
            packed = gather_blocks(kv_layer, torch.tensor(req.src_block_ids, device=kv_layer.device))
        if packed.device.type != "cpu":
            packed = to_host(packed)
        k, v = packed[0], packed[1]
        nbytes = 2 * len(req.src_block_ids) * self.layout.page_nbytes
        header = {"type": "layer", "req": request_id, "layers": [layer], "n": len(req.src_block_ids)}
        on_loop = _running_loop() is self._loop
        self._budget.acquire(nbytes, block=not on_loop)
        req.stats.nbytes += nbytes
        req.stats.layers += 1
        item = (header, (as_bytes(k), as_bytes(v)), nbytes)
        if on_loop:
            req.peer.queue.put_nowait(item)
        else:
            self._loop.call_soon_threadsafe(req.peer.queue.put_nowait, item)

    async def finish(self, request_id: str) -> TransferStats:
        """Wait until the receiver confirms every layer landed; raises TransferError otherwise. Always unregisters."""
        req = self._requests.get(request_id)
        if req is None:
            raise TransferError(f"request {request_id} was never begun")
        try:
            stats = await asyncio.wait_for(asyncio.shield(req.done), self.timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"receiver {req.peer.address} did not confirm request {request_id} "
                                  f"within {self.timeout:.1f}s") from None
        finally:
            self._forget(req)
        if self.on_complete:
            self.on_complete(stats)
        return stats

    async def abort(self, request_id: str, reason: str) -> None:
        """Tell the receiver to stop waiting for this request, and forget it here."""
        req = self._requests.get(request_id)
        if req is None:
            return
        if not req.done.done():
            req.done.set_exception(TransferCancelled(reason))
            req.done.exception()
        self._forget(req)
        if req.peer.broken is None:
            req.peer.queue.put_nowait(({"type": "abort", "req": request_id, "error": reason}, (), 0))

    def _forget(self, req: _Outgoing) -> None:
        self._requests.pop(req.request_id, None)
        req.peer.requests.pop(req.request_id, None)

    @property
    def num_connections(self) -> int:
        return len(self._peers)

    async def close(self) -> None:
        for rid in list(self._requests):
            await self.abort(rid, "sender closing")
        for peer in list(self._peers.values()):
            await peer.drain(timeout=2.0)
            await peer.close()
        self._peers.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        self._closing.clear()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
