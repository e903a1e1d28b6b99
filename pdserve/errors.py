"""Errors are part of the API: the project's own exception types, and the one table that maps each to a gRPC status.

Each layer defines the failures it can name (the engine's InvalidParameter, PoolExhausted, EngineStopped and
SamplingError, kvtransfer's TransferError, the KV layout's LayoutMismatch) and the services add theirs below. A
servicer asks `status_of` and aborts with what it says; anything not in the table is a bug and reaches the caller
as INTERNAL, never as a status that blames the caller's input (a stray ValueError is not INVALID_ARGUMENT).
"""

from __future__ import annotations

import grpc

from pdserve.engine.engine_loop import EngineStopped
from pdserve.engine.sampler import SamplingError
from pdserve.engine.sampling_params import InvalidParameter
from pdserve.engine.scheduler import PoolExhausted
from pdserve.kernels.kv_layout import LayoutMismatch
from pdserve.kvtransfer.errors import TransferError


class WorkerClosing(RuntimeError):
    """The worker is draining and takes no new requests."""


class HandedBack(RuntimeError):
    """A draining worker ends a stream unfinished, for the gateway to move to another worker."""


class QueueFull(RuntimeError):
    """Too many requests already wait at this worker."""


class PrefillNotAllowed(RuntimeError):
    """A decode worker was asked to dial a prefill worker it was not started with."""


# most specific first: the first class an error is an instance of decides
STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidParameter, grpc.StatusCode.INVALID_ARGUMENT),
    (LayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (PrefillNotAllowed, grpc.StatusCode.PERMISSION_DENIED),
    (PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkerClosing, grpc.StatusCode.UNAVAILABLE),
    (HandedBack, grpc.StatusCode.UNAVAILABLE),
    (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    (TransferError, grpc.StatusCode.UNAVAILABLE),
    (SamplingError, grpc.StatusCode.INTERNAL),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status a failure is reported with: its row in STATUS, else INTERNAL."""
    for kind, code in STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL
