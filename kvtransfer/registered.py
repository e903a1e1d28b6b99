"""KV caches registered with UCX once, and blocks read from one cache straight into another (one-sided).

ucxx moves tagged messages only; registered memory, remote keys and one-sided READ/WRITE over UCX come from NIXL
(the transfer library NVIDIA Dynamo and vLLM's connector use). Each worker registers its whole cache at start-up
(host memory on a CPU, device memory on CUDA) and keeps one NIXL agent for it.

The decode side reads. A sender's hello carries its cache's descriptor (agent metadata with the remote keys, base
address, size, pool size); the receiver loads it only after the sender showed a transfer's secret, then reads each
layer's blocks from the sender's cache into the blocks it reserved, contiguous runs coalesced into one operation
per layer message. So the receiver, which takes connections from anyone who can reach its port, never exposes its
memory, and no peer can make it write anywhere but its own reservation; a sender exposes its cache, read-only, to
the receivers it chose to connect to.

One thread owns each agent (NIXL's agent is not thread-safe in the mode used here): it posts operations, polls
them, and progresses UCX while peers are connected: every millisecond for a while after one connects (wire-up needs
both sides), then every 50 ms after a read or an announced layer, doubling up to once a second while nothing more
happens (a kernel copy or an RDMA read needs nothing of the side read from; waking every millisecond took the cores
a forward pass runs on, and an idle worker should hardly wake). NIXL's own progress thread would spin a core.
The event loops never copy KV bytes: copies run inside UCX on that thread (with CMA between processes on one host,
the kernel copies; on GPU hosts, CUDA IPC or RDMA).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import importlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kernels.kv_layout import KVLayout, paired_runs
from pdserve.kvtransfer.agent_thread import AgentThread, Read
from pdserve.kvtransfer.errors import ProtocolError, TransferError

log = logging.getLogger(__name__)

ONE_SIDED = "one-sided"
STAGED = "staged"
PLANES = ("auto", ONE_SIDED, STAGED)

MAX_METADATA = 48 << 10  # bytes of a peer's agent metadata this side accepts
# ucxx sets UCX_RNDV_THRESH=8192 for its own context when it is imported; with it UCX emulates one-sided gets in
# software over TCP instead of using CMA. The agent's context is created without that value.
_UCXX_INJECTED = {"UCX_RNDV_THRESH": "8192"}


def host_key() -> str:
    """Who can reach this process's host memory with a kernel copy (CMA): the same boot and PID namespace, where
    ptrace rules allow it between unrelated processes; "" when they do not (or this cannot be told)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "0":
                return ""
    except OSError:
        pass  # no Yama: ordinary ptrace rules (same user) apply
    return f"{boot}/{pid_ns}/{os.getuid()}"


class PlaneUnavailable(RuntimeError):
    """One-sided transfers cannot run here (no NIXL, or UCX cannot register this memory kind)."""


def _nixl() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for wheel in ("nixl_cu13", "nixl_cu12"):
        try:
            api = importlib.import_module(f"{wheel}._api")
        except ImportError:
            continue
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise PlaneUnavailable("NIXL is not installed (pip install nixl-cu13)")


@contextlib.contextmanager
def without_ucxx_settings() -> Iterator[None]:
    """Hide the settings ucxx injects while the agent's UCX reads its configuration."""
    hidden = {k: os.environ.pop(k) for k, v in _UCXX_INJECTED.items() if os.environ.get(k) == v}
    try:
        yield
    finally:
        os.environ.update(hidden)


