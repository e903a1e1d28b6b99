"""The prefill side: pushes one request's KV to a receiver layer by layer, while the forward pass goes on.

`begin` opens (or reuses) the one connection to that receiver — a handshake checks the layout fingerprint
first — and registers the request. `send_layer` is called from the forward pass's thread as soon as layer l
is written. When this cache is registered and the receiver reads it (one-sided, `registered.py`), that queues a
header saying the layer is ready and nothing else: the receiver reads the blocks from this cache, which holds them
until `finish`. Otherwise (staged) it snapshots the layer's blocks (a view when they are one contiguous run, else a
packed copy) and queues them behind the header. A single writer task per connection sends queued messages in
order, so several requests share the connection; in-flight bytes are bounded, which makes a fast forward wait for
a slow wire. `finish` waits for the receiver's acknowledgement that every layer landed. The sender names only its
own blocks: where they land is the receiver's reservation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.kernels.cache_ops import gather_blocks
from pdserve.kernels.kv_layout import KVLayout, LayoutMismatch, contiguous_run
from pdserve.kvtransfer.errors import PeerDisconnected, TransferCancelled, TransferError, TransferTimeout
from pdserve.kvtransfer.messages import (
    MAX_ERROR,
    MAX_SRC,
    Abort,
    Begin,
    Hello,
    HelloOk,
    Layer,
    runs_of,
)
from pdserve.kvtransfer.registered import ONE_SIDED, RegisteredCache
from pdserve.kvtransfer.sender_peer import ByteBudget, Peer, Queued
from pdserve.kvtransfer.stats import StatsHook, TransferStats
from pdserve.kvtransfer.transport import Transport, as_bytes, parse_address, to_host

log = logging.getLogger(__name__)


@dataclass
class Outgoing:
    request_id: str
    peer: Peer
    src_block_ids: list[int]
    src_run: tuple[int, int] | None
    done: asyncio.Future[TransferStats]
    stats: TransferStats
    one_sided: bool = False  # the receiver reads the blocks; only headers travel
    started: float = field(default_factory=time.perf_counter)
    first: float = 0.0  # first and last layer queued (perf_counter)
    last: float = 0.0


class KVSender:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        transport: Transport,
        timeout: float = 30.0,
        max_inflight_bytes: int = 256 << 20,
        on_complete: StatsHook | None = None,
        registered: RegisteredCache | None = None,
    ) -> None:
        """`registered`: this cache registered for one-sided reads (the sender owns it from now on); None: staged."""
        self.cache = kv_cache
        self.registered = registered
        self.layout = layout
        self.transport = transport
        self.timeout = timeout
        self.on_complete = on_complete
        self._budget = ByteBudget(max_inflight_bytes)
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._requests: dict[str, Outgoing] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handoff: list[tuple[Peer, Queued]] = []  # queued from other threads, for the loop to take
        self._handoff_lock = threading.Lock()
        self._handoff_scheduled = False
        self._closing: set[asyncio.Future] = set()

    def connected(self, address: str) -> bool:
        return address in self._peers

    async def connect(self, address: str) -> None:
        """Open the connection to the receiver at `address` (handshake included) unless it is open already."""
        if address in self._peers:
            return
        await self._peer(address)

    async def _peer(self, address: str) -> Peer:
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            if address in self._peers:
                return self._peers[address]
            scheme, host, port = parse_address(address)
            if scheme != self.transport.name:
                raise TransferError(
                    f"address {address} needs transport {scheme!r}, this sender has {self.transport.name!r}"
                )
            try:
                conn = await self.transport.connect(host, port, self.timeout)
            except (TimeoutError, OSError, PeerDisconnected) as e:
                raise PeerDisconnected(f"cannot connect to KV receiver {address}: {e!r}") from e
            memory = self.registered.descriptor.to_dict() if self.registered is not None else {}
            try:
                await asyncio.wait_for(conn.send(Hello(self.layout.to_dict(), memory)), self.timeout)
                reply = await asyncio.wait_for(conn.recv(), self.timeout)
            except TimeoutError:
                await conn.close()
                raise TransferTimeout(
                    f"KV receiver {address} did not answer the handshake in {self.timeout:.1f}s"
                ) from None
            except BaseException:
                await conn.close()
                raise
            if not isinstance(reply, HelloOk):
                await conn.close()
                raise LayoutMismatch(f"KV receiver {address} refused this sender: {getattr(reply, 'error', reply)}")
            read_by = self.registered if reply.plane == ONE_SIDED and self.registered is not None else None
            if read_by is not None:
                read_by.serving(+1)
            peer = Peer(address, conn, self._budget, self.timeout, self._forget_peer, read_by)
            self._peers[address] = peer
            return peer

    def _forget_peer(self, peer: Peer) -> None:
        """A connection broke: new transfers open another one; this one is closed in the background."""
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        task = asyncio.ensure_future(peer.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def begin(
        self, request_id: str, address: str, src_block_ids: list[int], secret: str, trace: dict[str, str] | None = None
    ) -> None:
        """Register a transfer of these blocks on the open connection to `address` (see `connect`), under the id
        and secret the receiver gave out for it."""
        if request_id in self._requests:
            raise TransferError(f"request {request_id} is already being sent")
        peer = self._peers.get(address)
        if peer is None:
            raise PeerDisconnected(f"no open KV connection to {address}")
        self._loop = asyncio.get_running_loop()
        runs = runs_of(list(src_block_ids)) if peer.read_by is not None else []
        one_sided = 0 < len(runs) <= MAX_SRC  # blocks too scattered to name in one header go staged
        req = Outgoing(
            request_id,
            peer,
            list(src_block_ids),
            contiguous_run(src_block_ids),
            self._loop.create_future(),
            TransferStats(
                request_id,
                self.transport.name,
                path=ONE_SIDED if one_sided else _staged_path(self.transport.name),
                blocks=len(src_block_ids),
                started_at=time.time(),
                trace=dict(trace or {}),
            ),
            one_sided,
        )
        peer.requests[request_id] = req
        self._requests[request_id] = req
        peer.put(Queued(Begin(request_id, len(src_block_ids), secret, req.stats.trace, runs if one_sided else [])))

    def send_layer(self, request_id: str, layer: int) -> None:
        """Queue layer `layer` of a begun request. Thread-safe; call it right after the layer's KV is written."""
        req = self._requests.get(request_id)
        if req is None or req.done.done():
            return
        now = time.perf_counter()
        if not req.first:
            req.first = now
            req.stats.started_at = time.time()
        req.last = now
        nbytes = 2 * len(req.src_block_ids) * self.layout.page_nbytes
        req.stats.nbytes += nbytes
        req.stats.layers += 1
        if req.one_sided:
            ready = None
            if self.cache.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            self._post(req, Queued(Layer(request_id, [layer], len(req.src_block_ids)), ready=ready))
            return
        kv_layer = self.cache[layer]
        if req.src_run is not None:
            packed = kv_layer[:, req.src_run[0] : req.src_run[1]]
        else:
            packed = gather_blocks(kv_layer, torch.tensor(req.src_block_ids, device=kv_layer.device))
        if packed.device.type != "cpu":
            packed = to_host(packed)
        k, v = packed[0], packed[1]
        self._budget.acquire(nbytes, block=_running_loop() is not self._loop)
        self._post(req, Queued(Layer(request_id, [layer], len(req.src_block_ids)), (as_bytes(k), as_bytes(v)), nbytes))

    def _post(self, req: Outgoing, item: Queued) -> None:
        """Queue an item on the request's connection, from the loop or from any thread."""
        if _running_loop() is self._loop:
            req.peer.put(item)
            return
        assert self._loop is not None
        with self._handoff_lock:  # one wake-up of the loop for all a thread queues meanwhile, not one per layer
            self._handoff.append((req.peer, item))
            if self._handoff_scheduled:
                return
            self._handoff_scheduled = True
        self._loop.call_soon_threadsafe(self._take_handoff)

    def _take_handoff(self) -> None:
        with self._handoff_lock:
            items, self._handoff = self._handoff, []
            self._handoff_scheduled = False
        for peer, item in items:
            peer.put(item)

    async def finish(self, request_id: str) -> TransferStats:
        """Wait until the receiver confirms every layer landed; raises TransferError otherwise. Always unregisters."""
        req = self._requests.get(request_id)
        if req is None:
            raise TransferError(f"request {request_id} was never begun")
        try:
            stats = await asyncio.wait_for(asyncio.shield(req.done), self.timeout)
        except TimeoutError:
            if req.peer.broken is None:  # the receiver stops too (and stops reading these blocks) rather than time out
                req.peer.put(Queued(Abort(request_id, "the sender gave up waiting for the acknowledgement")))
            raise TransferTimeout(
                f"receiver {req.peer.address} did not confirm request {request_id} within {self.timeout:.1f}s"
            ) from None
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
            req.peer.put(Queued(Abort(request_id, reason[:MAX_ERROR])))

    def _forget(self, req: Outgoing) -> None:
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
        if self.registered is not None:
            await self.registered.close()
            self.registered = None


def _staged_path(transport: str) -> str:
    return "tcp" if transport == "tcp" else "staged"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
