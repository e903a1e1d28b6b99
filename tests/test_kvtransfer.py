"""kvtransfer between real spawned processes on 127.0.0.1, over UCX and over TCP."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

from pdserve.kernels.kv_layout import KVLayout, LayoutMismatch
from pdserve.kvtransfer.transport import parse_address
from tests.kv_peers import LAYOUT, make_cache, receiver_main, sender_main

CTX = mp.get_context("spawn")
RECV_BLOCKS, SEND_BLOCKS = 64, 48
WAIT = 30.0


def _transports() -> list[str]:
    """tcp; ucx (staged); ucx+one-sided (registered caches, NIXL) where those are installed."""
    ucx = ["ucx"] if importlib.util.find_spec("ucxx") else []
    if ucx and (importlib.util.find_spec("nixl_cu13") or importlib.util.find_spec("nixl_cu12")):
        ucx.append("ucx+one-sided")
    return ucx + ["tcp"]


TRANSPORTS = pytest.mark.parametrize("transport", _transports())
PATH = {"tcp": "tcp", "ucx": "staged", "ucx+one-sided": "one-sided"}


class Peer:
    """A spawned process and its end of the command pipe."""

    def __init__(self, target, *args) -> None:
        self.pipe, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def expect(self, kind: str, timeout: float = WAIT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pipe.poll(0.1):
                msg = self.pipe.recv()
                if msg[0] == kind:
                    return msg
                raise AssertionError(f"expected {kind}, got {msg}")
            if not self.proc.is_alive():
                raise AssertionError(f"process died (exit {self.proc.exitcode}) while waiting for {kind}")
        raise AssertionError(f"no {kind} within {timeout}s")

    def collect(self, kinds: set[str], n: int, timeout: float = WAIT) -> list:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            if self.pipe.poll(0.1):
                msg = self.pipe.recv()
                assert msg[0] in kinds, msg
                out.append(msg)
        assert len(out) == n, f"got {out}"
        return out

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


@pytest.fixture
def env_loopback(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")


def _receiver(transport: str, timeout: float = WAIT, layout: dict = LAYOUT) -> tuple[Peer, str]:
    peer = Peer(receiver_main, transport, layout, RECV_BLOCKS, timeout)
    return peer, peer.expect("address")[1]


def _wait_landed(peer: Peer, rid: str, layers: int) -> None:
    """Until the receiver reports `layers` layers of `rid` landed (bounded by WAIT)."""
    deadline = time.monotonic() + WAIT
    while True:
        peer.pipe.send(("progress", rid))
        if peer.expect("progress")[1] >= layers:
            return
        assert time.monotonic() < deadline, f"{rid}: fewer than {layers} layers landed within {WAIT}s"
        time.sleep(0.05)


def _stop_receiver(peer: Peer) -> list[str]:
    peer.pipe.send(("stop",))
    leftover = peer.expect("stopped")[1]
    peer.proc.join(10)
    return leftover


JOBS = [  # (request id, source blocks in the sender, destination blocks in the receiver)
    ("contiguous", list(range(0, 6)), list(range(10, 16))),
    ("scattered", [7, 3, 30, 31, 12], [40, 2, 17, 18, 63]),
    ("src-scattered", [44, 20, 21], [20, 21, 22]),
    ("one-block", [47], [0]),
]


@TRANSPORTS
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_blocks_arrive_bit_exact_with_several_requests_in_flight(transport, device, env_loopback):
    """Contiguous and scattered blocks, several requests at once; with CUDA, both caches in device memory."""
    layout = {**LAYOUT, "device": device}
    recv, address = _receiver(transport, layout=layout)
    sender = None
    try:
        for rid, _, dst in JOBS:
            recv.pipe.send(("expect", rid, dst, None))
        sender = Peer(sender_main, transport, layout, SEND_BLOCKS, address, JOBS, 1234, WAIT)
        sent = sender.collect({"sent"}, len(JOBS))
        assert sender.expect("connections")[1] == 1, "one connection per sender/receiver pair"
        assert sender.expect("finished")[1] == []
        done = {m[1]: m[2] for m in recv.collect({"done"}, len(JOBS))}
        source = make_cache(SEND_BLOCKS, 1234, LAYOUT)  # the same values, on the host
        block_bytes = source[0, 0, 0].numel() * source.element_size()
        for rid, src, dst in JOBS:
            recv.pipe.send(("read", dst))
            got = recv.expect("blocks")[1]
            assert torch.equal(got, source[:, :, src]), rid
            assert done[rid]["bytes"] == LAYOUT["num_layers"] * 2 * len(src) * block_bytes
            assert done[rid]["layers"] == LAYOUT["num_layers"]
            assert done[rid]["path"] == PATH[transport], "the receiver says which path the blocks took"
        assert {m[1] for m in sent} == {j[0] for j in JOBS}
        assert {m[2]["path"] for m in sent} == {PATH[transport]}
        assert _stop_receiver(recv) == []
    finally:
        recv.stop()
        if sender:
            sender.stop()


@TRANSPORTS
def test_layout_mismatch_is_refused(transport, env_loopback):
    recv, address = _receiver(transport)
    sender = None
    try:
        other = dict(LAYOUT, head_dim=16)
        recv.pipe.send(("expect", "r", [1, 2], None))
        sender = Peer(sender_main, transport, other, SEND_BLOCKS, address, [("r", [1, 2], [1, 2])], 0, WAIT)
        msg = sender.expect("send_failed")
        assert msg[2] == "LayoutMismatch" and "head_dim" in msg[3]
        recv.pipe.send(("stats",))
        assert recv.expect("stats")[1] == 1  # still waiting: nothing was written
    finally:
        recv.stop()
        if sender:
            sender.stop()


def test_layout_fingerprint_ignores_pool_size_only():
    a = KVLayout(**LAYOUT, num_blocks=10)
    assert a.fingerprint == KVLayout(**LAYOUT, num_blocks=99).fingerprint
    b = KVLayout(**dict(LAYOUT, dtype="bfloat16"))
    assert a.fingerprint != b.fingerprint
    with pytest.raises(LayoutMismatch, match="dtype"):
        a.check_compatible(b)


@TRANSPORTS
def test_killed_sender_fails_only_its_request_and_receiver_serves_next(transport, env_loopback):
    recv, address = _receiver(transport)
    stalled = ok = None
    try:
        recv.pipe.send(("expect", "victim", list(range(0, 6)), None))
        stalled = Peer(
            sender_main,
            transport,
            LAYOUT,
            SEND_BLOCKS,
            address,
            [("victim", list(range(6)), list(range(6)))],
            7,
            WAIT,
            2,
        )
        stalled.expect("stalled")
        _wait_landed(recv, "victim", 2)  # the receiver holds part of the request: it knows who was feeding it
        os.kill(stalled.proc.pid, signal.SIGKILL)
        msg = recv.expect("failed")
        assert msg[1] == "victim" and msg[2] == "PeerDisconnected"
        job = ("next", [5, 9, 11], [30, 31, 32])
        recv.pipe.send(("expect", job[0], job[2], None))
        ok = Peer(sender_main, transport, LAYOUT, SEND_BLOCKS, address, [job], 99, WAIT)
        assert ok.expect("sent")[1] == "next"
        assert recv.expect("done")[1] == "next"
        recv.pipe.send(("read", job[2]))
        assert torch.equal(recv.expect("blocks")[1], make_cache(SEND_BLOCKS, 99, LAYOUT)[:, :, job[1]])
        assert _stop_receiver(recv) == []
    finally:
        for p in (recv, stalled, ok):
            if p:
                p.stop()


@TRANSPORTS
def test_receiver_times_out_a_transfer_that_never_completes(transport, env_loopback):
    recv, address = _receiver(transport)
    try:
        recv.pipe.send(("expect", "never", [1, 2, 3], 0.5))
        msg = recv.expect("failed", timeout=10)
        assert msg[1:3] == ("never", "TransferTimeout")
        recv.pipe.send(("stats",))
        assert recv.expect("stats")[1] == 0
    finally:
        recv.stop()


@TRANSPORTS
def test_late_messages_for_cancelled_request_are_discarded(transport, env_loopback):
    recv, address = _receiver(transport)
    sender = None
    try:
        recv.pipe.send(("expect", "gone", [1, 2], None))
        recv.pipe.send(("cancel", "gone"))
        assert recv.expect("failed")[2] == "TransferCancelled"
        sender = Peer(sender_main, transport, LAYOUT, SEND_BLOCKS, address, [("gone", [1, 2], [1, 2])], 3, WAIT)
        msg = sender.expect("send_failed")
        assert msg[1] == "gone" and "not expected" in msg[3]
        recv.pipe.send(("read", [1, 2]))
        assert torch.count_nonzero(recv.expect("blocks")[1]) == 0
        recv.pipe.send(("stats",))
        assert recv.expect("stats")[2] >= 1
    finally:
        recv.stop()
        if sender:
            sender.stop()


def test_sender_fails_within_timeout_when_receiver_never_answers():
    """A peer that accepts the connection but never speaks (TCP transport; the failure path is shared)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    port = silent.getsockname()[1]
    peer = Peer(sender_main, "tcp", LAYOUT, SEND_BLOCKS, f"tcp://127.0.0.1:{port}", [("r", [1], [1])], 0, 1.0)
    try:
        msg = peer.expect("send_failed")
        assert msg[2] == "TransferTimeout"
        assert peer.expect("connections")[1] == 0
        assert peer.expect("finished")[1] == []
    finally:
        peer.stop()
        silent.close()


