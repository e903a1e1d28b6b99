"""The content address of a KV block: a hash chained over the token ids of every full block up to it.

Block i's hash names the whole prefix `tokens[: (i + 1) * block_size]`, so two prompts share the hashes of the
blocks they share. Workers name their cached blocks by it (prefix caching), and the gateway hashes prompts the same
way to route each one to the prefill worker that already holds its prefix. 64 bits: the wire carries them as
fixed64, and a collision among the ~1e5 blocks a worker holds has odds of about 1 in 1e9.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def hash_block(parent: int | None, tokens: Sequence[int]) -> int:
    """Content hash of one full block given its parent's hash; stable across processes."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hash chain over the full blocks of `tokens`."""
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        out.append(parent)
    return out
