"""Failures are data: the one table that says, for every way a request can fail, how each front door reports it and
what the gateway does next.

A row (`Failure`) is decided here and nowhere else: the gRPC status, the HTTP status and OpenAI error `type`/`code`,
what the gateway does before the first token (retry on another worker, or fail) and after it (migrate the stream,
or fail), who is at fault, whether the worker named is taken out of rotation, and the label metrics and logs use.

Exceptions map to rows by type (`EXCEPTIONS`, most specific first; an exception not there is a bug: `internal`). A
worker ends a failed call through `abort`, which sends the row's label in trailing metadata with the failing party
and its address; the gateway reads them back with `of_rpc` (a call that failed below the application, a worker
that died say, has no label: its gRPC status picks the row). Nothing here imports torch: the gateway loads it.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

import grpc

from pdserve.deadline import deadline_passed
from pdserve.engine.errors import EngineStopped, InvalidParameter, PoolExhausted, SamplingError
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


class Policy(enum.Enum):
    """What the gateway does with a failed attempt."""

    RETRY = "retry"  # nothing was streamed: send the request to another worker
    MIGRATE = "migrate"  # tokens were streamed: resubmit prompt + tokens so far to another decode worker
    FAIL = "fail"  # end the request with this failure


class Party(enum.Enum):
    """Who a failure is blamed on."""

    CALLER = "caller"  # the request itself (bad input, no such model, no key)
    GATEWAY = "gateway"  # the gateway could not place the request
    WORKER = "worker"  # the worker that reports it
    PEER = "peer"  # the prefill worker a decode worker called for the request


# OpenAI's error `type` and `code` for an HTTP status (a code not here: the gRPC status's name)
_OPENAI_TYPE = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_OPENAI_CODE = {
    401: "invalid_api_key",
    404: "model_not_found",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


@dataclass(frozen=True)
class Failure:
    label: str  # metric label, log field and the wire name in trailing metadata
    code: grpc.StatusCode
    http: int
    party: Party
    before_first_token: Policy = Policy.FAIL  # RETRY or FAIL
    after_first_token: Policy = Policy.FAIL  # MIGRATE or FAIL
    mark_down: bool = False  # the worker named is out of rotation until its health check answers again

    @property
    def openai_type(self) -> str:
        return _OPENAI_TYPE.get(self.http, "server_error" if self.http >= 500 else "invalid_request_error")

    @property
    def openai_code(self) -> str:
        return _OPENAI_CODE.get(self.http, self.code.name.lower())


_S = grpc.StatusCode
_CALLER, _GATEWAY, _WORKER, _PEER = Party.CALLER, Party.GATEWAY, Party.WORKER, Party.PEER
_RETRY, _MIGRATE, _FAIL = Policy.RETRY, Policy.MIGRATE, Policy.FAIL

ROWS: tuple[Failure, ...] = (
    # the caller's
    Failure("invalid_argument", _S.INVALID_ARGUMENT, 400, _CALLER),
    Failure("model_not_found", _S.NOT_FOUND, 404, _CALLER),
    Failure("unauthenticated", _S.UNAUTHENTICATED, 401, _CALLER),
    Failure("request_too_large", _S.INVALID_ARGUMENT, 413, _CALLER),
    Failure("request_timeout", _S.DEADLINE_EXCEEDED, 408, _CALLER),
    Failure("cancelled", _S.CANCELLED, 499, _CALLER),
    Failure("deadline_exceeded", _S.DEADLINE_EXCEEDED, 504, _CALLER),
    # the workers': a pair that cannot work together, a worker refusing, one gone
    Failure("layout_mismatch", _S.FAILED_PRECONDITION, 400, _WORKER),
    Failure("prefill_not_allowed", _S.PERMISSION_DENIED, 403, _PEER, _RETRY, _MIGRATE),
    Failure("permission_denied", _S.PERMISSION_DENIED, 403, _WORKER),
    Failure("pool_exhausted", _S.RESOURCE_EXHAUSTED, 429, _WORKER, _RETRY, _MIGRATE),
    Failure("queue_full", _S.RESOURCE_EXHAUSTED, 429, _WORKER, _RETRY, _MIGRATE),
    Failure("resource_exhausted", _S.RESOURCE_EXHAUSTED, 429, _WORKER, _RETRY, _MIGRATE),
    Failure("drain", _S.UNAVAILABLE, 503, _WORKER, _RETRY, _MIGRATE),  # a draining worker handed the stream back
    Failure("worker_closing", _S.UNAVAILABLE, 503, _WORKER, _RETRY, _MIGRATE, mark_down=True),
    Failure("engine_stopped", _S.UNAVAILABLE, 503, _WORKER, _RETRY, _MIGRATE, mark_down=True),
    Failure("transfer_failed", _S.UNAVAILABLE, 503, _PEER, _RETRY, _MIGRATE, mark_down=True),
    Failure("unavailable", _S.UNAVAILABLE, 503, _WORKER, _RETRY, _MIGRATE, mark_down=True),
    Failure("sampling_error", _S.INTERNAL, 500, _WORKER, _FAIL, _MIGRATE),
    Failure("internal", _S.INTERNAL, 500, _WORKER, _FAIL, _MIGRATE),
    Failure("unknown", _S.UNKNOWN, 500, _WORKER, _FAIL, _MIGRATE),
    Failure("aborted", _S.ABORTED, 500, _WORKER, _FAIL, _MIGRATE),
    Failure("data_loss", _S.DATA_LOSS, 500, _WORKER, _FAIL, _MIGRATE),
    # the gateway's own
    Failure("no_worker", _S.UNAVAILABLE, 503, _GATEWAY),
    Failure("incomplete_stream", _S.INTERNAL, 500, _WORKER),
)
BY_LABEL: dict[str, Failure] = {row.label: row for row in ROWS}

# exception type -> row, most specific first: the first type an error is an instance of decides
EXCEPTIONS: tuple[tuple[type[BaseException], str], ...] = (
    (InvalidParameter, "invalid_argument"),
    (LayoutMismatch, "layout_mismatch"),
    (PrefillNotAllowed, "prefill_not_allowed"),
    (PoolExhausted, "pool_exhausted"),
    (QueueFull, "queue_full"),
    (HandedBack, "drain"),
    (WorkerClosing, "worker_closing"),
    (EngineStopped, "engine_stopped"),
    (TransferError, "transfer_failed"),
    (SamplingError, "sampling_error"),
)

# a call that failed with no row named (the peer died, the network broke, a deadline passed): its status decides
_BY_STATUS: dict[grpc.StatusCode, str] = {
    _S.INVALID_ARGUMENT: "invalid_argument",
    _S.NOT_FOUND: "model_not_found",
    _S.UNAUTHENTICATED: "unauthenticated",
    _S.FAILED_PRECONDITION: "layout_mismatch",
    _S.PERMISSION_DENIED: "permission_denied",
    _S.CANCELLED: "cancelled",
    _S.DEADLINE_EXCEEDED: "deadline_exceeded",
    _S.UNAVAILABLE: "unavailable",
    _S.RESOURCE_EXHAUSTED: "resource_exhausted",
    _S.UNKNOWN: "unknown",
    _S.ABORTED: "aborted",
    _S.DATA_LOSS: "data_loss",
}

# trailing metadata of a failed worker call
FAILURE = "pdserve-failure"  # the row's label
FAILED_PARTY = "pdserve-failed-party"  # "decode" or "prefill"
FAILED_ADDRESS = "pdserve-failed-address"  # host:port of that worker
INVALID_PARAMETER = "pdserve-invalid-parameter"  # with invalid_argument: the request parameter at fault

OK = "ok"  # the label of a request that finished


def of(error: BaseException) -> Failure:
    """The row an exception is reported with: its type's, else `internal` (a bug, never the caller's fault)."""
    for kind, label in EXCEPTIONS:
        if isinstance(error, kind):
            return BY_LABEL[label]
    return BY_LABEL["internal"]


def for_status(code: grpc.StatusCode) -> Failure:
    """The row of a call that failed with `code` and named none."""
    return BY_LABEL[_BY_STATUS.get(code, "internal")]


def outcome(error: BaseException | None, deadline: float | None = None) -> str:
    """The label of a request that ended with `error` (None: it finished): a cancellation is `deadline_exceeded`
    when its deadline has passed, else `cancelled`."""
    if error is None:
        return OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "deadline_exceeded" if deadline_passed(deadline) else "cancelled"
    return of(error).label


@dataclass(frozen=True)
class RPCFailure:
    """What a failed worker call says about itself: its row, who failed, and the parameter at fault if any."""

    row: Failure
    party: str
    address: str
    param: str | None
    details: str


def of_rpc(error: grpc.aio.AioRpcError) -> RPCFailure:
    """A failed call's row and party, from the metadata `abort` sent (or from its status when it sent none)."""
    meta = {k: v for k, v in (error.trailing_metadata() or ()) if isinstance(v, str)}
    code = error.code()
    row = BY_LABEL.get(meta.get(FAILURE, ""))
    if row is None or row.code != code:  # a status from below the application names no row of ours
        row = for_status(code)
    return RPCFailure(
        row,
        meta.get(FAILED_PARTY, ""),
        meta.get(FAILED_ADDRESS, ""),
        meta.get(INVALID_PARAMETER),
        error.details() or code.name,
    )


