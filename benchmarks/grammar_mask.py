"""What a grammar costs: the token mask per step, and served latency with and without a JSON schema.

    python -m pdserve.benchmarks.grammar_mask [--model PATH] [--skip-served]

1. Mask cost: a nested JSON schema's answer is walked token by token through llguidance (the engine's library)
   and, when it is installed, xgrammar, on the model's own tokenizer: the time to fill each step's bitmask, and the
   sampler's cost to apply one row (unpack + mask the logits).
2. Served (`pdserve up --colocated`, the CPU's default dtype): ITL p50 at c=1 and c=8 of 128-token answers with the
   schema and without (the same chat prompt; the schema asks for at least 20 items so neither side ends early;
   rounds of the two interleaved), greedy and drawn; and TTFT p50 (30 of each, interleaved) of a schema's first use
   (a schema never seen: compiled on arrival) and of its second, against none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], "address": {"city": "London", "zip": "12345"}}
LONG = {  # served: an answer longer than OUTPUT tokens, so constrained and free streams both run OUTPUT tokens
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "year": {"type": "integer"}, "summary": {"type": "string"}},
        "required": ["title", "year", "summary"],
        "additionalProperties": False,
    },
    "minItems": 20,
}
PROMPT = "List twenty famous novels as JSON: title, year and a one-line summary each."
OUTPUT = 128


def mask_costs(model_dir: Path, vocab: int, eos: list[int]) -> list[str]:
    import torch
    from tokenizers import Tokenizer

    from pdserve.engine.grammar import Constraint, Grammars, unpack_masks

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(json.dumps(ANSWER)).ids
    lines = [f"answer: {len(ids)} tokens; vocabulary {vocab}"]
    grammars = Grammars(model_dir / "tokenizer.json", vocab, eos)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    start = time.perf_counter()
    grammars.state(constraint)
    compile_ms = (time.perf_counter() - start) * 1e3
    row = np.empty(grammars.words, dtype=np.int32)

    def llguidance_matcher() -> tuple[Callable[[], object], Callable[[int], bool]]:
        state = grammars.state(constraint)
        return lambda: state.fill(row), state.accept

    lines.append(f"llguidance {version('llguidance')}: compile {compile_ms:.1f} ms; {_fills(llguidance_matcher, ids)}")
    logits = torch.randn(8, vocab)
    bits = np.repeat(row[None, :], 8, axis=0)
    applies = []
    for _ in range(50):
        t = time.perf_counter()
        allowed = torch.from_numpy(unpack_masks(bits, vocab))
        logits.masked_fill(~allowed, float("-inf"))
        applies.append((time.perf_counter() - t) / 8)
    lines.append(f"sampler: apply one row's mask {statistics.median(applies) * 1e6:.1f} us")
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        lines.append("xgrammar: not installed")
        return lines
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_ms = (time.perf_counter() - start) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def xgrammar_matcher() -> tuple[Callable[[], object], Callable[[int], bool]]:
        matcher = xgr.GrammarMatcher(compiled)
        return lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token

    xids = hf.encode(json.dumps(ANSWER), add_special_tokens=False)
    lines.append(f"xgrammar {version('xgrammar')}: compile {compile_ms:.1f} ms; {_fills(xgrammar_matcher, xids)}")
    return lines


def _fills(matcher: Callable[[], tuple[Callable[[], object], Callable[[int], bool]]], ids: list[int]) -> str:
    """The time to fill each step's mask while walking `ids` through 5 fresh matchers; `matcher()` gives one's
    (fill, accept)."""
    fills: list[float] = []
    for _ in range(5):
        fill, accept = matcher()
        for token in ids:
            t = time.perf_counter()
            fill()
            fills.append(time.perf_counter() - t)
            assert accept(token)
    return f"mask p50 {statistics.median(fills) * 1e6:.1f} us, mean {statistics.mean(fills) * 1e6:.1f} us"


async def _one(client, constraint, itl: list[float], ttft: list[float], temperature: float = 0.0) -> None:
    kw = {"constraint": constraint} if constraint is not None else {}
    if temperature:
        kw["seed"] = len(itl) + len(ttft)
    start = last = time.perf_counter()
    n = 0
    async for resp in client.stream(
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=OUTPUT,
        temperature=temperature,
        ignore_eos=True,
        **kw,
    ):
        now = time.perf_counter()
        if not resp.token_ids:
            continue
        if n == 0:
            ttft.append(now - start)
        else:
            itl.append(now - last)
        last, n = now, n + len(resp.token_ids)


async def _load(
    address: str, concurrency: int, rounds: int, constraint, temperature: float = 0.0
) -> tuple[list[float], list[float]]:
    from pdserve.client import Client

    itl: list[float] = []
    ttft: list[float] = []
    async with Client(address) as client:
        await _one(client, constraint, [], [])  # warm: a schema's compile and the first forward
        for _ in range(rounds):
            await asyncio.gather(*(_one(client, constraint, itl, ttft, temperature) for _ in range(concurrency)))
    return itl, ttft


def _paired(address: str, concurrency: int, rounds: int, constraint, temperature: float) -> list[list[float]]:
    """ITLs and TTFTs without and with the constraint, their rounds interleaved so that a busy spell of the
    machine falls on both: [free ITL, free TTFT, constrained ITL, constrained TTFT]."""
    out: list[list[float]] = [[], [], [], []]
    for _ in range(rounds):
        for k, c in ((0, None), (2, constraint)):
            itl, ttft = asyncio.run(_load(address, concurrency, 1, c, temperature))
            out[k] += itl
            out[k + 1] += ttft
    return out


async def _first_token(client, constraint) -> float:
    kw = {"constraint": constraint} if constraint is not None else {}
    start = time.perf_counter()
    async for resp in client.stream(
        messages=[{"role": "user", "content": PROMPT}], max_tokens=2, temperature=0.0, **kw
    ):
        if resp.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token came back")


async def _first_use(address: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """TTFTs, interleaved: no schema; a schema never seen (compiled on arrival); the same schema again."""
    from pdserve.client import Client
    from pdserve.protos import common_pb2

    free: list[float] = []
    first: list[float] = []
    again: list[float] = []
    async with Client(address) as client:
        await _first_token(client, None)
        for i in range(n):
            constraint = common_pb2.Constraint(json_schema=json.dumps({**LONG, "minItems": 20 + i}))
            free.append(await _first_token(client, None))
            first.append(await _first_token(client, constraint))
            again.append(await _first_token(client, constraint))
    return free, first, again


def served(model: str, rounds: int) -> list[str]:
    from pdserve.benchmarks.compare import pdserve_up
    from pdserve.protos import common_pb2

    constraint = common_pb2.Constraint(json_schema=json.dumps(LONG))
    lines = []
    log = Path(tempfile.mkdtemp()) / "up.log"
    with pdserve_up(log, "auto", "none", colocated=True, model=model) as (address, _):
        for temperature in (0.0, 0.8):
            for concurrency in (1, 8):
                free_itl, free_ttft, json_itl, json_ttft = _paired(
                    address, concurrency, rounds, constraint, temperature
                )
                f, j = statistics.median(free_itl) * 1e3, statistics.median(json_itl) * 1e3
                lines.append(
                    f"temperature {temperature} c={concurrency}: ITL p50 free {f:.2f} ms, schema {j:.2f} ms "
                    f"({j / f:.3f}x); TTFT p50 free {statistics.median(free_ttft) * 1e3:.1f} ms, schema "
                    f"{statistics.median(json_ttft) * 1e3:.1f} ms"
                )
        free, first, again = asyncio.run(_first_use(address, 30))
        lines.append(
            f"TTFT p50 c=1: no schema {statistics.median(free) * 1e3:.1f} ms, a schema's first use "
            f"{statistics.median(first) * 1e3:.1f} ms, its second use {statistics.median(again) * 1e3:.1f} ms"
        )
    return lines


def main() -> None:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_store import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory or .gguf (default: the built-in model)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of `concurrency` requests per served point")
    ap.add_argument("--skip-served", action="store_true")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    from pdserve.kernels.cpu_isa import isa_flags

    print(f"CPU flags: {isa_flags()}")
    for line in mask_costs(model_dir, cfg.vocab_size, list(cfg.eos_token_ids)):
        print(line)
    if not args.skip_served:
        for line in served(args.model or "default", args.rounds):
            print(line)


if __name__ == "__main__":
    main()
