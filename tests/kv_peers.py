"""Process entry points for the kvtransfer tests: a receiver and a sender, each in its own spawned process.

They talk to the test through a multiprocessing pipe; everything on the wire goes over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import torch

LAYOUT = dict(model="test-model", dtype="float32", num_layers=4, block_size=4, num_kv_heads=2, head_dim=8)
SECRET = "the-receivers-secret"


def _plane(transport_name: str, cache: torch.Tensor, layout, role: str):
    """`ucx+one-sided` names the UCX transport with registered caches; a bare name is the staged path."""
    from pdserve.kvtransfer.backends import make_transport
    from pdserve.kvtransfer.registered import open_plane

    name, _, plane = transport_name.partition("+")
    return make_transport(name), open_plane(cache, layout, name, plane or "staged", role)


def make_cache(num_blocks: int, seed: int | None, layout: dict) -> torch.Tensor:
    shape = (layout["num_layers"], 2, num_blocks, layout["block_size"], layout["num_kv_heads"], layout["head_dim"])
    dtype, device = getattr(torch, layout["dtype"]), layout.get("device", "cpu")
    if seed is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _other_tasks() -> list[str]:
    me = asyncio.current_task()
    return sorted(t.get_name() + ":" + repr(t.get_coro())[:60] for t in asyncio.all_tasks() if t is not me)


def receiver_main(pipe, transport_name: str, layout: dict, num_blocks: int, timeout: float) -> None:
    from pdserve.kernels.kv_layout import KVLayout
    from pdserve.kvtransfer.backends import shutdown_transports
    from pdserve.kvtransfer.receiver import KVReceiver

    async def main() -> None:
        loop = asyncio.get_running_loop()
        cache = make_cache(num_blocks, None, layout)
        kv_layout = KVLayout(**layout, num_blocks=num_blocks)
        transport, registered = _plane(transport_name, cache, kv_layout, "decode")
        recv = KVReceiver(cache, kv_layout, transport, timeout=timeout, registered=registered)
        await recv.start()
        commands: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=lambda: _pump(pipe, loop, commands), daemon=True).start()
        pipe.send(("address", recv.address))
        waiters = set()

        async def wait(rid, fut):
            try:
                stats = await fut
                pipe.send(("done", rid, stats.as_dict()))
            except Exception as e:  # noqa: BLE001 - reported to the test
                pipe.send(("failed", rid, type(e).__name__, str(e)))

        while True:
            cmd = await commands.get()
            if cmd[0] == "expect":
                _, rid, blocks, t = cmd
                task = asyncio.create_task(wait(rid, recv.expect(rid, blocks, SECRET, timeout=t)))
                waiters.add(task)
                task.add_done_callback(waiters.discard)
            elif cmd[0] == "cancel":
                recv.cancel(cmd[1])
            elif cmd[0] == "read":
                pipe.send(("blocks", cache[:, :, cmd[1]].cpu()))
            elif cmd[0] == "progress":
                pipe.send(("progress", recv.layers_landed(cmd[1])))
            elif cmd[0] == "stats":
                pipe.send(("stats", recv.num_pending, recv.discarded_messages))
            elif cmd[0] == "stop":
                await recv.close()
                await asyncio.gather(*waiters, return_exceptions=True)
                await asyncio.sleep(0.05)
                pipe.send(("stopped", _other_tasks()))
                return

    asyncio.run(main())
    shutdown_transports()


def _pump(pipe, loop, queue) -> None:
    while True:
        try:
            msg = pipe.recv()
        except EOFError:
            msg = ("stop",)
        loop.call_soon_threadsafe(queue.put_nowait, msg)
        if msg[0] == "stop":
            return


def sender_main(
    pipe,
    transport_name: str,
    layout: dict,
    num_blocks: int,
    address: str,
    jobs: list,
    seed: int,
    timeout: float,
    stall_after_layers: int | None = None,
    secret: str = SECRET,
) -> None:
    """Run every job (request id, source blocks, destination blocks) concurrently; report per-request outcome.

    With stall_after_layers, each request sends that many layers, reports "stalled", and the process waits to
    be killed.
    """
    from pdserve.kernels.kv_layout import KVLayout
    from pdserve.kvtransfer.sender import KVSender

    async def one(sender, rid, src, dst) -> None:
        try:
            await sender.connect(address)
            sender.begin(rid, address, src, secret)
            layers = layout["num_layers"] if stall_after_layers is None else stall_after_layers

            def forward() -> None:  # the forward pass's thread, layer by layer
                for layer in range(layers):
                    time.sleep(0.001)
                    sender.send_layer(rid, layer)

            await asyncio.to_thread(forward)
            if stall_after_layers is not None:
                pipe.send(("stalled", rid))
                await asyncio.sleep(3600)
            stats = await sender.finish(rid)
            pipe.send(("sent", rid, stats.as_dict()))
        except Exception as e:  # noqa: BLE001 - reported to the test
            pipe.send(("send_failed", rid, type(e).__name__, str(e)))

    async def main() -> None:
        cache = make_cache(num_blocks, seed, layout)
        kv_layout = KVLayout(**layout, num_blocks=num_blocks)
        transport, registered = _plane(transport_name, cache, kv_layout, "prefill")
        sender = KVSender(
            cache, kv_layout, transport, timeout=timeout, max_inflight_bytes=64 << 10, registered=registered
        )
        await asyncio.gather(*(one(sender, *job) for job in jobs))
        pipe.send(("connections", sender.num_connections))
        await sender.close()
        await asyncio.sleep(0.05)
        pipe.send(("finished", _other_tasks()))

    asyncio.run(main())
    os._exit(0)
