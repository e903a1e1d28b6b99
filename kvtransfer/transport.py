"""The connection interface kvtransfer speaks, whatever carries the bytes (UCX by default, plain TCP as baseline).

A message (`messages.py`) travels as a small JSON header followed by zero or more raw payloads whose sizes the
header states, so the receiver can land each payload straight into the memory it belongs to. A transport moves
headers and payloads; a header larger than MAX_HEADER bytes is refused before it is read.
"""

from __future__ import annotations

import abc
import json
import logging
import struct
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import torch

from pdserve.kvtransfer.errors import ProtocolError
from pdserve.kvtransfer.messages import Message, decode, encode

MAX_HEADER = 64 << 10
log = logging.getLogger(__name__)


def decode_header(blob: bytes | bytearray) -> dict:
    """A header's JSON object; anything else (bad JSON, a list) breaks the protocol."""
    try:
        header = json.loads(blob)
    except ValueError as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header


HEADER_LEN = struct.Struct("!I")


def frame(header: dict) -> bytes:
    """A header as it travels on a byte stream: its length, then its JSON."""
    blob = json.dumps(header).encode()
    if len(blob) > MAX_HEADER:
        raise ProtocolError(f"header of {len(blob)} bytes (at most {MAX_HEADER})")
    return HEADER_LEN.pack(len(blob)) + blob


def header_size(prefix: bytes | bytearray, peer: str) -> int:
    """The length a frame's prefix announces; ProtocolError above MAX_HEADER (refused before it is read)."""
    (size,) = HEADER_LEN.unpack(prefix)
    if size > MAX_HEADER:
        raise ProtocolError(f"{peer} announced a {size}-byte header (at most {MAX_HEADER})")
    return size


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device memory to send. Every transport moves host bytes: KV in GPU memory is staged
    through host memory on both sides (the copy waits for the forward that wrote it)."""
    return t.to("cpu")


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy; writable)."""
    if not t.is_contiguous():
        raise ValueError("payload tensors must be contiguous")
    return t.view(torch.uint8).reshape(-1).numpy()


class Connection(abc.ABC):
    """One peer-to-peer link. Not safe for concurrent senders: the caller serialises whole messages."""

    peer: str = "?"
    pipelined: bool = False  # may several send_many calls be in flight at once (posted in call order)?

    async def send(self, msg: Message, payloads: Sequence[np.ndarray] = ()) -> None:
        await self.send_header(encode(msg), payloads)

    async def send_many(self, messages: Sequence[tuple[Message, Sequence[np.ndarray]]]) -> None:
        await self.send_headers([(encode(m), p) for m, p in messages])

    async def recv(self) -> Message:
        """The next message; ProtocolError when the peer sent anything else."""
        return decode(await self.recv_header())

    @abc.abstractmethod
    async def send_header(self, header: dict, payloads: Sequence[np.ndarray] = ()) -> None: ...

    async def send_headers(self, messages: Sequence[tuple[dict, Sequence[np.ndarray]]]) -> None:
        """Send several headers (with payloads) in order; transports that can keep them all in flight at once
        override this."""
        for header, payloads in messages:
            await self.send_header(header, payloads)

    @abc.abstractmethod
    async def recv_header(self) -> dict: ...

    @abc.abstractmethod
    async def recv_into(self, buffer: np.ndarray) -> None:
        """Fill `buffer` with the next payload (exactly its size)."""

    async def recv_many(self, buffers: Sequence[np.ndarray]) -> None:
        """Fill several buffers with the next payloads, in order."""
        for b in buffers:
            await self.recv_into(b)

    @abc.abstractmethod
    async def close(self) -> None: ...


MAX_CONNECTIONS = 256  # KV connections one receiver keeps open; more are closed at once


class Listener(abc.ABC):
    host: str
    port: int
    refused: int = 0

    def refuse(self, peer: str, why: object) -> None:
        """Count a connection turned away; log the 1st, 10th, 100th... so that a flood cannot flood the log."""
        self.refused += 1
        if str(self.refused).strip("0") == "1":
            log.warning("refused %d KV connection(s) so far; the latest from %s: %s", self.refused, peer, why)

    @abc.abstractmethod
    async def close(self) -> None: ...


Handler = Callable[[Connection], Awaitable[None]]


class Transport(abc.ABC):
    name: str

    @abc.abstractmethod
    async def listen(self, host: str, port: int, handler: Handler) -> Listener: ...

    @abc.abstractmethod
    async def connect(self, host: str, port: int, timeout: float) -> Connection: ...


def parse_address(address: str) -> tuple[str, str, int]:
    """'ucx://127.0.0.1:5000' -> ('ucx', '127.0.0.1', 5000)."""
    scheme, sep, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad KV transfer address {address!r}; expected scheme://host:port")
    return scheme, host, int(port)
