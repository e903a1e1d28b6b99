"""The decode side: owns nothing but a view of its paged KV cache and lands other processes' blocks in it.

The cache's owner first says which blocks a transfer will fill and with which secret (`expect`), then hands
the address, transfer id and secret to a sender over an authenticated channel. On a connection the sender
first proves its layout is compatible (`hello`), then names the transfer, its block count and its secret
(`begin`); each message after that names one or more consecutive layers, whose K and V land in the reserved
blocks in reservation order (the peer never says where bytes go: `messages.py`). One-sided (the sender's cache is
registered, and so is this one: `registered.py`): the message carries no bytes and this side reads those layers
from the sender's blocks straight into its own, while it goes on reading messages. Staged: the bytes follow the
message; a layer whose blocks form one contiguous run is received straight into the cache, scattered blocks go
through a staging buffer and are scattered on arrival. The transfer's future resolves once every layer has landed
(only then are the blocks ready), or fails on timeout (no progress for the timeout, counted from `begin`), on the
sender's abort, on a failed read, or when the connection that was feeding it breaks.

Nothing a peer says is trusted: header sizes are capped by the transport, every field is type-checked
(`messages.decode`), a `begin` with the wrong secret or any message that breaks the protocol closes the connection
without reading its payload, and payload sizes come from the reservation, never from the peer. A sender's cache
descriptor is loaded into UCX only after a `begin` with a right secret. Late layers of a transfer that was begun
correctly and then cancelled are read and dropped (their size is the reservation's).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import numpy as np
import torch

from pdserve.kernels.kv_layout import KVLayout, LayoutMismatch
from pdserve.kvtransfer.errors import PeerDisconnected, ProtocolError, TransferCancelled, TransferError, TransferTimeout
from pdserve.kvtransfer.messages import (
    MAX_ERROR,
    MAX_TRANSFER_ID,
    Abort,
    Begin,
    Bye,
    Done,
    Error,
    Hello,
    HelloErr,
    HelloOk,
    Layer,
    blocks_of,
)
from pdserve.kvtransfer.receiver_link import Expected, Link, land_staged
from pdserve.kvtransfer.registered import ONE_SIDED, STAGED, CacheDescriptor, RegisteredCache
from pdserve.kvtransfer.stats import StatsHook, TransferStats
from pdserve.kvtransfer.transport import Connection, Listener, Transport

log = logging.getLogger(__name__)

MAX_OPEN_PER_CONNECTION = 4096


class KVReceiver:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        transport: Transport,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 30.0,
        on_complete: StatsHook | None = None,
        advertise: str | None = None,
        registered: RegisteredCache | None = None,
    ) -> None:
        """Listens on `host` (exactly: a wildcard only when asked for); senders are told `advertise` (default
        `host`). `registered`: this cache registered for one-sided reads (the receiver owns it from now on)."""
        if tuple(kv_cache.shape) != layout.shape:
            if registered is not None:  # it was handed over: nobody else will close it
                registered.close_now()
            raise ValueError("KV cache shape does not match its layout")
        self.cache = kv_cache
        self.layout = layout
        self.transport = transport
        self.host, self.port = host, port
        self.advertise = advertise or host
        self.timeout = timeout
        self.on_complete = on_complete
        self.registered = registered
        self._cleanups: set[asyncio.Task] = set()
        self._expected: dict[str, Expected] = {}
        self._listener: Listener | None = None
        self._conn_ids = iter(range(1, 1 << 62))
        self.discarded_messages = 0
        self.refused_connections = 0

    @property
    def address(self) -> str:
        assert self._listener is not None, "receiver not started"
        return f"{self.transport.name}://{self.advertise}:{self._listener.port}"

    async def start(self) -> KVReceiver:
        try:
            self._listener = await self.transport.listen(self.host, self.port, self._serve)
        except BaseException:
            await self.close()  # the registered cache too: a receiver that cannot listen holds nothing
            raise
        log.info("KV receiver listening at %s", self.address)
        return self

    async def close(self) -> None:
        for tid in list(self._expected):
            self._fail(tid, TransferCancelled(f"receiver closed before transfer {tid} arrived"))
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self.registered is not None:
            await self.registered.close()
            self.registered = None

    def expect(
        self, transfer_id: str, block_ids: list[int], secret: str, timeout: float | None = None
    ) -> asyncio.Future:
        """Announce that transfer_id's KV will arrive into block_ids from a sender holding `secret`; the future
        yields its TransferStats. `timeout` (default the receiver's) counts from the sender's `begin`."""
        if transfer_id in self._expected:
            raise ValueError(f"transfer {transfer_id} is already expected")
        if not 0 < len(transfer_id) <= MAX_TRANSFER_ID:
            raise ValueError(f"transfer ids are 1..{MAX_TRANSFER_ID} characters")
        if any(not 0 <= b < self.layout.num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range for a pool of {self.layout.num_blocks}")
        fut = asyncio.get_running_loop().create_future()
        stats = TransferStats(transfer_id, self.transport.name, blocks=len(block_ids))
        exp = Expected(transfer_id, list(block_ids), secret, fut, stats)
        exp.timer = asyncio.get_running_loop().call_later(  # replaced by the progress timer at `begin`
            timeout or self.timeout,
            self._fail,
            transfer_id,
            TransferTimeout(f"transfer {transfer_id}: no sender began it within {timeout or self.timeout:.1f}s"),
        )
        self._expected[transfer_id] = exp
        return fut

    def cancel(self, transfer_id: str) -> asyncio.Future | None:
        """Stop waiting for transfer_id; what still arrives for it is dropped. Returns a future that resolves
        once no receive is writing into its blocks any more (None when none is), so the owner frees the blocks
        only then."""
        exp = self._expected.get(transfer_id)
        self._fail(transfer_id, TransferCancelled(f"transfer {transfer_id} cancelled"))
        if exp is not None and exp.receiving is not None and not exp.receiving.done():
            return exp.receiving
        return None

    @property
    def num_pending(self) -> int:
        return len(self._expected)

    def layers_landed(self, transfer_id: str) -> int:
        """How many of an expected transfer's layers have landed so far (0 once it is no longer expected)."""
        exp = self._expected.get(transfer_id)
        return len(exp.layers_done) if exp is not None else 0

    def _fail(self, transfer_id: str, error: TransferError) -> None:
        exp = self._expected.pop(transfer_id, None)
        if exp is None:
            return
        if exp.timer:
            exp.timer.cancel()
        if not exp.future.done():
            exp.future.set_exception(error)
            exp.future.exception()  # mark retrieved: the owner may already have stopped waiting

    # ---- one connection ----------------------------------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        link = Link(conn, next(self._conn_ids))
        try:
            hello = await asyncio.wait_for(conn.recv(), self.timeout)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello, got {hello.kind!r}")
            try:
                self.layout.check_compatible(KVLayout.from_dict(hello.layout))
            except (LayoutMismatch, TypeError, ValueError) as e:
                await conn.send(HelloErr(str(e)))
                log.warning("refused KV sender %s: %s", conn.peer, e)
                return
            if self.registered is not None and hello.memory:
                descriptor = CacheDescriptor.from_dict(hello.memory, self.layout)
                if self.registered.reaches(descriptor):
                    link.descriptor = descriptor
            await link.send(HelloOk(self.layout.to_dict(), ONE_SIDED if link.descriptor else STAGED))
            while True:
                msg = await conn.recv()
                if isinstance(msg, Begin):
                    err = await self._on_begin(link, msg)
                    if err:
                        await link.send(Error(msg.req, err))
                elif isinstance(msg, Layer):
                    done = await self._on_layer(link, msg)
                    if done is not None:
                        await link.send(Done(done))
                elif isinstance(msg, Abort):
                    link.begun.pop(msg.req, None)
                    link.sizes.pop(msg.req, None)
                    exp = self._expected.get(msg.req)
                    if exp is not None and exp.conn_id == link.id:
                        self._fail(msg.req, TransferError(f"sender aborted: {msg.error[:MAX_ERROR]}"))
                elif isinstance(msg, Bye):
                    return
                else:
                    raise ProtocolError(f"a sender does not send {msg.kind!r}")
        except ProtocolError as e:
            self.refused_connections += 1
            log.warning("closing KV connection from %s: %s", conn.peer, e)
            self._fail_fed_by(link.id, PeerDisconnected(f"the sender broke the KV protocol: {e}"))
        except (TimeoutError, PeerDisconnected, TransferError) as e:
            self._fail_fed_by(link.id, PeerDisconnected(f"KV sender went away: {e}"))
            log.info("KV sender %s disconnected: %s", conn.peer, e)
        finally:
            for t in link.tasks:
                t.cancel()
            if link.remote is not None:
                task = asyncio.ensure_future(self._unload(link))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _unload(self, link: Link) -> None:
        """Forget a gone sender's cache once no read from it is in flight any more."""
        await asyncio.gather(*link.reads, return_exceptions=True)
        if link.remote is not None and self.registered is not None:
            await self.registered.unload(link.remote)

    def _fail_fed_by(self, conn_id: int, error: TransferError) -> None:
        for tid, exp in list(self._expected.items()):
            if exp.conn_id == conn_id:
                self._fail(tid, error)

    async def _on_begin(self, link: Link, msg: Begin) -> str | None:
        """A sender names a transfer, how many blocks it sends and its secret; returns an error text for a
        transfer this receiver does not expect (any more). A wrong secret is a protocol error."""
        tid = msg.req
        if (
            not tid
            or tid in link.begun
            or len(link.begun) >= MAX_OPEN_PER_CONNECTION
            or msg.blocks > self.layout.num_blocks
        ):
            raise ProtocolError(f"transfer {tid!r} begun twice, too many open transfers, or more blocks than a pool")
        exp = self._expected.get(tid)
        if exp is not None and not hmac.compare_digest(msg.secret.encode(), exp.secret.encode()):
            raise ProtocolError(f"wrong secret for transfer {tid}")
        src = self._source_blocks(link, msg) if msg.src else None
        link.begun[tid], link.sizes[tid] = src is not None, msg.blocks
        if exp is None or exp.conn_id:
            self.discarded_messages += 1
            return "transfer not expected (cancelled or unknown)"
        if msg.blocks != len(exp.block_ids):
            self._fail(
                tid,
                TransferError(
                    f"transfer {tid}: the sender has {msg.blocks} blocks for a reservation of {len(exp.block_ids)}"
                ),
            )
            return "block count does not match the reservation"
        if src is not None and link.remote is None:
            assert self.registered is not None and link.descriptor is not None
            link.remote = await self.registered.load(link.descriptor)  # only now: the sender showed a secret
            if self._expected.get(tid) is not exp:
                return "transfer not expected (cancelled or unknown)"
        exp.conn_id = link.id
        exp.src = src
        exp.stats.path = ONE_SIDED if src is not None else "tcp" if self.transport.name == "tcp" else STAGED
        exp.stats.trace = dict(msg.trace)
        self._arm(exp)
        return None

    def _source_blocks(self, link: Link, msg: Begin) -> list[int]:
        """The sender's blocks of a one-sided begin, checked against its pool before they are spelled out."""
        d = link.descriptor
        if d is None:
            raise ProtocolError("a one-sided begin on a connection this side does not read from")
        starts, counts = msg.src[0::2], msg.src[1::2]
        if sum(counts) != msg.blocks or any(a + n > d.num_blocks for a, n in zip(starts, counts)):
            raise ProtocolError(f"transfer {msg.req}: source runs do not cover {msg.blocks} of the sender's blocks")
        return blocks_of(msg.src)

    def _arm(self, exp: Expected) -> None:
        """(Re)start the no-progress timer of a begun transfer."""
        if exp.timer:
            exp.timer.cancel()
        exp.timer = asyncio.get_running_loop().call_later(
            self.timeout,
            self._fail,
            exp.transfer_id,
            TransferTimeout(f"transfer {exp.transfer_id}: no KV for {self.timeout:.1f}s"),
        )

    async def _on_layer(self, link: Link, msg: Layer) -> str | None:
        """Land (staged) or start reading (one-sided) one message of one or more consecutive layers; returns the
        transfer id if that completed it."""
        tid, layers, n = msg.req, msg.layers, msg.blocks
        if (
            link.sizes.get(tid) != n
            or tid not in link.begun
            or len(layers) > self.layout.num_layers
            or any(layer >= self.layout.num_layers for layer in layers)
        ):
            raise ProtocolError(
                f"layer message for transfer {tid} that was not begun here with {n} blocks, or "
                "for layers this layout does not have"
            )
        one_sided = link.begun[tid]
        payloads = 0 if one_sided else 2 * len(layers)
        exp = self._expected.get(tid)
        if (
            exp is None
            or exp.conn_id != link.id
            or any(layer in exp.layers_done or layer in exp.layers_asked for layer in layers)
        ):
            self.discarded_messages += 1  # cancelled since it began: read what was sent, drop it, say so
            await link.conn.recv_many([np.empty(n * self.layout.page_nbytes, dtype=np.uint8) for _ in range(payloads)])
            await link.send(Error(tid, "transfer not expected (cancelled or unknown)"))
            return None
        blocks = exp.block_ids
        now = time.perf_counter()
        if not exp.started:
            exp.started = now
            exp.stats.started_at = time.time()
        exp.last = now
        if one_sided:
            self._read(link, exp, layers)
            return None
        exp.receiving = asyncio.get_running_loop().create_future()
        wire_start = time.perf_counter()
        try:
            await land_staged(
                link.conn, self.cache, blocks, layers, self.timeout, lambda: self._expected.get(tid) is exp
            )
        finally:
            exp.receiving.set_result(None)
            exp.receiving = None
        exp.stats.wire_seconds += time.perf_counter() - wire_start
        return self._landed(link, exp, layers)

    def _read(self, link: Link, exp: Expected, layers: list[int]) -> None:
        """Post the read of `layers` from the sender's blocks into the reservation; `_read_ended` takes it up."""
        assert self.registered is not None and link.remote is not None and exp.src is not None
        exp.layers_asked.update(layers)
        read = self.registered.read(link.remote, layers, exp.src, exp.block_ids, self.timeout)
        exp.inflight += 1
        if exp.receiving is None:
            exp.receiving = asyncio.get_running_loop().create_future()
        link.reads.add(read)
        read.add_done_callback(lambda f: self._read_ended(link, exp, layers, f))

    def _read_ended(self, link: Link, exp: Expected, layers: list[int], read: asyncio.Future) -> None:
        link.reads.discard(read)
        exp.inflight -= 1
        if exp.inflight == 0 and exp.receiving is not None:
            exp.receiving.set_result(None)  # nothing writes into the blocks any more: the owner may free them
            exp.receiving = None
        tid = exp.transfer_id
        error = read.exception() if not read.cancelled() else TransferCancelled("read cancelled")
        if self._expected.get(tid) is not exp:
            return
        if error is not None:
            self._fail(tid, TransferError(f"transfer {tid}: {error}"))
            link.send_soon(Error(tid, str(error)[:MAX_ERROR]))
            return
        start, end = read.result()
        exp.stats.wire_seconds += end - max(start, exp.wire_end)  # reads that overlap count once
        exp.wire_end = max(exp.wire_end, end)
        if self._landed(link, exp, layers) is not None:
            link.send_soon(Done(tid))

    def _landed(self, link: Link, exp: Expected, layers: list[int]) -> str | None:
        """Count layers as landed; returns the transfer id once that completes it (its future is resolved)."""
        tid = exp.transfer_id
        if self._expected.get(tid) is not exp:
            return None
        exp.layers_done.update(layers)
        exp.stats.nbytes += 2 * len(layers) * len(exp.block_ids) * self.layout.page_nbytes
        exp.stats.layers += len(layers)
        if len(exp.layers_done) < self.layout.num_layers:
            self._arm(exp)
            return None
        del self._expected[tid]
        link.begun.pop(tid, None)
        link.sizes.pop(tid, None)
        if exp.timer is not None:
            exp.timer.cancel()
        now = time.perf_counter()
        exp.stats.seconds = now - exp.started
        exp.stats.tail_seconds = now - exp.last
        if not exp.future.done():
            exp.future.set_result(exp.stats)
        if self.on_complete:
            self.on_complete(exp.stats)
        return tid