def test_parse_address():
    assert parse_address("ucx://127.0.0.1:5000") == ("ucx", "127.0.0.1", 5000)
    with pytest.raises(ValueError):
        parse_address("127.0.0.1:5000")


@TRANSPORTS
def test_wrong_secret_writes_nothing_and_closes_only_that_connection(transport, env_loopback):
    """A sender that knows the address and the transfer id but not its secret is cut off before a byte lands;
    the transfer still completes from the sender that holds the secret."""
    recv, address = _receiver(transport)
    intruder = honest = None
    try:
        recv.pipe.send(("expect", "t", [3, 4], None))
        intruder = Peer(
            sender_main, transport, LAYOUT, SEND_BLOCKS, address, [("t", [1, 2], [3, 4])], 5, WAIT, None, "a-guess"
        )
        failed = intruder.expect("send_failed")
        assert failed[1] == "t"
        recv.pipe.send(("read", [3, 4]))
        assert torch.count_nonzero(recv.expect("blocks")[1]) == 0
        honest = Peer(sender_main, transport, LAYOUT, SEND_BLOCKS, address, [("t", [1, 2], [3, 4])], 6, WAIT)
        assert honest.expect("sent")[1] == "t"
        assert recv.expect("done")[1] == "t"
        recv.pipe.send(("read", [3, 4]))
        assert torch.equal(recv.expect("blocks")[1], make_cache(SEND_BLOCKS, 6, LAYOUT)[:, :, [1, 2]])
    finally:
        for p in (recv, intruder, honest):
            if p:
                p.stop()


