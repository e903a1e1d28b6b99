"""Why a stream ended, between the engine's names ("stop", "length", "abort") and the protos' enum: the one map."""

from __future__ import annotations

from pdserve.protos import common_pb2

TO_PROTO: dict[str | None, common_pb2.FinishReason] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FROM_PROTO: dict[int, str | None] = {v: k for k, v in TO_PROTO.items()}


def to_proto(reason: str | None) -> common_pb2.FinishReason:
    return TO_PROTO[reason]


def from_proto(value: int) -> str | None:
    """The engine's name of a proto finish reason; None for unspecified (the stream goes on) or one unknown."""
    return FROM_PROTO.get(value)
