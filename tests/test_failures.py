"""The failure table is the only place a status, a retry policy or a label is decided: every exception type a worker
can raise is walked through a real gRPC call (the worker's `abort`), the gateway's `decide`, the public gRPC front
and the OpenAI error body, and comes out with its row's status, policy, party and HTTP answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve import failures
from pdserve.engine.errors import EngineStopped, InvalidParameter, PoolExhausted, SamplingError
from pdserve.failures import (
    BY_LABEL,
    EXCEPTIONS,
    ROWS,
    HandedBack,
    Party,
    Policy,
    PrefillNotAllowed,
    QueueFull,
    WorkerClosing,
)
from pdserve.gateway.attempt import Fail, Migrate, Retry, decide
from pdserve.gateway.openai_render import error_body
from pdserve.gateway.request import RequestError
from pdserve.gateway.server import _abort as public_abort
from pdserve.grpc_server import open_channel, start_server
from pdserve.kernels.kv_layout import LayoutMismatch
from pdserve.kvtransfer.errors import PeerDisconnected, TransferError, TransferTimeout
from pdserve.protos import worker_pb2, worker_pb2_grpc

DECODE, PREFILL = "127.0.0.1:1", "127.0.0.1:2"  # the addresses the failures name (nothing listens there)

# one instance of every type the table names, a subclass of one, and an exception it does not name (a bug)
RAISED: list[tuple[BaseException, str]] = [
    (InvalidParameter("temperature", "temperature must be >= 0, got -1"), "invalid_argument"),
    (LayoutMismatch("block_size 16 != 32"), "layout_mismatch"),
    (PrefillNotAllowed(f"does not dial prefill worker {PREFILL}"), "prefill_not_allowed"),
    (PoolExhausted("no KV blocks"), "pool_exhausted"),
    (QueueFull("256 prompts already waiting"), "queue_full"),
    (HandedBack("draining"), "drain"),
    (WorkerClosing("decode worker is shutting down"), "worker_closing"),
    (EngineStopped("the engine loop died"), "engine_stopped"),
    (TransferError("no progress"), "transfer_failed"),
    (TransferTimeout("no progress within 60 s"), "transfer_failed"),
    (PeerDisconnected("the peer went away"), "transfer_failed"),
    (SamplingError("non-finite logits"), "sampling_error"),
    (RuntimeError("a bug"), "internal"),
]


def test_every_row_is_whole_and_every_exception_has_one() -> None:
    assert len(BY_LABEL) == len(ROWS), "labels are unique"
    for row in ROWS:
        assert row.before_first_token in (Policy.RETRY, Policy.FAIL), row
        assert row.after_first_token in (Policy.MIGRATE, Policy.FAIL), row
        assert 400 <= row.http < 600 and row.openai_type and row.openai_code, row
        if row.party is Party.CALLER:  # the caller's fault is never retried elsewhere or blamed on a worker
            assert row.before_first_token is Policy.FAIL and row.after_first_token is Policy.FAIL, row
            assert not row.mark_down, row
    for kind, label in EXCEPTIONS:
        assert label in BY_LABEL, kind
    assert {label for _, label in RAISED} >= {label for _, label in EXCEPTIONS}, "RAISED covers every type"
    for error, label in RAISED:
        assert failures.of(error).label == label, error


def test_outcome_labels_are_the_table_s() -> None:
    assert failures.outcome(None) == "ok"
    assert failures.outcome(asyncio.CancelledError()) == "cancelled"
    assert failures.outcome(asyncio.CancelledError(), deadline=0.0) == "deadline_exceeded"
    assert failures.outcome(QueueFull("x")) == "queue_full"
    assert failures.outcome(KeyError("x")) == "internal"


class _Failing(worker_pb2_grpc.DecodeServiceServicer):
    """A servicer that ends each call with the failure its request names, the way the workers do: as the decode
    worker, as a prefill worker (`num_prompt_tokens` 1), or as a decode worker passing on the failure of the prefill
    worker it called (`prefill_address` set)."""

    def __init__(self) -> None:
        self.inner: worker_pb2_grpc.DecodeServiceStub | None = None

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        index = int(request.request_id)
        if index < 0:  # a failure below the application: a status and no row
            await context.abort(grpc.StatusCode[_BARE[-index - 1]], "bare status")
        if request.prefill_may_refuse:  # one token first: the failure comes mid-stream
            yield worker_pb2.DecodeResponse(token_ids=[7])
        if request.prefill_address:
            assert self.inner is not None
            try:
                async for _ in self.inner.Decode(worker_pb2.DecodeRequest(request_id=str(index), num_prompt_tokens=1)):
                    pass
            except grpc.aio.AioRpcError as e:
                await failures.pass_on(context, e, PREFILL)
        if request.num_prompt_tokens == 1:
            await failures.abort(context, RAISED[index][0], "prefill", PREFILL)
        await failures.abort(context, RAISED[index][0], "decode", DECODE, peer=PREFILL)


_BARE = ["UNAVAILABLE", "DEADLINE_EXCEEDED", "DATA_LOSS", "PERMISSION_DENIED"]


async def _call(
    stub: worker_pb2_grpc.DecodeServiceStub, index: int, mid_stream: bool, relay: bool = False
) -> tuple[grpc.aio.AioRpcError, bool]:
    request = worker_pb2.DecodeRequest(
        request_id=str(index), prefill_may_refuse=mid_stream, prefill_address=PREFILL if relay else ""
    )
    call = stub.Decode(request, timeout=10)
    streamed = False
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            streamed = True
    return caught.value, streamed


async def test_every_exception_walks_through_grpc_and_http_by_its_row() -> None:
    servicer = _Failing()
    running = await start_server(
        "127.0.0.1",
        0,
        lambda s: worker_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s),
        [worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name],
        enable_reflection=False,
    )
    try:
        async with open_channel(f"127.0.0.1:{running.port}") as channel:
            stub = servicer.inner = worker_pb2_grpc.DecodeServiceStub(channel)
            for index, (error, label) in enumerate(RAISED):
                row = BY_LABEL[label]
                for mid_stream, relay in ((False, False), (True, False), (False, True)):
                    rpc_error, streamed = await _call(stub, index, mid_stream, relay)
                    assert streamed == mid_stream
                    assert rpc_error.code() == row.code, (label, rpc_error)
                    found = failures.of_rpc(rpc_error)
                    assert found.row is row, (label, relay, found)
                    blamed = PREFILL if row.party is Party.PEER or relay else DECODE
                    assert (found.party, found.address) == ("prefill" if blamed == PREFILL else "decode", blamed)
                    assert found.param == getattr(error, "param", None)
                    outcome, blame = decide(rpc_error, DECODE, PREFILL, streamed, generated=mid_stream)
                    assert blame.address == blamed and blame.mark_down == row.mark_down
                    policy = row.after_first_token if mid_stream else row.before_first_token
                    kind = {Policy.RETRY: Retry, Policy.MIGRATE: Migrate, Policy.FAIL: Fail}[policy]
                    assert isinstance(outcome, kind), (label, mid_stream, outcome)
                    if isinstance(outcome, Migrate):
                        assert outcome.reason == label
                    await _answers_alike(outcome.error, row)
            for i, name in enumerate(_BARE):
                rpc_error, _ = await _call(stub, -i - 1, False)
                row = failures.of_rpc(rpc_error).row
                assert row is failures.for_status(grpc.StatusCode[name]) and row.code.name == name
            # a status with no row of ours is never retried on the strength of a row it did not name
            assert failures.for_status(grpc.StatusCode.PERMISSION_DENIED).before_first_token is Policy.FAIL
    finally:
        await running.server.stop(None)


async def _answers_alike(error: RequestError, row: failures.Failure) -> None:
    """The public fronts report a request's failure by its row: the gRPC status and label, the HTTP status and
    OpenAI's error shape with the parameter."""
    status, body = error_body(error)
    assert status == row.http
    assert body["error"]["type"] == row.openai_type and body["error"]["code"] == row.openai_code
    assert body["error"]["param"] == error.param

    class _Context:
        async def abort(self, code: grpc.StatusCode, message: str, metadata: tuple) -> None:
            self.aborted = (code, message, dict(metadata))

    context = _Context()
    await public_abort(context, error)  # type: ignore[arg-type]
    code, message, metadata = context.aborted
    assert code == row.code and message == error.message
    assert metadata[failures.FAILURE] == row.label
    assert metadata.get(failures.INVALID_PARAMETER) == error.param


def test_the_gateway_s_own_failures_have_rows() -> None:
    for label, status in (("model_not_found", 404), ("unauthenticated", 401), ("no_worker", 503)):
        assert error_body(RequestError(label, "x"))[0] == status
    assert error_body(RequestError("request_too_large", "x"))[1]["error"]["code"] == "request_too_large"
    with pytest.raises(KeyError):
        RequestError("no such row", "x")