@TRANSPORTS
def test_long_transfer_ids_and_headers_keep_the_connection_healthy(transport, env_loopback):
    """Headers longer than one UCX frame (a 128-character id, a long block list) frame correctly; several such
    transfers share one connection."""
    recv, address = _receiver(transport)
    sender = None
    try:
        jobs = [(c * 128, [i, 40 - i], [i * 2, i * 2 + 1]) for i, c in enumerate("abc")]
        jobs.append(("d" * 100, list(range(30, 46)), list(range(45, 61))))
        for rid, _, dst in jobs:
            recv.pipe.send(("expect", rid, dst, None))
        sender = Peer(sender_main, transport, LAYOUT, SEND_BLOCKS, address, jobs, 8, WAIT)
        assert {m[1] for m in sender.collect({"sent"}, len(jobs))} == {j[0] for j in jobs}
        assert {m[1] for m in recv.collect({"done"}, len(jobs))} == {j[0] for j in jobs}
        source = make_cache(SEND_BLOCKS, 8, LAYOUT)
        for rid, src, dst in jobs:
            recv.pipe.send(("read", dst))
            assert torch.equal(recv.expect("blocks")[1], source[:, :, src]), rid
    finally:
        recv.stop()
        if sender:
            sender.stop()


def _raw_tcp(address: str, messages: list[bytes]) -> bytes:
    """Send raw bytes to a TCP receiver; return what it answers before it closes the connection."""
    _, host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=WAIT) as s:
        for m in messages:
            s.sendall(m)
        s.settimeout(WAIT)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        return got


def _frame(header: dict) -> bytes:
    import json
    import struct

    blob = json.dumps(header).encode()
    return struct.pack("!I", len(blob)) + blob


def test_hostile_peer_is_cut_off_without_allocating_what_it_announces(env_loopback):
    """Oversized headers, junk, and a layer message announcing 10**12 blocks each close the connection at once;
    the receiver keeps serving honest senders."""
    import struct

    recv, address = _receiver("tcp")
    sender = None
    try:
        hello = _frame({"type": "hello", "layout": dict(LAYOUT, num_blocks=1)})
        assert _raw_tcp(address, [struct.pack("!I", 1 << 31)]) == b""  # a 2 GiB header: refused unread
        assert _raw_tcp(address, [_frame({"type": "hello", "layout": "nope"})]) == b""
        answer = _raw_tcp(address, [hello, _frame({"type": "layer", "req": "x", "layers": [0], "blocks": 10**12})])
        assert b"hello_ok" in answer  # it got as far as the handshake, then was closed
        answer = _raw_tcp(address, [hello, b"\x00\x00\x00\x05[1,2]"])
        assert b"hello_ok" in answer
        job = ("after", [5, 9], [7, 8])
        recv.pipe.send(("expect", job[0], job[2], None))
        sender = Peer(sender_main, "tcp", LAYOUT, SEND_BLOCKS, address, [job], 11, WAIT)
        assert sender.expect("sent")[1] == "after"
        assert recv.expect("done")[1] == "after"
        recv.pipe.send(("read", job[2]))
        assert torch.equal(recv.expect("blocks")[1], make_cache(SEND_BLOCKS, 11, LAYOUT)[:, :, job[1]])
    finally:
        recv.stop()
        if sender:
            sender.stop()
