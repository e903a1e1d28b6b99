"""One request's path through the gateway, whatever front door it came in by (gRPC or the OpenAI HTTP API).

Validate (byte sizes before any tokenizing), tokenize off the event loop, pick a decode and a prefill worker,
stream from the decode worker (retrying elsewhere if a worker refuses before the first token; moving the
request, prompt and tokens so far, to another decode worker if its stream breaks after it: migration), detokenize
incrementally, hold back text that could begin a stop string, and end with a finish reason and usage. Every
failure is a `RequestError` carrying the gRPC status it maps to and, for bad input, the parameter at fault;
the front doors only translate. Metrics, the request log line and the span attributes are recorded here, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from pdserve.engine.sampling_params import InvalidParameter
from pdserve.failure import FAILED_ADDRESS, FAILED_PARTY, HANDED_BACK, INVALID_PARAMETER
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.observe import RequestWatch
from pdserve.gateway.router import NoWorkerAvailable, RouteLease, Router, WorkerHandle, WorkerKey
from pdserve.gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.protos import common_pb2, worker_pb2
from pdserve.wire import sampling_from_proto

log = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# a stream that broke with one of these after its first token moves to another decode worker
MIGRATABLE = {
    *RETRYABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS,
}
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID = 128
MAX_MESSAGES = 4096  # a chat longer than this is refused before its template is rendered
FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class RequestError(Exception):
    """Why a request failed: a gRPC status, a message for the caller, and the parameter at fault if any."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def invalid(param: str | None, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


@dataclass
class GenerationRequest:
    """Exactly one of `prompt`, `messages`, `token_ids`. `sampling` is what the workers get (no stop strings);
    `stop` strings are applied here."""

    request_id: str
    sampling: common_pb2.SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    model: str = ""
    deadline: float | None = None  # time.monotonic() by which the request must end


@dataclass
class Delta:
    """What one streamed message carries; the last one has `finish_reason` and `usage`."""

    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    finish_reason: str | None = None
    usage: common_pb2.Usage | None = None


