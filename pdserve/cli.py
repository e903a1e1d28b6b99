"""The `pdserve` command."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true", help="run the engine in this process")
    gen.add_argument("--model", default=None, help="model directory, .gguf file, or 'default'")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    return parser


def _generate_local(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_store import resolve_model
    from engine.sampling_params import SamplingParams
    from gateway.tokenizer import Tokenizer

    path = resolve_model(args.model)
    tokenizer = Tokenizer(path)
    engine = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype))
    ids = tokenizer.encode(args.prompt) if args.raw else tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    engine.add_request(ids, params, "cli")
    out: list[int] = []
    printed = ""
    while engine.has_work:
        for step in engine.step():
            out.extend(step.new_token_ids)
            text = tokenizer.decode(out)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{len(out)} tokens in {elapsed:.2f}s, {len(out) / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        if not args.local:
            print("pdserve generate: the gateway client arrives with the pipeline; use --local", file=sys.stderr)
            return 2
        return _generate_local(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
