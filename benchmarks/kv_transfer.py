"""KV transfer bandwidth: pdserve's paths (one-sided, staged over UCX, TCP) next to raw ucxx, a raw one-sided
read and memcpy, in one run on one host.

    python -m pdserve.benchmarks.kv_transfer --tokens 128 1024 8192 --repeats 5

The layout is a 135M-class model's (30 layers, 3 KV heads, head dim 64, block 16, bf16). Each pdserve
transfer is one request: 30 layer messages from the sender's cache into the receiver's paged cache, timed at the
sender from the first layer queued to the receiver's acknowledgement. one-sided: the receiver reads the blocks
from the sender's registered cache (NIXL over UCX); staged: K and V travel behind each layer's header on the ucxx
connection; tcp: the same over a socket. Raw ucxx is one buffer of the same size sent and acknowledged on a ucxx
endpoint; raw read is one NIXL READ of the same bytes between two registered buffers; memcpy is a torch copy.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

LAYOUT: dict[str, Any] = dict(
    model="bench-135m", dtype="bfloat16", num_layers=30, block_size=16, num_kv_heads=3, head_dim=64
)


def _cache(num_blocks: int, random: bool) -> torch.Tensor:
    shape = (LAYOUT["num_layers"], 2, num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    t = torch.empty(shape, dtype=torch.bfloat16)
    return t.normal_() if random else t.zero_()


PATHS = {"one-sided": "ucx", "staged": "ucx", "tcp": "tcp"}  # pdserve's paths and the transport each runs on


def _receiver(pipe, layout: dict, paths: tuple[str, ...], raw: bool) -> None:
    """Serves a pdserve receiver per path (into a zeroed cache of `layout`) and, with `raw`, a raw ucxx
    echo-ack endpoint; answers ("expect", path, id, blocks) with "ready", ("raw_read", descriptor, nbytes,
    repeats) with GB/s of raw one-sided reads, ("stop",) with "stopped"."""
    from pdserve.kernels.kv_layout import KVLayout
    from pdserve.kvtransfer.backends import make_transport
    from pdserve.kvtransfer.receiver import KVReceiver
    from pdserve.kvtransfer.registered import ONE_SIDED, STAGED, open_plane

    async def raw_handler(ep) -> None:
        while True:
            size = np.empty(1, dtype=np.uint64)
            try:
                await ep.recv(size)
            except Exception:  # noqa: BLE001 - the benchmark closed the endpoint
                return
            buf = np.empty(int(size[0]), dtype=np.uint8)
            await ep.recv(buf)
            await ep.send(size)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lay = KVLayout(**layout)
        cache = torch.zeros(lay.shape, dtype=lay.torch_dtype)
        receivers = {}
        for path in paths:
            transport = PATHS[path]
            registered = open_plane(cache, lay, transport, ONE_SIDED if path == ONE_SIDED else STAGED, "bench")
            receivers[path] = await KVReceiver(cache, lay, make_transport(transport), registered=registered).start()
        addresses: dict = {name: r.address for name, r in receivers.items()}
        listener = None  # held for as long as this serves: a listener nobody holds is closed
        if raw:
            import ucxx

            listener = ucxx.create_listener(raw_handler)
            addresses["raw"] = listener.port
        commands: asyncio.Queue = asyncio.Queue()
        threading.Thread(
            target=lambda: [loop.call_soon_threadsafe(commands.put_nowait, pipe.recv()) for _ in iter(int, 1)],
            daemon=True,
        ).start()
        pipe.send(addresses)
        while True:
            cmd = await commands.get()
            if cmd[0] == "stop":
                for r in receivers.values():
                    await r.close()
                pipe.send("stopped")
                return
            if cmd[0] == "raw_read":
                pipe.send(await asyncio.to_thread(_raw_reads, *cmd[1:]))
                continue
            _, name, rid, blocks = cmd
            receivers[name].expect(rid, blocks, "bench")
            pipe.send("ready")

    asyncio.run(main())
    from pdserve.kvtransfer.backends import shutdown_transports

    shutdown_transports()  # ucxx's notifier thread would keep this process from exiting


def _raw_reads(descriptor: dict, nbytes: int, repeats: int) -> list[float]:
    """GB/s of single NIXL READs of `nbytes` from the start of a peer's registered cache into a registered buffer
    here: the one-sided ceiling on this host, with no pdserve in the way."""
    from pdserve.kvtransfer.registered import _nixl, without_ucxx_settings

    nixl = _nixl()
    with without_ucxx_settings():  # the same UCX settings pdserve's agents get
        agent = nixl.nixl_agent("bench-raw", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(base64.b64decode(descriptor["metadata"]))
    local = agent.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(descriptor["base"], nbytes, 0)], "DRAM")
    out = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        agent.release_xfer_handle(handle)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    agent.remove_remote_agent(peer)
    return out[1:]


async def _raw_ucxx(port: int, nbytes: int, repeats: int) -> list[float]:
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    buf = np.random.randint(0, 255, nbytes, dtype=np.uint8)
    ack = np.empty(1, dtype=np.uint64)
    out = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        await ep.send(np.array([nbytes], dtype=np.uint64))
        await ep.send(buf)
        await ep.recv(ack)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    await ep.close()
    return out[1:]


def receiver_process(layout: dict, paths: tuple[str, ...], raw: bool = False):
    """A spawned process serving `_receiver`: (process, pipe, addresses by path, "raw" with `raw`)."""
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, layout, paths, raw), daemon=True)
    proc.start()
    child.close()  # the child's end lives in the child: if it dies, recv here fails instead of waiting forever
    return proc, pipe, pipe.recv()


def stop_receiver(proc, pipe) -> None:
    pipe.send(("stop",))
    pipe.recv()
    proc.join(10)


async def pdserve_seconds(sender, address: str, pipe, name: str, blocks: int, repeats: int) -> list[float]:
    """Seconds of `repeats` transfers of `blocks` blocks (after one not counted), each one request: every layer
    queued from a thread as the forward pass does, timed from the first layer to the receiver's acknowledgement."""
    out = []
    for r in range(repeats + 1):
        rid = f"{name}-{blocks}-{r}"
        ids = list(range(blocks))
        pipe.send(("expect", name, rid, ids))
        assert await asyncio.to_thread(pipe.recv) == "ready"
        await sender.connect(address)
        sender.begin(rid, address, ids, "bench")
        t0 = time.perf_counter()

        def push(rid: str = rid) -> None:
            for layer in range(sender.layout.num_layers):
                sender.send_layer(rid, layer)

        await asyncio.to_thread(push)
        await sender.finish(rid)
        out.append(time.perf_counter() - t0)
    return out[1:]


