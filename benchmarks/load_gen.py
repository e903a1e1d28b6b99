"""`pdserve bench`: an async load generator for pdserve's gateway (gRPC) and any OpenAI-compatible server.

Prompts are random token ids (so every engine sees exactly the same prompt lengths) drawn from fixed lengths,
a weighted mix of lengths, or ranges (`--range-ratio`), optionally behind a shared prefix. Requests go out at a
Poisson rate (`--request-rate`, default unlimited) under a concurrency cap (`--max-concurrency`), after
warm-up requests that are not measured. Every request asks for exactly `output_len` tokens (ignore EOS, greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.bench_stats import RequestResult, compute_metrics, format_table, parse_goodput


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    temperature: float = 0.0
    top_p: float = 1.0


def make_requests(
    n: int,
    input_lens: list[int],
    output_len: int,
    seed: int,
    weights: list[float] | None = None,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    vocab: tuple[int, int] = (1000, 32000),
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """`n` prompts of random token ids: each length drawn from `input_lens` (by `weights`), then spread
    uniformly over +-range_ratio; behind one of `num_prefixes` shared prefixes of `prefix_len` ids."""
    rng = random.Random(seed)
    lo, hi = vocab
    prefixes = [[rng.randrange(lo, hi) for _ in range(prefix_len)] for _ in range(max(1, num_prefixes))]
    out = []
    for _ in range(n):
        base = rng.choices(input_lens, weights=weights)[0] if weights else rng.choice(input_lens)
        length = max(1, rng.randint(int(base * (1 - range_ratio)), int(base * (1 + range_ratio))))
        prefix = rng.choice(prefixes)
        out.append(BenchRequest(prefix + [rng.randrange(lo, hi) for _ in range(length)], output_len))
    return out


SendFn = Callable[[BenchRequest], Awaitable[RequestResult]]


class GrpcTarget:
    """pdserve's gateway: `Generation.Generate` with token-id prompts."""

    def __init__(self, address: str, api_key: str | None = None, tls=None) -> None:
        from pdserve.client import Client

        self.client = Client(address, api_key=api_key, tls=tls)

    async def __call__(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(len(req.prompt_ids))
        start = last = time.perf_counter()
        try:
            async for resp in self.client.stream(
                prompt_token_ids=req.prompt_ids,
                max_tokens=req.output_len,
                temperature=req.temperature,
                top_p=req.top_p,
                ignore_eos=True,
            ):
                now = time.perf_counter()
                if not resp.token_ids:
                    continue
                if result.output_len == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_len += len(resp.token_ids)
            result.latency = last - start
            result.success = result.output_len > 0
        except Exception as e:  # noqa: BLE001 - a failed request is a data point
            result.error = _describe(e)
        return result

    async def close(self) -> None:
        await self.client.close()


def _describe(error: BaseException) -> str:
    """One line for a failed request (gRPC errors: status and details, not the whole debug string)."""
    code, details = getattr(error, "code", None), getattr(error, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(error).__name__}: {error}"


def parse_sse(buffer: bytes) -> tuple[list[dict | str], bytes]:
    """Split complete `data:` events off an SSE byte buffer: (events, rest). `[DONE]` comes back as a string."""
    events: list[dict | str] = []
    while b"\n\n" in buffer:
        raw, buffer = buffer.split(b"\n\n", 1)
        for line in raw.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events, buffer


class OpenAITarget:
    """Any OpenAI-compatible server's streaming `/v1/completions` (vLLM, SGLang, TGI, ...)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        import aiohttp

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600), headers=headers)

    def body(self, req: BenchRequest) -> dict:
        return {
            "model": self.model,
            "prompt": req.prompt_ids,
            "max_tokens": req.output_len,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def _stream(self, url: str, body: dict, result: RequestResult, start: float) -> None:
        last = start
        chunks = 0
        async with self.session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            buffer = b""
            async for piece in resp.content.iter_any():
                buffer += piece
                events, buffer = parse_sse(buffer)
                for event in events:
                    if not isinstance(event, dict):  # "[DONE]"
                        continue
                    now = time.perf_counter()
                    if event.get("choices") and event["choices"][0].get("text") is not None:
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                    if event.get("usage"):
                        result.output_len = event["usage"]["completion_tokens"]
        result.output_len = result.output_len or chunks
        result.latency = last - start
        result.success = chunks > 0

    async def __call__(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(len(req.prompt_ids))
        try:
            await self._stream(self.url, self.body(req), result, time.perf_counter())
        except Exception as e:  # noqa: BLE001
            result.error = _describe(e)
        return result

    async def close(self) -> None:
        await self.session.close()


class LlamaCppTarget(OpenAITarget):
    """llama-cpp-python's server: the same streaming `/v1/completions`, but its prompt is text only (the ids are
    decoded with the model's tokenizer, which the server's GGUF tokenizer re-encodes to about as many tokens), and
    it has no `ignore_eos`, so EOS is banned by a logit bias (what `ignore_eos` amounts to under greedy decoding)."""

    def __init__(self, base_url: str, model: str, eos_token_id: int, decode: Callable[[list[int]], str]) -> None:
        super().__init__(base_url, model)
        self.eos_token_id = eos_token_id
        self.decode = decode

    def body(self, req: BenchRequest) -> dict:
        body = super().body(req)
        del body["ignore_eos"], body["stream_options"]
        body["prompt"] = self.decode(req.prompt_ids)
        body["logit_bias"] = {str(self.eos_token_id): -1e4}
        return body


class OpenAIDisaggTarget(OpenAITarget):
    """vLLM's disaggregated serving as its proxy drives it: a 1-token prefill leg on the producer with
    `do_remote_decode`, then the streamed decode leg on the consumer with the returned `kv_transfer_params`."""

    def __init__(self, prefill_url: str, decode_url: str, model: str) -> None:
        super().__init__(decode_url, model)
        self.prefill_url = prefill_url.rstrip("/") + "/v1/completions"

    async def __call__(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(len(req.prompt_ids))
        start = time.perf_counter()
        try:
            leg = {
                "model": self.model,
                "prompt": req.prompt_ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "stream": False,
                "kv_transfer_params": {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                },
            }
            async with self.session.post(self.prefill_url, json=leg) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"prefill leg HTTP {resp.status}: {(await resp.text())[:300]}")
                params = (await resp.json()).get("kv_transfer_params")
            body = self.body(req)
            body["kv_transfer_params"] = params
            await self._stream(self.url, body, result, start)
        except Exception as e:  # noqa: BLE001
            result.error = _describe(e)
        return result


class Progress:
    """A one-line progress bar on a terminal (stderr); silent when stderr is not one."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.total = total
        self.done = self.failed = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._shown = 0.0

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.success
        now = time.monotonic()
        if self.enabled and (now - self._shown > 0.2 or self.done == self.total):
            self._shown = now
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} requests"
                + (f", {self.failed} failed" if self.failed else "")
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(
    send: SendFn,
    requests: list[BenchRequest],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    warmups: Sequence[BenchRequest] = (),
    progress: Progress | None = None,
) -> tuple[list[RequestResult], float, int]:
    """Send `requests` (Poisson arrivals at `request_rate`/s, or all at once for inf) under a concurrency cap;
    returns (results in request order, measured duration, highest concurrency seen)."""
    if warmups:
        await asyncio.gather(*(send(w) for w in warmups))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    active = peak = 0

    async def one(req: BenchRequest) -> RequestResult:
        nonlocal active, peak
        if limit:
            await limit.acquire()
        active += 1
        peak = max(peak, active)
        try:
            result = await send(req)
            if progress is not None:
                progress.update(result)
            return result
        finally:
            active -= 1
            if limit:
                limit.release()

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, peak


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        default="pdserve",
        choices=["pdserve", "openai", "openai-pd"],
        help="pdserve: the gateway's gRPC API; openai: /v1/completions of any OpenAI-compatible server; "
        "openai-pd: vLLM disaggregated (--base-url is the decode server, --prefill-url the prefill)",
    )
    p.add_argument("--address", default="127.0.0.1:50051", help="pdserve gateway host:port")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server")
    p.add_argument("--prefill-url", default=None, help="openai-pd: the prefill (kv_producer) server")
    p.add_argument("--model", default="", help="model name for OpenAI servers")
    p.add_argument("--num-requests", type=int, default=64, help="measured requests")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--input-len", default="128", help="prompt length, or a comma list to mix (see --input-weights)")
    p.add_argument("--input-weights", default=None, help="comma list of weights for --input-len's lengths")
    p.add_argument("--range-ratio", type=float, default=0.0, help="spread each length uniformly by +-this fraction")
    p.add_argument("--prefix-len", type=int, default=0, help="length of the shared prefixes prompts start with")
    p.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes; each prompt takes one")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--vocab-range", default="1000,32000", help="prompt token ids are drawn from [lo, hi)")
    p.add_argument("--num-warmups", type=int, default=2, help="requests sent first and not measured")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:8000")
    p.add_argument("--percentiles", default="50,90,99", help="comma list of percentiles to report")
    p.add_argument("--label", default="", help="name of this run in the JSON and plots")
    p.add_argument("--result-json", type=Path, default=None, help="append this run's metrics (one JSON per line)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="API key (default $PDSERVE_API_KEY)")
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("PDSERVE_TLS_CA"),
        help="pdserve backend: CA to verify the gateway with (turns TLS on)",
    )


