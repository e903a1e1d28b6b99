"""Several choices for one prompt (OpenAI's `n` and `best_of`): one request per choice, the prompt computed once.

Each choice runs as a request of its own through the request path (routing, migration and stop strings per choice),
as vLLM does it. The first choice runs alone until its first token: by then its prompt's KV blocks are in the prefix
cache of the worker that computed them, and the KV-aware router sends the other choices there, so each of them
computes only the prompt's last, partial block (`usage.prompt_tokens_details.cached_tokens` and the workers' prefix
hit counters show it). The choices also share one decode worker (`DecodeAffinity`), which registered the prompt's
blocks in its own prefix cache when they landed: the others reserve those blocks and are sent only the rest, so the
prompt's KV crosses the network, and sits in the decode worker's cache, once. A seeded request's choice i draws
with seed + i: the choices differ, and the same seed repeats all of them. One choice's failure fails the request;
leaving early cancels every choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator

from pdserve.gateway.request import DecodeAffinity, Delta, GenerationRequest
from pdserve.gateway.request_path import RequestPath
from pdserve.protos import common_pb2


def children(req: GenerationRequest, count: int) -> list[GenerationRequest]:
    """`count` requests for the choices of `req` (itself the first when count is 1)."""
    if count == 1:
        return [req]
    out = []
    affinity = DecodeAffinity()
    for i in range(count):
        child = copy.copy(req)
        child.affinity = affinity
        child.request_id = f"{req.request_id}-{i}"
        child.sampling = common_pb2.SamplingParams()
        child.sampling.CopyFrom(req.sampling)
        if req.sampling.HasField("seed"):
            child.sampling.seed = (req.sampling.seed + i) % 2**64
        out.append(child)
    return out


async def run(path: RequestPath, reqs: list[GenerationRequest], front: str) -> AsyncIterator[tuple[int, Delta]]:
    """Every choice's deltas, tagged with its index, as they come; the first choice alone until its first token."""
    if len(reqs) == 1:
        async for delta in path.run(reqs[0], front):
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | None | BaseException]] = asyncio.Queue()
    first_token = asyncio.Event()

    async def one(i: int) -> None:
        if i:
            await first_token.wait()
        try:
            async for delta in path.run(reqs[i], front):
                first_token.set()
                queue.put_nowait((i, delta))
            queue.put_nowait((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, e))
        finally:
            first_token.set()  # however the first choice ended, the others do not wait on it

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(reqs))]
    try:
        running = len(reqs)
        while running:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def merged_usage(usages: list[common_pb2.Usage]) -> common_pb2.Usage:
    """One prompt, every choice's tokens: the prompt counts once (as the first choice computed it)."""
    first = usages[0]
    return common_pb2.Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_prompt_tokens=first.cached_prompt_tokens,
    )


def mean_logprob(deltas: list[Delta]) -> float:
    """A choice's mean token logprob (best_of's ranking, OpenAI's "highest log probability per token")."""
    values = [lp.logprob for d in deltas for lp in d.logprobs]
    return sum(values) / len(values) if values else float("-inf")
