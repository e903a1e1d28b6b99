"""Figures every transfer reports: bytes, seconds, GB/s (the observability hooks read these)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    request_id: str
    transport: str
    nbytes: int = 0
    layers: int = 0
    blocks: int = 0
    seconds: float = 0.0
    started_at: float = 0.0  # wall clock (time.time()) of the first byte, for spans recorded afterwards
    trace: dict = field(default_factory=dict)  # the sender's trace context, as it came in the begin message

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "transport": self.transport,
            "bytes": self.nbytes,
            "layers": self.layers,
            "blocks": self.blocks,
            "seconds": self.seconds,
            "gbps": self.gbps,
        }


StatsHook = Callable[[TransferStats], None]