def make_target(args: argparse.Namespace):
    if args.backend == "pdserve":
        from pdserve.security import TLSConfig

        return GrpcTarget(args.address, args.api_key, TLSConfig(ca=args.tls_ca) if args.tls_ca else None)
    if args.backend == "openai":
        return OpenAITarget(args.base_url, args.model, args.api_key)
    if not args.prefill_url:
        raise SystemExit("--backend openai-pd needs --prefill-url")
    return OpenAIDisaggTarget(args.prefill_url, args.base_url, args.model)


async def bench(args: argparse.Namespace) -> dict:
    slos = parse_goodput(args.goodput)
    lens = [int(x) for x in args.input_len.split(",")]
    weights = [float(x) for x in args.input_weights.split(",")] if args.input_weights else None
    low, high = (int(x) for x in args.vocab_range.split(","))
    vocab = (low, high)
    reqs = make_requests(
        args.num_requests,
        lens,
        args.output_len,
        args.seed,
        weights,
        args.range_ratio,
        args.prefix_len,
        vocab,
        args.num_prefixes,
    )
    warm = make_requests(
        args.num_warmups, lens, min(args.output_len, 8), args.seed + 1, weights, 0.0, args.prefix_len, vocab
    )
    for r in reqs + warm:
        r.temperature, r.top_p = args.temperature, args.top_p
    target = make_target(args)
    try:
        results, duration, peak = await run_load(
            target, reqs, args.max_concurrency, args.request_rate, args.seed, warm, Progress(len(reqs))
        )
    finally:
        await target.close()
    percentiles = [float(p) for p in args.percentiles.split(",")]
    metrics = compute_metrics(results, duration, percentiles, slos, peak)
    errors = sorted({r.error for r in results if not r.success})
    record = {
        "label": args.label,
        "backend": args.backend,
        "num_requests": args.num_requests,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "input_len": args.input_len,
        "input_weights": args.input_weights,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "goodput_slos_ms": slos,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "errors": errors[:5],
        **metrics.as_dict(),
    }
    if metrics.completed:
        print(format_table(metrics, f"{args.label or args.backend}"))
    if errors and metrics.completed:
        print(f"errors: {errors[:5]}", file=sys.stderr)
    if args.result_json:
        with args.result_json.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    record = asyncio.run(bench(args))
    return 0 if record["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
