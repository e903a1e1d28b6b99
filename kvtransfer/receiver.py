"""The decode side: owns nothing but a view of its paged KV cache and lands other processes' blocks in it.

The cache's owner first says which blocks a request will be filled into (`expect`), then hands the address
to a sender. The sender names those blocks once (`begin`); then each message carries one or more consecutive
layers of the request: K and V of its blocks, in block-id order. A layer whose blocks form one contiguous run is received straight into the cache; scattered blocks
go through a staging buffer and are scattered on arrival. The request's future resolves once every layer has
landed (only then are the blocks ready), or fails on timeout, on the sender's abort, or when the sender that
was feeding it disconnects. Messages for unknown or cancelled requests are read and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.kv_layout import KVLayout, LayoutMismatch
from kvtransfer.errors import PeerDisconnected, TransferCancelled, TransferError, TransferTimeout
from kvtransfer.stats import StatsHook, TransferStats
from kvtransfer.transport import Connection, Listener, Transport, as_bytes

log = logging.getLogger(__name__)


def contiguous_run(ids: list[int]) -> tuple[int, int] | None:
    """(start, end) if ids are start, start+1, ..., end-1."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return ids[0], ids[-1] + 1
    return None


@dataclass
class _Expected:
    request_id: str
    block_ids: list[int]
    future: asyncio.Future
    layers_done: set[int] = field(default_factory=set)
    feeders: set[int] = field(default_factory=set)  # ids of connections that delivered data
    stats: TransferStats | None = None
    started: float = 0.0
    timer: asyncio.TimerHandle | None = None