def _memcpy(nbytes: int, repeats: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    out = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from pdserve.kvtransfer.ucx_transport import _UCX_DEFAULTS

    for k, v in _UCX_DEFAULTS.items():  # the raw baseline gets the same UCX settings as pdserve
        os.environ.setdefault(k, v)

    from pdserve.kernels.kv_layout import KVLayout
    from pdserve.kvtransfer.backends import make_transport
    from pdserve.kvtransfer.registered import ONE_SIDED, STAGED, open_plane
    from pdserve.kvtransfer.sender import KVSender

    max_blocks = max(-(-t // LAYOUT["block_size"]) for t in args.tokens)
    proc, pipe, addresses = receiver_process({**LAYOUT, "num_blocks": max_blocks}, tuple(PATHS), raw=True)

    async def run() -> list[dict]:
        cache = _cache(max_blocks, random=True)
        layout = KVLayout(**LAYOUT, num_blocks=max_blocks)
        senders = {}
        for path, transport in PATHS.items():
            registered = open_plane(cache, layout, transport, ONE_SIDED if path == ONE_SIDED else STAGED, "bench")
            senders[path] = KVSender(cache, layout, make_transport(transport), registered=registered)
        registered = senders[ONE_SIDED].registered
        assert registered is not None
        rows = []
        print(
            f"{'tokens':>6} {'MiB':>6} {'memcpy':>7} {'raw ucxx':>8} {'raw read':>8} {'one-sided':>9} {'staged':>7}"
            f" {'tcp':>6} {'1s/ucxx':>7} {'1s/read':>7}   GB/s, median of {args.repeats}"
        )
        for tokens in args.tokens:
            blocks = -(-tokens // LAYOUT["block_size"])
            nbytes = blocks * layout.block_nbytes
            registered.serving(+1)  # the raw reader is one more peer this cache must progress for
            pipe.send(("raw_read", registered.descriptor.to_dict(), nbytes, args.repeats))
            raw_read = await asyncio.to_thread(pipe.recv)
            registered.serving(-1)
            row = {
                "tokens": tokens,
                "bytes": nbytes,
                "memcpy": statistics.median(_memcpy(nbytes, args.repeats)),
                "raw_ucxx": statistics.median(await _raw_ucxx(addresses["raw"], nbytes, args.repeats)),
                "raw_read": statistics.median(raw_read),
            }
            for name, sender in senders.items():
                seconds = await pdserve_seconds(sender, addresses[name], pipe, name, blocks, args.repeats)
                row[name] = statistics.median(nbytes / t / 1e9 for t in seconds)
            row["one_sided_over_raw_ucxx"] = row[ONE_SIDED] / row["raw_ucxx"]
            row["one_sided_over_raw_read"] = row[ONE_SIDED] / row["raw_read"]
            rows.append(row)
            print(
                f"{tokens:>6} {nbytes / 2**20:>6.1f} {row['memcpy']:>7.2f} {row['raw_ucxx']:>8.2f} "
                f"{row['raw_read']:>8.2f} {row[ONE_SIDED]:>9.2f} {row['staged']:>7.2f} {row['tcp']:>6.2f} "
                f"{row['one_sided_over_raw_ucxx']:>7.2f} {row['one_sided_over_raw_read']:>7.2f}",
                flush=True,
            )
        for s in senders.values():
            await s.close()
        return rows

    rows = asyncio.run(run())
    stop_receiver(proc, pipe)
    from pdserve.kvtransfer.backends import shutdown_transports

    shutdown_transports()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layout": LAYOUT, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