@dataclass(frozen=True)
class CacheDescriptor:
    """What a receiver needs to read a sender's cache: its agent (name, metadata with the remote keys), where the
    cache lies and how many blocks it holds."""

    agent: str
    metadata: bytes
    base: int
    nbytes: int
    memory: str  # "DRAM" or "VRAM"
    device: int
    num_blocks: int
    host: str = ""  # host_key() of the process whose cache this is

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "metadata": base64.b64encode(self.metadata).decode(),
            "base": self.base,
            "nbytes": self.nbytes,
            "memory": self.memory,
            "device": self.device,
            "num_blocks": self.num_blocks,
            "host": self.host,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], layout: KVLayout) -> CacheDescriptor:
        """A peer's descriptor, checked against the layout both sides agreed on; ProtocolError otherwise."""
        try:
            agent, blob = d["agent"], d["metadata"]
            ints = {k: d[k] for k in ("base", "nbytes", "device", "num_blocks")}
            memory = d["memory"]
        except (KeyError, TypeError):
            raise ProtocolError(
                "cache descriptor without agent, metadata, base, nbytes, memory, device, num_blocks"
            ) from None
        if not (isinstance(agent, str) and 0 < len(agent) <= 128 and isinstance(blob, str)):
            raise ProtocolError("cache descriptor: bad agent name or metadata")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints.values()):
            raise ProtocolError("cache descriptor: base, nbytes, device and num_blocks must be non-negative integers")
        if memory not in ("DRAM", "VRAM") or len(blob) > MAX_METADATA * 4 // 3 + 4:
            raise ProtocolError("cache descriptor: unknown memory kind or oversized metadata")
        try:
            metadata = base64.b64decode(blob, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("cache descriptor: metadata is not base64") from None
        if not 0 < ints["num_blocks"] <= 1 << 24 or ints["nbytes"] != layout.with_blocks(ints["num_blocks"]).nbytes:
            raise ProtocolError("cache descriptor: its size does not match its block count in this layout")
        host = d.get("host", "")
        if not isinstance(host, str) or len(host) > 256:
            raise ProtocolError("cache descriptor: bad host key")
        return cls(agent, metadata, ints["base"], ints["nbytes"], memory, ints["device"], ints["num_blocks"], host)


@dataclass(frozen=True)
class RemoteCache:
    """A peer's cache this side has loaded and may read from."""

    descriptor: CacheDescriptor
    layout: KVLayout


class RegisteredCache:
    """One worker's KV cache, registered with UCX for as long as the worker runs, and the agent that reads into it
    (receivers) or lets peers read from it (senders)."""

    def __init__(self, cache: torch.Tensor, layout: KVLayout, role: str, forced: bool = False) -> None:
        """`forced`: read from every peer with a registered cache of the same memory kind, not only from those
        `reaches` picks."""
        nixl = _nixl()
        self.forced = forced
        self.cache = cache
        self.layout = layout
        self.memory = "VRAM" if cache.is_cuda else "DRAM"
        self.device = (cache.device.index or 0) if cache.is_cuda else 0
        name = f"pdserve-{role}-{os.getpid()}-{secrets.token_hex(6)}"
        with without_ucxx_settings():
            try:
                agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            except Exception as e:  # noqa: BLE001 - any failure here means: no one-sided transfers
                raise PlaneUnavailable(f"NIXL's UCX backend did not start: {e}") from None
        base, nbytes = cache.data_ptr(), layout.nbytes
        why = None
        if f"{self.memory}_SEG" not in agent.get_backend_mem_types("UCX"):
            why = f"this UCX build cannot register {self.memory} memory"
        else:
            try:
                self._registration = agent.register_memory([(base, nbytes, self.device, "")], self.memory)
            except Exception as e:  # noqa: BLE001
                why = f"UCX could not register the KV cache ({self.memory}): {e}"
        if why is not None:
            del agent  # its UCX context goes now, not whenever the exception's frames are collected
            raise PlaneUnavailable(why)
        self.descriptor = CacheDescriptor(
            name, agent.get_agent_metadata(), base, nbytes, self.memory, self.device, layout.num_blocks, host_key()
        )
        self._agent = agent
        self._thread = AgentThread(agent)
        self._loaded: dict[str, int] = {}  # peer agent -> connections using it
        self._closed = False

    def describe(self) -> str:
        where = "host memory" if self.memory == "DRAM" else f"cuda:{self.device} memory"
        return f"one-sided reads from registered {where} (NIXL over UCX, {self.layout.nbytes / 2**20:.0f} MiB)"

    def reaches(self, peer: CacheDescriptor) -> bool:
        """Whether reading `peer`'s cache beats having it staged: device memory (CUDA IPC, RDMA), or host memory
        a kernel copy reaches. Host memory elsewhere would be read by UCX's emulated gets over TCP, slower than
        staged messages."""
        if peer.memory != self.memory:
            return False
        return self.forced or self.memory == "VRAM" or (bool(peer.host) and peer.host == self.descriptor.host)

    def serving(self, delta: int) -> None:
        """A receiver that reads from this cache connected (+1) or went (-1): UCX progresses while any is there."""
        self._thread.connect(delta)

    def announced(self) -> None:
        """Layers of this cache were just announced to a reader: progress UCX often again (its reads may need it)."""
        self._thread.active()

    async def load(self, descriptor: CacheDescriptor) -> RemoteCache:
        """Make a peer's cache readable (once per peer agent; `unload` when its connection ends)."""

        def add() -> None:
            if self._loaded.get(descriptor.agent, 0) == 0:
                added = self._agent.add_remote_agent(descriptor.metadata)
                name = added.decode(errors="replace") if isinstance(added, bytes) else str(added)
                if name != descriptor.agent:
                    self._agent.remove_remote_agent(name)
                    raise ProtocolError("the peer's metadata names another agent than its descriptor")
                self._agent.make_connection(name)
            self._loaded[descriptor.agent] = self._loaded.get(descriptor.agent, 0) + 1
            self._thread.connect(+1)

        try:
            await self._thread.call(add)
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - the peer's metadata was unusable
            raise ProtocolError(f"cannot load the peer's cache descriptor: {e}") from None
        return RemoteCache(descriptor, self.layout.with_blocks(descriptor.num_blocks))

    async def unload(self, remote: RemoteCache) -> None:
        def remove() -> None:
            name = remote.descriptor.agent
            self._thread.connect(-1)
            self._loaded[name] -= 1
            if self._loaded[name] == 0:
                del self._loaded[name]
                self._agent.remove_remote_agent(name)

        await self._thread.call(remove)

    def read(
        self, remote: RemoteCache, layers: list[int], src: list[int], dst: list[int], timeout: float
    ) -> asyncio.Future[tuple[float, float]]:
        """Read `layers` of the peer's blocks `src` into this cache's blocks `dst` (K and V, one operation); the
        future yields when it was posted and seen complete (perf_counter), or fails (TransferTimeout past
        `timeout`)."""
        page = self.layout.page_nbytes
        runs = paired_runs(src, dst)
        planes = [(layer, kv) for layer in layers for kv in (0, 1)]
        mine, theirs = self.layout, remote.layout
        ours, rb, rdev = self.descriptor.base, remote.descriptor.base, remote.descriptor.device
        local = [(ours + mine.page_offset(lyr, kv, d), n * page, self.device) for lyr, kv in planes for _, d, n in runs]
        peer = [(rb + theirs.page_offset(lyr, kv, s), n * page, rdev) for lyr, kv in planes for s, _, n in runs]
        result: concurrent.futures.Future[tuple[float, float]] = concurrent.futures.Future()

        def post() -> None:
            agent = self._agent
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, self.memory),
                agent.get_xfer_descs(peer, remote.descriptor.memory),
                remote.descriptor.agent,
            )
            read = Read(handle, result, time.perf_counter() + timeout)
            agent.transfer(handle)  # a failed post shows as the handle's state, polled like any other
            self._thread.track(read)

        def not_posted(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                result.set_exception(_failed(f))

        self._thread.call(post).add_done_callback(not_posted)
        return asyncio.wrap_future(result)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        """Stop the agent's thread and give the registration back (blocks while reads in flight end)."""
        if self._closed:
            return
        self._closed = True
        self._thread.stop()
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._registration)


