"""The one-sided KV plane's parts: block runs, the wire's new fields, cache descriptors, choosing a plane, and reads
between two registered caches (in one process; test_kvtransfer runs the whole protocol between processes)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from pdserve.kernels.kv_layout import KVLayout, paired_runs
from pdserve.kvtransfer.errors import ProtocolError
from pdserve.kvtransfer.messages import MAX_SRC, Begin, HelloOk, blocks_of, decode, encode, runs_of
from pdserve.kvtransfer.registered import CacheDescriptor, PlaneUnavailable, RegisteredCache, open_plane
from tests.kv_peers import LAYOUT, make_cache

HAVE_NIXL = bool(importlib.util.find_spec("nixl_cu13") or importlib.util.find_spec("nixl_cu12"))
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="needs NIXL (pip install nixl-cu13)")


def _layout(num_blocks: int) -> KVLayout:
    return KVLayout(**LAYOUT, num_blocks=num_blocks)


def test_paired_runs_cover_every_block_once_in_as_few_pieces_as_both_sides_allow():
    src, dst = [4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 7]
    runs = paired_runs(src, dst)
    assert runs == [(4, 0, 3), (9, 3, 2), (2, 7, 1)]
    assert [(s + i, d + i) for s, d, n in runs for i in range(n)] == list(zip(src, dst))
    with pytest.raises(ValueError):
        paired_runs([1, 2], [1])


def test_block_runs_round_trip():
    for blocks in ([], [7], [5, 6, 7, 9], [3, 2, 1], list(range(100))):
        assert blocks_of(runs_of(blocks)) == blocks
    assert runs_of([5, 6, 7, 9]) == [5, 3, 9, 1]


def test_page_offsets_match_the_cache_tensor():
    layout = _layout(6)
    cache = make_cache(6, 0, LAYOUT)
    flat = cache.view(torch.uint8).reshape(-1)
    assert layout.nbytes == flat.numel()
    for layer, kv, block in [(0, 0, 0), (1, 1, 3), (3, 0, 5)]:
        at = layout.page_offset(layer, kv, block)
        page = cache[layer, kv, block].contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(flat[at : at + layout.page_nbytes], page)


@pytest.mark.parametrize(
    "src",
    [[1], [1, 0], [-1, 2], [1, 2.5], "1,2", [True, 1], [0, 1] * (MAX_SRC // 2 + 1)],
    ids=["odd", "zero-count", "negative", "float", "string", "bool", "too-long"],
)
def test_begin_with_malformed_source_runs_is_a_protocol_error(src):
    header = encode(Begin("t", 2, "s", {}, [0, 2]))
    assert decode(header) == Begin("t", 2, "s", {}, [0, 2])
    with pytest.raises(ProtocolError, match="src"):
        decode({**header, "src": src})


def test_hello_ok_names_a_known_plane():
    header = encode(HelloOk({}, "one-sided"))
    assert decode(header).plane == "one-sided"
    with pytest.raises(ProtocolError, match="plane"):
        decode({**header, "plane": "rdma-please"})


def _descriptor(**change) -> dict:
    d = CacheDescriptor("peer", b"metadata", 1 << 20, _layout(8).nbytes, "DRAM", 0, 8, "host").to_dict()
    return {**d, **change}


def test_cache_descriptor_round_trips_and_refuses_what_does_not_fit_the_layout():
    layout = _layout(64)
    got = CacheDescriptor.from_dict(_descriptor(), layout)
    assert (got.agent, got.metadata, got.num_blocks, got.host) == ("peer", b"metadata", 8, "host")
    bad = [
        {"nbytes": _layout(8).nbytes + 1},  # not its block count's size in this layout
        {"num_blocks": 0},
        {"base": -1},
        {"device": True},
        {"memory": "NVME"},
        {"metadata": "not base64!"},
        {"agent": ""},
        {"host": 7},
    ]
    for change in bad:
        with pytest.raises(ProtocolError):
            CacheDescriptor.from_dict(_descriptor(**change), layout)
    missing = _descriptor()
    del missing["agent"]
    with pytest.raises(ProtocolError):
        CacheDescriptor.from_dict(missing, layout)


def test_open_plane_says_staged_where_one_sided_cannot_run():
    cache, layout = make_cache(4, None, LAYOUT), _layout(4)
    assert open_plane(cache, layout, "tcp", "auto", "decode") is None
    assert open_plane(cache, layout, "ucx", "staged", "decode") is None
    with pytest.raises(PlaneUnavailable, match="ucx"):
        open_plane(cache, layout, "tcp", "one-sided", "decode")
    with pytest.raises(ValueError, match="KV plane"):
        open_plane(cache, layout, "ucx", "sideways", "decode")


@needs_nixl
def test_auto_reads_only_from_peers_a_kernel_copy_reaches():
    async def main() -> None:
        cache, layout = make_cache(4, None, LAYOUT), _layout(4)
        mine = open_plane(cache, layout, "ucx", "auto", "decode")
        forced = open_plane(make_cache(4, None, LAYOUT), layout, "ucx", "one-sided", "decode")
        assert isinstance(mine, RegisteredCache) and isinstance(forced, RegisteredCache)
        try:
            here = forced.descriptor
            elsewhere = CacheDescriptor(**{**here.__dict__, "host": "another-host"})
            assert mine.reaches(here) and not mine.reaches(elsewhere)
            assert forced.reaches(elsewhere), "--kv-plane one-sided reads from every registered peer"
            device = CacheDescriptor(**{**here.__dict__, "memory": "VRAM"})
            assert not mine.reaches(device) and not forced.reaches(device), "host and device memory do not mix"
        finally:
            await mine.close()
            await forced.close()

    asyncio.run(main())


@needs_nixl
def test_read_copies_scattered_blocks_of_every_layer_into_the_reservation_only():
    async def main() -> None:
        src_cache, dst_cache = make_cache(16, 7, LAYOUT), make_cache(32, None, LAYOUT)
        sender = RegisteredCache(src_cache, _layout(16), "prefill")
        receiver = RegisteredCache(dst_cache, _layout(32), "decode")
        sender.serving(+1)
        try:
            remote = await receiver.load(CacheDescriptor.from_dict(sender.descriptor.to_dict(), _layout(32)))
            src, dst = [3, 4, 5, 11, 0], [20, 21, 9, 10, 31]
            started, ended = await receiver.read(remote, [0, 2, 3], src, dst, timeout=30)
            assert started <= ended
            untouched = [b for b in range(32) if b not in dst]
            for layer in range(LAYOUT["num_layers"]):
                want = src_cache[layer, :, src] if layer != 1 else torch.zeros_like(src_cache[layer, :, src])
                assert torch.equal(dst_cache[layer, :, dst], want), layer
                assert not dst_cache[layer, :, untouched].any(), "nothing outside the reservation is written"
            await receiver.unload(remote)
            assert receiver._loaded == {}
        finally:
            sender.serving(-1)
            await receiver.close()
            await sender.close()

    asyncio.run(main())


@needs_nixl
def test_a_receiver_that_cannot_start_gives_its_registered_cache_back():
    """The receiver owns the registered cache it is handed: failing to build or to listen stops the agent's
    thread and gives the registration back."""
    import socket

    from pdserve.kvtransfer.backends import make_transport
    from pdserve.kvtransfer.errors import ListenFailed
    from pdserve.kvtransfer.receiver import KVReceiver

    async def main() -> None:
        layout = _layout(4)
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        try:
            registered = RegisteredCache(make_cache(4, None, LAYOUT), layout, "decode")
            receiver = KVReceiver(
                registered.cache, layout, make_transport("ucx"), port=busy.getsockname()[1], registered=registered
            )
            with pytest.raises(ListenFailed):
                await receiver.start()
            assert receiver.registered is None and not registered._thread._thread.is_alive()
            registered = RegisteredCache(make_cache(4, None, LAYOUT), layout, "decode")
            with pytest.raises(ValueError, match="shape"):
                KVReceiver(make_cache(5, None, LAYOUT), layout, make_transport("ucx"), registered=registered)
            assert not registered._thread._thread.is_alive()
        finally:
            busy.close()

    asyncio.run(main())


class _CountingAgent:
    """Stands in for a NIXL agent: counts the progress calls the agent's thread makes."""

    def __init__(self) -> None:
        self.progressed = 0

    def get_new_notifs(self) -> dict:
        self.progressed += 1
        return {}


def test_the_agent_thread_backs_off_while_connected_peers_are_quiet_and_wakes_for_a_reader():
    """Past the wire-up window a connected but quiet plane progresses UCX at 50 ms doubling to once a second, not
    at a steady 50 ms (20 wake-ups a second in an idle worker); a layer announced to a reader cuts a long wait
    short."""
    import time

    from pdserve.kvtransfer import agent_thread

    agent = _CountingAgent()
    thread = agent_thread.AgentThread(agent)
    try:
        thread.connect(+1)
        thread._wire_up_until = 0.0  # the wire-up window (1 ms progress) is past
        time.sleep(3.0)
        quiet = agent.progressed
        assert 3 <= quiet <= 12, quiet  # 50 + 100 + 200 + 400 + 800 + 1000 ms: 6 or 7; a steady 50 ms: 60
        deadline = time.monotonic() + 30.0
        thread.active()
        while agent.progressed == quiet:
            assert time.monotonic() < deadline, "an announced layer did not bring progress"
            time.sleep(0.01)
        thread.connect(-1)
        time.sleep(0.2)
        idle = agent.progressed
        time.sleep(1.5)
        assert agent.progressed == idle  # no peer: no progress at all
    finally:
        thread.stop()