def metadata(row: Failure, party: str, address: str, param: str | None = None) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a failure at `party` (`decode` or `prefill`) on `address`."""
    found = ((FAILURE, row.label), (FAILED_PARTY, party), (FAILED_ADDRESS, address))
    return found + (((INVALID_PARAMETER, param),) if param else ())


def public_metadata(row: Failure, param: str | None = None) -> tuple[tuple[str, str], ...]:
    """The trailing metadata the public gRPC API ends a failed call with: the row's label and the parameter at fault."""
    return ((FAILURE, row.label),) + (((INVALID_PARAMETER, param),) if param else ())


async def abort(
    context: grpc.aio.ServicerContext, error: BaseException, role: str, address: str, peer: str = ""
) -> None:
    """End a worker's call with `error`'s row. `role`/`address`: this worker; `peer`: the prefill worker it called
    for the request, blamed for the rows whose party is the peer. The message names the worker unless the caller's
    input is at fault (then it is the error's own, which names the parameter)."""
    row = of(error)
    if row.party is Party.PEER and peer:
        party, where = "prefill", peer
    else:
        party, where = role, address
    message = str(error) if row.party is Party.CALLER else f"{role} worker {address}: {error}"
    await context.abort(row.code, message, metadata(row, party, where, getattr(error, "param", None)))


async def pass_on(context: grpc.aio.ServicerContext, error: grpc.aio.AioRpcError, peer: str) -> None:
    """End a call with the failure of the call it made to `peer` (a prefill worker), its row and party kept."""
    failure = of_rpc(error)
    party = failure.party or "prefill"
    where = failure.address or peer
    message = failure.details if peer in failure.details else f"prefill worker {peer}: {failure.details}"
    await context.abort(failure.row.code, message, metadata(failure.row, party, where, failure.param))
