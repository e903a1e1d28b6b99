"""Incremental detokenization and stop strings, with the real tokenizer."""

from __future__ import annotations

import pytest

from pdserve.gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "naïve café — 東京タワー 🍣🍜 ok",
    "  leading spaces\n\tand tabs",
    "emoji 👩‍👩‍👧‍👦 family and ∑ math",
]


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_characters(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_not_streamed(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("Done.") + [tok.eos_token_id]
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "Done."


@pytest.mark.parametrize(
    "chunks,stops,expected,stopped",
    [
        (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),
        (["ab", "c", "d"], ["cd"], "ab", True),
        (["abc"], ["x"], "abc", False),
        (["a", "b"], [], "ab", False),
        (["STOP"], ["STOP", "ST"], "", True),
        (["one two", " three"], ["two three", " thr"], "one ", True),  # the earliest match wins
    ],
)
def test_stop_strings_are_held_back_and_never_streamed(chunks, stops, expected, stopped):
    m = StopStringMatcher(stops)
    out = ""
    for c in chunks:
        piece = m.feed(c)
        out += piece
        for s in stops:
            assert s not in out
    out += m.flush()
    assert out == expected
    assert m.stopped == stopped
