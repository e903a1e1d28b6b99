"""What a receiver keeps per transfer it expects (`Expected`) and per sender connection (`Link`), and how a staged
layer message's bytes land in the cache (`land_staged`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kernels.cache_ops import scatter_blocks
from pdserve.kernels.kv_layout import contiguous_run
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.messages import Message
from pdserve.kvtransfer.registered import CacheDescriptor, RemoteCache
from pdserve.kvtransfer.stats import TransferStats
from pdserve.kvtransfer.transport import Connection, as_bytes


@dataclass
class Expected:
    transfer_id: str
    block_ids: list[int]
    secret: str
    future: asyncio.Future
    stats: TransferStats
    layers_done: set[int] = field(default_factory=set)
    layers_asked: set[int] = field(default_factory=set)  # one-sided: layers whose read was posted
    conn_id: int = 0  # the connection that began it (0: not begun yet)
    src: list[int] | None = None  # one-sided: the sender's blocks, in reservation order
    started: float = 0.0  # first and last layer message (perf_counter)
    last: float = 0.0
    wire_end: float = 0.0
    timer: asyncio.TimerHandle | None = None
    receiving: asyncio.Future | None = None  # resolves when the receives or reads into the blocks in flight end
    inflight: int = 0  # one-sided reads in flight


@dataclass
class Link:
    """One sender's connection: what it has begun, its cache (one-sided), and the sends and reads it has running."""

    conn: Connection
    id: int
    begun: dict[str, bool] = field(default_factory=dict)  # transfers begun here -> one-sided?
    sizes: dict[str, int] = field(default_factory=dict)  # ... -> their block count (what a layer is)
    descriptor: CacheDescriptor | None = None  # the sender's cache, when this side reads from it
    remote: RemoteCache | None = None  # ... loaded, after a begin with a right secret
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: set[asyncio.Task] = field(default_factory=set)
    reads: set[asyncio.Future] = field(default_factory=set)

    async def send(self, msg: Message) -> None:
        async with self.lock:  # completions send too: whole messages, one at a time
            await self.conn.send(msg)

    def send_soon(self, msg: Message) -> None:
        task = asyncio.ensure_future(self._send_quietly(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send_quietly(self, msg: Message) -> None:
        try:
            await self.send(msg)
        except TransferError:
            pass  # the connection is gone; its end fails what it fed


async def land_staged(
    conn: Connection,
    cache: torch.Tensor,
    blocks: list[int],
    layers: list[int],
    timeout: float,
    wanted: Callable[[], bool],
) -> None:
    """Receive one staged message's payloads (K and V of each of `layers`) into `blocks` of `cache`: straight in for
    one contiguous run in host memory, else through a staging buffer scattered into place (unless no longer
    `wanted`: cancelled while the bytes were in flight). A sender that stalls mid-message for longer than `timeout`
    loses its connection (bounded wait)."""
    run = contiguous_run(blocks)
    if run is not None and cache.device.type == "cpu":
        views = [as_bytes(cache[layer, kv, run[0] : run[1]]) for layer in layers for kv in (0, 1)]
        await asyncio.wait_for(conn.recv_many(views), timeout)
        return
    staging = torch.empty((len(layers), 2, len(blocks)) + tuple(cache.shape[3:]), dtype=cache.dtype)
    await asyncio.wait_for(
        conn.recv_many([as_bytes(staging[i, kv]) for i in range(len(layers)) for kv in (0, 1)]), timeout
    )
    if wanted():
        index = torch.tensor(blocks, device=cache.device)
        for i, layer in enumerate(layers):
            scatter_blocks(staging[i].to(cache.device), cache[layer], index)
