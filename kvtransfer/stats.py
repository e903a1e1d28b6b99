"""Figures every transfer reports: bytes, seconds, GB/s and the path it took (the observability hooks read these).

Each side times a transfer on its own clock: `seconds` from its first layer (queued by the sender, arriving at the
receiver) to the end (the receiver's acknowledgement, the last layer landed); `tail_seconds` from its last layer to
the end, which is what the transfer adds to a request's time to first token once the forward pass is done. The
receiver also knows `wire_seconds`, the time bytes were actually moving; GB/s is taken over that when known (the
forward pass, which spaces the layers out, is not the wire's time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PATHS = ("one-sided", "staged", "tcp")


@dataclass
class TransferStats:
    request_id: str
    transport: str
    path: str = "staged"  # one of PATHS
    nbytes: int = 0
    layers: int = 0
    blocks: int = 0
    seconds: float = 0.0
    tail_seconds: float = 0.0
    wire_seconds: float = 0.0
    started_at: float = 0.0  # wall clock (time.time()) of the first layer, for spans recorded afterwards
    trace: dict = field(default_factory=dict)  # the sender's trace context, as it came in the begin message

    @property
    def gbps(self) -> float:
        seconds = self.wire_seconds or self.seconds
        return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "transport": self.transport,
            "path": self.path,
            "bytes": self.nbytes,
            "layers": self.layers,
            "blocks": self.blocks,
            "seconds": self.seconds,
            "tail_seconds": self.tail_seconds,
            "gbps": self.gbps,
        }


StatsHook = Callable[[TransferStats], None]