class RequestPath:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        router: Router,
        max_attempts: int = 3,
        max_prompt_bytes: int = 1 << 20,
        migration_limit: int = 3,
        migration_max_tokens: int = 32768,
        worker_wait: float = 10.0,
        tracer: trace.Tracer | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.router = router
        self.max_attempts = max_attempts
        self.migration_limit = migration_limit
        self.migration_max_tokens = migration_max_tokens
        self.worker_wait = worker_wait  # seconds a request waits for a healthy worker before it fails
        self.max_prompt_bytes = max_prompt_bytes
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or GatewayMetrics()
        self._tokenize = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    # ---- validation and tokens ---------------------------------------------------------------------------

    def check(self, req: GenerationRequest) -> None:
        """What can be checked without tokenizing: sizes first, so a huge input costs nothing."""
        if req.model and req.model != self.model_name:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"model {req.model!r} does not exist; this gateway serves {self.model_name!r}",
                "model",
            )
        if len(req.request_id) > MAX_REQUEST_ID:
            raise invalid("request_id", f"request_id is {len(req.request_id)} characters; at most {MAX_REQUEST_ID}")
        if req.prompt is not None:
            size = len(req.prompt.encode())
        elif req.messages is not None:
            if not req.messages:
                raise invalid("messages", "messages is empty: a chat needs at least one message")
            if len(req.messages) > MAX_MESSAGES:
                raise invalid("messages", f"messages has {len(req.messages)} entries; at most {MAX_MESSAGES}")
            # every message costs its role and the template's framing, not only its content
            size = sum(len(str(m.get("content", "")).encode()) + len(str(m.get("role", ""))) + 16 for m in req.messages)
        else:
            size = 4 * len(req.token_ids or [])
        if size > self.max_prompt_bytes:
            raise invalid(
                "prompt" if req.messages is None else "messages",
                f"the prompt is {size} bytes; this gateway takes at most {self.max_prompt_bytes}",
            )
        if len(req.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LENGTH for s in req.stop):
            raise invalid(
                "stop",
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} characters",
            )
        try:  # the engine's own rules, here before any work is done (the workers, which know the model, recheck)
            sampling_from_proto(req.sampling).validate()
        except InvalidParameter as e:
            raise invalid(e.param, str(e)) from None

    async def prompt_ids(self, req: GenerationRequest) -> list[int]:
        self.check(req)
        loop = asyncio.get_running_loop()
        if req.prompt is not None:
            ids = await loop.run_in_executor(self._tokenize, self.tokenizer.encode, req.prompt)
        elif req.messages is not None:
            try:
                ids = await loop.run_in_executor(self._tokenize, self.tokenizer.apply_chat_template, req.messages)
            except Exception as e:  # noqa: BLE001 - template errors are the caller's input
                raise invalid("messages", f"the chat template failed on these messages: {e}") from None
        else:
            ids = list(req.token_ids or [])
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise invalid("prompt", f"prompt token ids must be in [0, {vocab})")
        if not ids:
            raise invalid("prompt", "the prompt is empty")
        limit = self.router.max_model_len
        if limit and len(ids) >= limit:
            raise invalid("prompt", f"the prompt has {len(ids)} tokens; the model context is {limit}")
        return ids

    # ---- one request -------------------------------------------------------------------------------------

    async def run(self, req: GenerationRequest, front: str) -> AsyncIterator[Delta]:
        """Stream one request; its watch counts it, logs it and annotates its span, however it ended."""
        watch = RequestWatch(self.metrics, self.model_name, req.request_id, front)
        try:
            async for delta in self._generate(req, watch):
                yield delta
        except BaseException as e:
            watch.failed(e, e.code.name if isinstance(e, RequestError) else None, req.deadline)
            raise
        finally:
            watch.end()

    async def _generate(self, req: GenerationRequest, out: RequestWatch) -> AsyncIterator[Delta]:
        with self.tracer.start_as_current_span("gateway.tokenize") as span:
            prompt_ids = await self.prompt_ids(req)
            span.set_attribute("pdserve.prompt_tokens", len(prompt_ids))
        out.prompt_tokens = len(prompt_ids)
        run = _Run(req, prompt_ids, IncrementalDetokenizer(self.tokenizer.hf), StopStringMatcher(req.stop))
        tried: set[WorkerKey] = set()  # the runs of workers that failed this request (a restarted one may serve it)
        retries = 0
        moved: _Retry | None = None  # the failure a migration is under way for
        while True:
            with self.tracer.start_as_current_span("gateway.route") as span:
                lease = await self._pick(tried, run, moved)
                decode, prefill = lease.decode, lease.prefill
                span.set_attributes(
                    {
                        "pdserve.decode": decode.address,
                        "pdserve.prefill": prefill.address if prefill else "",
                        "pdserve.attempt": retries + len(run.moves),
                    }
                )
            if moved is not None:
                out.migrated(moved.reason, moved.culprit, decode.address, len(run.generated), len(run.token_ids))
                log.warning(
                    "request %s: %s; moving it to %s after %d tokens",
                    req.request_id,
                    moved.error.message,
                    decode.address,
                    len(run.generated),
                )
            out.routed(decode.address, prefill.address if prefill else "")
            try:
                with lease:
                    may_refuse = self.router.has_alternative(lease, tried, run.token_ids)
                    async for delta in self._stream(run, lease, out, may_refuse):
                        yield delta
                return
            except _Retry as retry:
                tried.add(self.router.key(retry.culprit))
                run.last_error = retry.error
                moved = None
                if run.generated:  # tokens were streamed: the rest comes from another decode worker, or nothing
                    if len(run.moves) >= self.migration_limit or len(run.token_ids) > self.migration_max_tokens:
                        raise self._not_moved(retry, run) from None
                    run.moves.append(retry.culprit)
                    moved = retry
                    continue
                retries += 1
                out.retried()
                if retries >= self.max_attempts:
                    raise retry.error from None
                log.warning("request %s: %s; retrying elsewhere", req.request_id, retry.error.message)

    async def _pick(self, tried: set[WorkerKey], run: _Run, moved: _Retry | None) -> RouteLease:
        """Workers for the next attempt; with none healthy now (down, restarting, or all tried), wait up to
        `worker_wait` seconds for one before failing UNAVAILABLE (or with the error that ended the last try)."""
        try:
            return self.router.pick(tried, run.token_ids)
        except NoWorkerAvailable as e:
            error = e
        if self.worker_wait > 0 and await self.router.wait_for(tried, run.token_ids, self.worker_wait):
            try:
                return self.router.pick(tried, run.token_ids)
            except NoWorkerAvailable as e:  # taken again in the moment since
                error = e
        why = f"{error} within {self.worker_wait:g}s"
        if moved is not None:
            raise self._not_moved(moved, run, f"{why} to move it to") from None
        raise run.last_error or RequestError(grpc.StatusCode.UNAVAILABLE, why) from None

    def _not_moved(self, retry: _Retry, run: _Run, why: str = "") -> RequestError:
        """The error a request ends with when its stream broke and it cannot move (again)."""
        if not why:
            if self.migration_limit == 0:
                return retry.error
            if len(run.moves) >= self.migration_limit:
                why = f"it moved {len(run.moves)} times already (--migration-limit {self.migration_limit})"
            else:
                why = (
                    f"moving it would prefill {len(run.token_ids)} tokens again "
                    f"(--migration-max-tokens {self.migration_max_tokens})"
                )
        tried = ", ".join(dict.fromkeys(run.moves or [retry.culprit]))
        return RequestError(retry.error.code, f"{retry.error.message}; not moved: {why} (workers tried: {tried})")

    async def _stream(self, run: _Run, lease: RouteLease, out: RequestWatch, may_refuse: bool) -> AsyncIterator[Delta]:
        """One decode stream: the prompt, plus (after a migration) the tokens other workers generated, which
        the worker counts as output, so max_tokens, penalties and seeded draws carry on where they stopped.
        `may_refuse`: the prompt has somewhere else to go should its prefill worker be too busy to start it."""
        req, usage, detok, matcher = run.req, run.usage, run.detok, run.matcher
        decode, prefill = lease.decode, lease.prefill
        timeout = None if req.deadline is None else max(0.0, req.deadline - time.monotonic())
        call = decode.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id=req.request_id,
                prompt_token_ids=run.token_ids,
                sampling=req.sampling,
                prefill_address=prefill.address if prefill else "",
                num_prompt_tokens=len(run.prompt_ids) if run.generated else 0,
                prefill_may_refuse=may_refuse,
            ),
            timeout=timeout,
        )
        streamed = False
        stream_id = ""
        try:
            async for resp in call:
                if not streamed:
                    if not run.moves:
                        usage.cached_prompt_tokens = resp.cached_prompt_tokens
                    stream_id = resp.stream_id
                lease.prefilled()
                streamed = True
                usage.completion_tokens += len(resp.token_ids)
                run.generated.extend(resp.token_ids)
                text = matcher.feed(detok.add(resp.token_ids))
                finish = FINISH.get(resp.finish_reason)
                if matcher.stopped and not finish:  # a stop string: the worker ends the stream as finished
                    finish = "stop"
                    await self._finish_early(decode, stream_id)
                elif finish:
                    text += matcher.feed(detok.flush()) + matcher.flush()
                out.token_sent(usage.completion_tokens, usage.cached_prompt_tokens)
                if finish:
                    out.finish_reason = finish
                    await self._drain(call)
                    yield Delta(text, list(resp.token_ids), list(resp.logprobs), finish, usage)
                    return
                yield Delta(text, list(resp.token_ids), list(resp.logprobs))
            raise RequestError(
                grpc.StatusCode.INTERNAL, f"decode worker {decode.address} ended the stream without a finish reason"
            )
        except grpc.aio.AioRpcError as e:
            raise self._failure(e, decode, prefill, streamed, bool(run.generated)) from None
        finally:
            call.cancel()  # the worker stops generating (and its client span ends) as soon as we are done

    @staticmethod
    async def _finish_early(decode: WorkerHandle, stream_id: str) -> None:
        """Tell the decode worker this stream is done (a stop string), so it records a finish, not a cancel."""
        if not stream_id:
            return
        try:
            await decode.stub.Finish(
                worker_pb2.FinishRequest(stream_id=stream_id, reason=common_pb2.FINISH_REASON_STOP), timeout=5.0
            )
        except grpc.aio.AioRpcError as e:
            log.debug("Finish on %s failed: %s", decode.address, e.code().name)

    @staticmethod
    async def _drain(call) -> None:
        """Read the decode stream to its end (a few messages at most), so the call and its client span end now
        rather than whenever the call is collected."""
        try:
            await asyncio.wait_for(_consume(call), 5.0)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass

    def _failure(
        self,
        e: grpc.aio.AioRpcError,
        decode: WorkerHandle,
        prefill: WorkerHandle | None,
        streamed: bool,
        generated: bool,
    ) -> Exception:
        """A RequestError naming the worker that failed; a _Retry when another worker could serve it instead
        (`generated`: tokens were already streamed, on this worker or an earlier one: a migration)."""
        code = e.code()
        meta = {k: v for k, v in (e.trailing_metadata() or ())}
        party = meta.get(FAILED_PARTY, "decode")
        address = meta.get(FAILED_ADDRESS) or (prefill.address if party == "prefill" and prefill else decode.address)
        if code == grpc.StatusCode.PERMISSION_DENIED and party == "prefill" and prefill is not None and not streamed:
            # this decode worker does not (yet) know that prefill worker (a pod that just scaled up): another
            # prefill worker can serve the request; the worker is not down
            return _Retry(RequestError(code, e.details() or code.name), address, "prefill_refused" if generated else "")
        if code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.FAILED_PRECONDITION,
        ):
            return RequestError(code, e.details() or code.name, meta.get(INVALID_PARAMETER))
        where = "mid-stream" if streamed else "before the first token"
        error = RequestError(code, f"{party} worker {address} failed {where}: {e.details() or code.name}")
        handed_back = HANDED_BACK in meta
        if code == grpc.StatusCode.UNAVAILABLE and not handed_back:
            self.router.mark_down(address)
        if generated:
            if code not in MIGRATABLE or self.migration_limit == 0:
                return error
            return _Retry(error, address, "drain" if handed_back else code.name.lower())
        if streamed or code not in RETRYABLE:
            return error
        return _Retry(error, address)


@dataclass
class _Run:
    """What one request has produced so far, across every worker it ran on: a migration resubmits
    `token_ids` and carries on detokenizing and matching stop strings where the broken stream stopped."""

    req: GenerationRequest
    prompt_ids: list[int]
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    generated: list[int] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)  # the decode workers it was moved away from, in order
    last_error: RequestError | None = None
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)

    def __post_init__(self) -> None:
        self.usage.prompt_tokens = len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.generated


class _Retry(Exception):
    """Another worker can take the request; `reason` is set when it already streamed (a migration)."""

    def __init__(self, error: RequestError, culprit: str, reason: str = "") -> None:
        super().__init__(error.message)
        self.error, self.culprit, self.reason = error, culprit, reason


async def _consume(call) -> None:
    async for _ in call:
        pass
