"""One request's path through the gateway, whatever front door it came in by (gRPC or the OpenAI HTTP API).

Validate (`request.check`), tokenize off the event loop, pick a decode and a prefill worker, stream from the decode
worker, detokenize incrementally, hold back text that could begin a stop string, and end with a finish reason and
usage. Each attempt ends in an outcome (`attempt.py`): done, retry elsewhere (a refusal before the first token),
migrate (the stream broke after it: prompt and tokens so far move to another decode worker), or fail. Metrics, the
request log line and the span attributes are recorded here, once.
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

from pdserve.finish_reason import from_proto
from pdserve.gateway.attempt import Done, Fail, Migrate, Outcome, Retry, decide
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.observe import RequestWatch
from pdserve.gateway.request import DecodeAffinity, Delta, GenerationRequest, RequestError, check, invalid
from pdserve.gateway.router import NoWorkerAvailable, RouteLease, Router, WorkerHandle, WorkerKey
from pdserve.gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.options import MigrationOptions
from pdserve.protos import common_pb2, worker_pb2

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # tries before the first token, on different workers: a refusal is a hint, three a verdict


class RequestPath:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        router: Router,
        migration: MigrationOptions,
        max_prompt_bytes: int,
        tracer: trace.Tracer,
        metrics: GatewayMetrics,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.router = router
        self.migration_limit = migration.migration_limit
        self.migration_max_tokens = migration.migration_max_tokens
        self.worker_wait = migration.worker_wait  # seconds a request waits for a healthy worker before it fails
        self.max_prompt_bytes = max_prompt_bytes
        self.tracer = tracer
        self.metrics = metrics
        self._tokenize = ThreadPoolExecutor(2, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    # ---- validation and tokens ---------------------------------------------------------------------------

    def check(self, req: GenerationRequest) -> None:
        check(req, self.model_name, self.max_prompt_bytes)

    async def prompt_ids(self, req: GenerationRequest) -> list[int]:
        self.check(req)
        loop = asyncio.get_running_loop()
        if req.prompt is not None:
            ids = await loop.run_in_executor(self._tokenize, self.tokenizer.encode, req.prompt)
        elif req.messages is not None:
            try:
                ids = await loop.run_in_executor(
                    self._tokenize, self.tokenizer.apply_chat_template, req.messages, req.template_tools
                )
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
        run = _Run(req, prompt_ids, IncrementalDetokenizer(self.tokenizer), StopStringMatcher(req.stop))
        moved: Migrate | None = None  # the failure a migration is under way for
        while True:
            lease = await self._route(run, moved, out)
            attempt = _Attempt()
            with lease:
                may_refuse = self.router.has_alternative(lease, run.tried, run.token_ids)
                async for delta in self._stream(run, lease, out, may_refuse, attempt):
                    yield delta
            if isinstance(attempt.outcome, Done):
                return
            moved = self._next(run, attempt.outcome, out)

    def _next(self, run: _Run, outcome: Retry | Migrate | Fail, out: RequestWatch) -> Migrate | None:
        """Act on a failed attempt: raise the request's error at Fail, or when no attempt is left; else the
        Migrate to carry out next, or None for a retry."""
        if isinstance(outcome, Fail):
            raise outcome.error
        run.tried.add(self.router.key(outcome.culprit))
        run.last_error = outcome.error
        if isinstance(outcome, Migrate):
            if len(run.moves) >= self.migration_limit or len(run.token_ids) > self.migration_max_tokens:
                raise self._not_moved(outcome, run)
            run.moves.append(outcome.culprit)
            return outcome
        run.retries += 1
        out.retried()
        if run.retries >= MAX_ATTEMPTS:
            raise outcome.error
        log.warning("request %s: %s; retrying elsewhere", run.req.request_id, outcome.error.message)
        return None

    async def _route(self, run: _Run, moved: Migrate | None, out: RequestWatch) -> RouteLease:
        """Workers for the next attempt, in a span; a migration is counted and logged here."""
        with self.tracer.start_as_current_span("gateway.route") as span:
            lease = await self._pick(run, moved)
            decode, prefill = lease.decode, lease.prefill
            span.set_attributes(
                {
                    "pdserve.decode": decode.address,
                    "pdserve.prefill": prefill.address if prefill else "",
                    "pdserve.attempt": run.retries + len(run.moves),
                }
            )
        if moved is not None:
            out.migrated(moved.reason, moved.culprit, decode.address, len(run.generated), len(run.token_ids))
            log.warning(
                "request %s: %s; moving it to %s after %d tokens",
                run.req.request_id,
                moved.error.message,
                decode.address,
                len(run.generated),
            )
        out.routed(decode.address, prefill.address if prefill else "")
        return lease

    async def _pick(self, run: _Run, moved: Migrate | None) -> RouteLease:
        """Workers for the next attempt; with none healthy now (down, restarting, or all tried), wait up to
        `worker_wait` seconds for one before failing UNAVAILABLE (or with the error that ended the last try)."""
        affinity = run.req.affinity
        prefer = affinity.decode if affinity is not None else ""
        try:
            return self._claim(self.router.pick(run.tried, run.token_ids, prefer), affinity)
        except NoWorkerAvailable as e:
            error = e
        if self.worker_wait > 0 and await self.router.wait_for(run.tried, run.token_ids, self.worker_wait):
            try:
                return self._claim(self.router.pick(run.tried, run.token_ids, prefer), affinity)
            except NoWorkerAvailable as e:  # taken again in the moment since
                error = e
        why = f"{error} within {self.worker_wait:g}s"
        if moved is not None:
            raise self._not_moved(moved, run, f"{why} to move it to") from None
        raise run.last_error or RequestError("no_worker", why) from None

    @staticmethod
    def _claim(lease: RouteLease, affinity: DecodeAffinity | None) -> RouteLease:
        """The first of several choices names their decode worker."""
        if affinity is not None and not affinity.decode:
            affinity.decode = lease.decode.address
        return lease

    def _not_moved(self, moved: Migrate, run: _Run, why: str = "") -> RequestError:
        """The error a request ends with when its stream broke and it cannot move (again)."""
        if not why:
            if self.migration_limit == 0:
                return moved.error
            if len(run.moves) >= self.migration_limit:
                why = f"it moved {len(run.moves)} times already (--migration-limit {self.migration_limit})"
            else:
                why = (
                    f"moving it would prefill {len(run.token_ids)} tokens again "
                    f"(--migration-max-tokens {self.migration_max_tokens})"
                )
        tried = ", ".join(dict.fromkeys(run.moves or [moved.culprit]))
        return RequestError(moved.error.failure, f"{moved.error.message}; not moved: {why} (workers tried: {tried})")

    async def _stream(
        self, run: _Run, lease: RouteLease, out: RequestWatch, may_refuse: bool, attempt: _Attempt
    ) -> AsyncIterator[Delta]:
        """One decode stream, its outcome left in `attempt`: the prompt, plus (after a migration) the tokens other
        workers generated, which the worker counts as output, so max_tokens, penalties and seeded draws carry on
        where they stopped. `may_refuse`: the prompt has somewhere else to go should its prefill worker be too busy
        to start it."""
        req, decode, prefill = run.req, lease.decode, lease.prefill
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
        try:
            async for resp in call:
                if not streamed and not run.moves:
                    run.usage.cached_prompt_tokens = resp.cached_prompt_tokens
                streamed = True
                lease.prefilled()
                delta = await self._delta(run, decode, resp, out)
                if delta.finish_reason:
                    await self._drain(call)
                    attempt.outcome = Done()
                    yield delta
                    return
                yield delta
            message = f"decode worker {decode.address} ended the stream without a finish reason"
            attempt.outcome = Fail(RequestError("incomplete_stream", message))
        except grpc.aio.AioRpcError as e:
            outcome, blame = decide(
                e, decode.address, prefill.address if prefill else "", streamed, bool(run.generated)
            )
            if blame.mark_down:
                self.router.mark_down(blame.address)
            attempt.outcome = outcome
        finally:
            call.cancel()  # the worker stops generating (and its client span ends) as soon as we are done

    async def _delta(
        self, run: _Run, decode: WorkerHandle, resp: worker_pb2.DecodeResponse, out: RequestWatch
    ) -> Delta:
        """What one decode message adds for the client: text through the detokenizer and the stop strings."""
        usage = run.usage
        usage.completion_tokens += len(resp.token_ids)
        run.generated.extend(resp.token_ids)
        if resp.stream_id:
            run.stream_id = resp.stream_id
        text = run.matcher.feed(run.detok.add(resp.token_ids))
        finish = from_proto(resp.finish_reason)
        if run.matcher.stopped and not finish:  # a stop string: the worker ends the stream as finished
            finish = "stop"
            await self._finish_early(decode, run.stream_id)
        elif finish:
            text += run.matcher.feed(run.detok.flush()) + run.matcher.flush()
        out.token_sent(usage.completion_tokens, usage.cached_prompt_tokens)
        if finish:
            out.finish_reason = finish
            return Delta(text, list(resp.token_ids), list(resp.logprobs), finish, usage)
        return Delta(text, list(resp.token_ids), list(resp.logprobs))

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
    async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
        """Read the decode stream to its end (a few messages at most), so the call and its client span end now
        rather than whenever the call is collected."""
        try:
            await asyncio.wait_for(_consume(call), 5.0)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass


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
    tried: set[WorkerKey] = field(default_factory=set)  # the runs of workers that failed it (a restarted one may not)
    retries: int = 0
    stream_id: str = ""  # the current decode stream's, for an early Finish
    last_error: RequestError | None = None
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)

    def __post_init__(self) -> None:
        self.usage.prompt_tokens = len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.generated


@dataclass
class _Attempt:
    """Where a stream leaves its outcome (an async generator returns no value)."""

    outcome: Outcome = field(default_factory=lambda: Fail(RequestError("incomplete_stream", "the attempt ended early")))


async def _consume(call: grpc.aio.UnaryStreamCall) -> None:
    async for _ in call:
        pass