class KVReceiver:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, transport: Transport, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 30.0, on_complete: StatsHook | None = None) -> None:
        if tuple(kv_cache.shape) != (layout.num_layers, 2, layout.num_blocks, layout.block_size,
                                     layout.num_kv_heads, layout.head_dim):
            raise ValueError("KV cache shape does not match its layout")
        self.cache = kv_cache
        self.layout = layout
        self.transport = transport
        self.host, self.port = host, port
        self.timeout = timeout
        self.on_complete = on_complete
        self._expected: dict[str, _Expected] = {}
        self._listener: Listener | None = None
        self._conn_ids = iter(range(1, 1 << 62))
        self.discarded_messages = 0

    @property
    def address(self) -> str:
        assert self._listener is not None, "receiver not started"
        return f"{self.transport.name}://{self.host}:{self._listener.port}"

    async def start(self) -> "KVReceiver":
        self._listener = await self.transport.listen(self.host, self.port, self._serve)
        log.info("KV receiver listening at %s", self.address)
        return self

    async def close(self) -> None:
        for rid in list(self._expected):
            self._fail(rid, TransferCancelled(f"receiver closed before request {rid} arrived"))
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

    def expect(self, request_id: str, block_ids: list[int], timeout: float | None = None) -> asyncio.Future:
        """Announce that request_id's KV will arrive into block_ids; the future yields its TransferStats."""
        if request_id in self._expected:
            raise ValueError(f"request {request_id} is already expected")
        if any(not 0 <= b < self.layout.num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range for a pool of {self.layout.num_blocks}")
        fut = asyncio.get_running_loop().create_future()
        exp = _Expected(request_id, list(block_ids), fut)
        exp.stats = TransferStats(request_id, self.transport.name, blocks=len(block_ids))
        exp.timer = asyncio.get_running_loop().call_later(
            timeout or self.timeout, self._fail, request_id,
            TransferTimeout(f"KV for request {request_id} not complete after {timeout or self.timeout:.1f}s"))
        self._expected[request_id] = exp
        return fut

    def cancel(self, request_id: str) -> None:
        """Stop waiting for request_id; anything that still arrives for it is discarded."""
        self._fail(request_id, TransferCancelled(f"request {request_id} cancelled"))

    @property
    def num_pending(self) -> int:
        return len(self._expected)

    def layers_landed(self, request_id: str) -> int:
        """How many of an expected request's layers have landed so far (0 once it is no longer expected)."""
        exp = self._expected.get(request_id)
        return len(exp.layers_done) if exp is not None else 0

    def _fail(self, request_id: str, error: TransferError) -> None:
        exp = self._expected.pop(request_id, None)
        if exp is None:
            return
        if exp.timer:
            exp.timer.cancel()
        if not exp.future.done():
            exp.future.set_exception(error)
            exp.future.exception()  # mark retrieved: the owner may already have stopped waiting

    async def _serve(self, conn: Connection) -> None:
        conn_id = next(self._conn_ids)
        try:
            hello = await asyncio.wait_for(conn.recv_header(), self.timeout)
            if hello.get("type") != "hello":
                raise TransferError(f"expected hello, got {hello.get('type')!r}")
            try:
                self.layout.check_compatible(KVLayout.from_dict(hello["layout"]))
            except LayoutMismatch as e:
                await conn.send({"type": "hello_err", "error": str(e)})
                log.warning("refused sender %s: %s", conn.peer, e)
                return
            await conn.send({"type": "hello_ok", "layout": self.layout.to_dict()})
            while True:
                header = await conn.recv_header()
                kind = header.get("type")
                if kind == "begin":
                    err = self._on_begin(conn_id, header)
                    if err:
                        await conn.send({"type": "error", "req": header["req"], "error": err})
                elif kind == "layer":
                    done = await self._on_layer(conn, conn_id, header)
                    if done is not None:
                        await conn.send({"type": "done", "req": done})
                elif kind == "abort":
                    self._fail(header["req"], TransferError(f"sender aborted: {header.get('error', '')}"))
                elif kind == "bye":
                    return
                else:
                    raise TransferError(f"unknown message type {kind!r}")
        except (PeerDisconnected, asyncio.TimeoutError, TransferError) as e:
            for rid, exp in list(self._expected.items()):
                if conn_id in exp.feeders:
                    self._fail(rid, PeerDisconnected(f"sender of request {rid} went away: {e}"))
            log.info("KV sender %s disconnected: %s", conn.peer, e)

    def _on_begin(self, conn_id: int, h: dict) -> str | None:
        """A sender announces which blocks it will fill; returns an error text if that is not what we expect."""
        rid = h["req"]
        exp = self._expected.get(rid)
        if exp is None:
            self.discarded_messages += 1
            return "request not expected (cancelled or unknown)"
        if h["blocks"] != exp.block_ids:
            self._fail(rid, TransferError(f"request {rid}: sender targets blocks {h['blocks'][:8]}..., "
                                          f"expected {exp.block_ids[:8]}..."))
            return "block ids do not match the reservation"
        exp.feeders.add(conn_id)
        if isinstance(h.get("trace"), dict):
            exp.stats.trace = {str(k): str(v) for k, v in h["trace"].items()}
        return None

    async def _on_layer(self, conn: Connection, conn_id: int, h: dict) -> str | None:
        """Land one message of one or more consecutive layers; returns the request id if that completed it."""
        rid, layers, n = h["req"], h["layers"], h["n"]
        nbytes = n * self.layout.page_nbytes
        exp = self._expected.get(rid)
        valid = exp is not None and conn_id in exp.feeders and n == len(exp.block_ids) \
            and all(0 <= layer < self.layout.num_layers and layer not in exp.layers_done for layer in layers)
        if not valid:
            if exp is not None:
                self._fail(rid, TransferError(f"request {rid}: unexpected layer message {layers}"))
            self.discarded_messages += 1
            await conn.recv_many([np.empty(nbytes, dtype=np.uint8) for _ in range(2 * len(layers))])
            if exp is not None:
                await conn.send({"type": "error", "req": rid, "error": "request not expected (cancelled or unknown)"})
            return None
        blocks = exp.block_ids
        if not exp.started:
            exp.started = time.perf_counter()
            exp.stats.started_at = time.time()
        run = contiguous_run(blocks)
        if run is not None:
            await conn.recv_many([as_bytes(self.cache[layer, kv, run[0]:run[1]]) for layer in layers for kv in (0, 1)])
        else:
            shape = (len(layers), 2, len(blocks)) + tuple(self.cache.shape[3:])
            staging = torch.empty(shape, dtype=self.cache.dtype)
            await conn.recv_many([as_bytes(staging[i, kv]) for i in range(len(layers)) for kv in (0, 1)])
            if rid not in self._expected:  # cancelled while the bytes were in flight: leave the cache alone
                return None
            index = torch.tensor(blocks)
            for i, layer in enumerate(layers):
                self.cache[layer].index_copy_(1, index, staging[i])
        if self._expected.get(rid) is not exp:
            return None
        exp.layers_done.update(layers)
        exp.stats.nbytes += 2 * nbytes * len(layers)
        exp.stats.layers += len(layers)
        if len(exp.layers_done) < self.layout.num_layers:
            return None
        del self._expected[rid]
        exp.timer.cancel()
        exp.stats.seconds = time.perf_counter() - exp.started
        if not exp.future.done():
            exp.future.set_result(exp.stats)
        if self.on_complete:
            self.on_complete(exp.stats)
        return rid
