"""The decode side: owns nothing but a view of its paged KV cache and lands other processes' blocks in it.

The cache's owner first says which blocks a transfer will fill and with which secret (`expect`), then hands
the address, transfer id and secret to a sender over an authenticated channel. On a connection the sender
first proves its layout is compatible (`hello`), then names the transfer, its block count and its secret
(`begin`); each message after that carries one or more consecutive layers: K and V of its blocks, which land in
the reserved blocks in reservation order (the peer never says where bytes go: `messages.py`). A
layer whose blocks form one contiguous run is received straight into the cache; scattered blocks go through a
staging buffer and are scattered on arrival. The transfer's future resolves once every layer has landed (only
then are the blocks ready), or fails on timeout (counted from `begin`), on the sender's abort, or when the
connection that was feeding it breaks.

Nothing a peer says is trusted: header sizes are capped by the transport, every field is type-checked
(`messages.decode`), a `begin` with the wrong secret or any message that breaks the protocol closes the connection
without reading its payload, and payload sizes come from the reservation, never from the peer. Late layers of a
transfer that was begun correctly and then cancelled are read and dropped (their size is the reservation's).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kernels.cache_ops import scatter_blocks
from pdserve.kernels.kv_layout import KVLayout, LayoutMismatch, contiguous_run
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
)
from pdserve.kvtransfer.stats import StatsHook, TransferStats
from pdserve.kvtransfer.transport import Connection, Listener, Transport, as_bytes

log = logging.getLogger(__name__)

MAX_OPEN_PER_CONNECTION = 4096


@dataclass
class _Expected:
    transfer_id: str
    block_ids: list[int]
    secret: str
    future: asyncio.Future
    stats: TransferStats
    layers_done: set[int] = field(default_factory=set)
    conn_id: int = 0  # the connection that began it (0: not begun yet)
    started: float = 0.0
    timer: asyncio.TimerHandle | None = None
    receiving: asyncio.Future | None = None  # resolves when a receive into the blocks in flight ends


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
    ) -> None:
        """Listens on `host` (exactly: a wildcard only when asked for); senders are told `advertise` (default
        `host`)."""
        if tuple(kv_cache.shape) != layout.shape:
            raise ValueError("KV cache shape does not match its layout")
        self.cache = kv_cache
        self.layout = layout
        self.transport = transport
        self.host, self.port = host, port
        self.advertise = advertise or host
        self.timeout = timeout
        self.on_complete = on_complete
        self._expected: dict[str, _Expected] = {}
        self._listener: Listener | None = None
        self._conn_ids = iter(range(1, 1 << 62))
        self.discarded_messages = 0
        self.refused_connections = 0

    @property
    def address(self) -> str:
        assert self._listener is not None, "receiver not started"
        return f"{self.transport.name}://{self.advertise}:{self._listener.port}"

    async def start(self) -> KVReceiver:
        self._listener = await self.transport.listen(self.host, self.port, self._serve)
        log.info("KV receiver listening at %s", self.address)
        return self

    async def close(self) -> None:
        for tid in list(self._expected):
            self._fail(tid, TransferCancelled(f"receiver closed before transfer {tid} arrived"))
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

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
        exp = _Expected(transfer_id, list(block_ids), secret, fut, stats)
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
        conn_id = next(self._conn_ids)
        begun: dict[str, int] = {}  # transfers begun on this connection -> their block count (what a layer is)
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
            await conn.send(HelloOk(self.layout.to_dict()))
            while True:
                msg = await conn.recv()
                if isinstance(msg, Begin):
                    err = self._on_begin(conn_id, msg, begun)
                    if err:
                        await conn.send(Error(msg.req, err))
                elif isinstance(msg, Layer):
                    done = await self._on_layer(conn, conn_id, msg, begun)
                    if done is not None:
                        await conn.send(Done(done))
                elif isinstance(msg, Abort):
                    begun.pop(msg.req, None)
                    exp = self._expected.get(msg.req)
                    if exp is not None and exp.conn_id == conn_id:
                        self._fail(msg.req, TransferError(f"sender aborted: {msg.error[:MAX_ERROR]}"))
                elif isinstance(msg, Bye):
                    return
                else:
                    raise ProtocolError(f"a sender does not send {msg.kind!r}")
        except ProtocolError as e:
            self.refused_connections += 1
            log.warning("closing KV connection from %s: %s", conn.peer, e)
            self._fail_fed_by(conn_id, PeerDisconnected(f"the sender broke the KV protocol: {e}"))
        except (TimeoutError, PeerDisconnected, TransferError) as e:
            self._fail_fed_by(conn_id, PeerDisconnected(f"KV sender went away: {e}"))
            log.info("KV sender %s disconnected: %s", conn.peer, e)

    def _fail_fed_by(self, conn_id: int, error: TransferError) -> None:
        for tid, exp in list(self._expected.items()):
            if exp.conn_id == conn_id:
                self._fail(tid, error)

    def _on_begin(self, conn_id: int, msg: Begin, begun: dict[str, int]) -> str | None:
        """A sender names a transfer, how many blocks it sends and its secret; returns an error text for a
        transfer this receiver does not expect (any more). A wrong secret is a protocol error."""
        tid = msg.req
        if not tid or tid in begun or len(begun) >= MAX_OPEN_PER_CONNECTION or msg.blocks > self.layout.num_blocks:
            raise ProtocolError(f"transfer {tid!r} begun twice, too many open transfers, or more blocks than a pool")
        exp = self._expected.get(tid)
        if exp is not None and not hmac.compare_digest(msg.secret.encode(), exp.secret.encode()):
            raise ProtocolError(f"wrong secret for transfer {tid}")
        begun[tid] = msg.blocks
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
        exp.conn_id = conn_id
        exp.stats.trace = dict(msg.trace)
        self._arm(exp)
        return None

    def _arm(self, exp: _Expected) -> None:
        """(Re)start the no-progress timer of a begun transfer."""
        if exp.timer:
            exp.timer.cancel()
        exp.timer = asyncio.get_running_loop().call_later(
            self.timeout,
            self._fail,
            exp.transfer_id,
            TransferTimeout(f"transfer {exp.transfer_id}: no KV for {self.timeout:.1f}s"),
        )

    async def _on_layer(self, conn: Connection, conn_id: int, msg: Layer, begun: dict[str, int]) -> str | None:
        """Land one message of one or more consecutive layers; returns the transfer id if that completed it."""
        tid, layers, n = msg.req, msg.layers, msg.blocks
        if (
            begun.get(tid) != n
            or len(layers) > self.layout.num_layers
            or any(layer >= self.layout.num_layers for layer in layers)
        ):
            raise ProtocolError(
                f"layer message for transfer {tid} that was not begun here with {n} blocks, or "
                "for layers this layout does not have"
            )
        payloads = 2 * len(layers)
        exp = self._expected.get(tid)
        if exp is None or exp.conn_id != conn_id or any(layer in exp.layers_done for layer in layers):
            self.discarded_messages += 1  # cancelled since it began: read what was sent, drop it, say so
            await conn.recv_many([np.empty(n * self.layout.page_nbytes, dtype=np.uint8) for _ in range(payloads)])
            await conn.send(Error(tid, "transfer not expected (cancelled or unknown)"))
            return None
        blocks = exp.block_ids
        if not exp.started:
            exp.started = time.perf_counter()
            exp.stats.started_at = time.time()
        exp.receiving = asyncio.get_running_loop().create_future()
        try:
            run = contiguous_run(blocks)
            # a sender that stalls mid-message for longer than the timeout loses its connection (bounded wait)
            if run is not None and self.cache.device.type == "cpu":  # straight into the cache
                await asyncio.wait_for(
                    conn.recv_many(
                        [as_bytes(self.cache[layer, kv, run[0] : run[1]]) for layer in layers for kv in (0, 1)]
                    ),
                    self.timeout,
                )
            else:  # scattered blocks, or device memory: land in host memory, then copy into place
                shape = (len(layers), 2, len(blocks)) + tuple(self.cache.shape[3:])
                staging = torch.empty(shape, dtype=self.cache.dtype)
                await asyncio.wait_for(
                    conn.recv_many([as_bytes(staging[i, kv]) for i in range(len(layers)) for kv in (0, 1)]),
                    self.timeout,
                )
                if self._expected.get(tid) is exp:  # not cancelled while the bytes were in flight
                    index = torch.tensor(blocks, device=self.cache.device)
                    for i, layer in enumerate(layers):
                        scatter_blocks(staging[i].to(self.cache.device), self.cache[layer], index)
        finally:
            exp.receiving.set_result(None)
            exp.receiving = None
        if self._expected.get(tid) is not exp:
            return None
        exp.layers_done.update(layers)
        exp.stats.nbytes += payloads * n * self.layout.page_nbytes
        exp.stats.layers += len(layers)
        if len(exp.layers_done) < self.layout.num_layers:
            self._arm(exp)
            return None
        del self._expected[tid]
        begun.pop(tid, None)
        if exp.timer is not None:
            exp.timer.cancel()
        exp.stats.seconds = time.perf_counter() - exp.started
        if not exp.future.done():
            exp.future.set_result(exp.stats)
        if self.on_complete:
            self.on_complete(exp.stats)
        return tid