def _failed(f: asyncio.Future) -> TransferError:
    e = f.exception()
    return e if isinstance(e, TransferError) else TransferError(f"a KV read could not be posted: {e}")


def open_plane(cache: torch.Tensor, layout: KVLayout, transport: str, plane: str, role: str) -> RegisteredCache | None:
    """The registered cache when `plane` (auto, one-sided, staged) and the transport allow one-sided transfers;
    None means staged. `one-sided` that cannot run raises PlaneUnavailable; the choice is logged."""
    if plane not in PLANES:
        raise ValueError(f"unknown KV plane {plane!r} (have: {', '.join(PLANES)})")
    if plane == STAGED or transport != "ucx":
        why = "--kv-plane staged" if plane == STAGED else f"the {transport} transport"
        if plane == ONE_SIDED:
            raise PlaneUnavailable(f"one-sided transfers need the ucx transport, not {transport}")
        log.info("KV plane: %s (%s)", "staged through the UCX connection" if transport == "ucx" else transport, why)
        return None
    try:
        registered = RegisteredCache(cache, layout, role, forced=plane == ONE_SIDED)
    except PlaneUnavailable as e:
        if plane == ONE_SIDED:
            raise
        log.warning("KV plane: staged through the UCX connection (one-sided unavailable: %s)", e)
        return None
    log.info("KV plane: %s", registered.describe())
    return registered
