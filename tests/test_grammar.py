"""Grammar-constrained decoding in the engine: constraints that do not compile are named, the sampler's mask
excludes exactly what the grammar forbids and touches no other row, every answer under a schema validates
(greedy and drawn), and a grammar state rebuilt from the tokens generated so far (a prefill worker's first token,
a moved stream) continues exactly as the original."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.errors import InvalidParameter, SamplingError
from pdserve.engine.grammar import Constraint, Grammars, unpack_masks
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.wire import sampling_from_proto, sampling_to_proto

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0, "maximum": 3},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "nickname": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "height_m", "colours", "address"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": PERSON,
    "list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -99, "maximum": 999},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "verdict": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["ok", "score"],
        "additionalProperties": False,
    },
}


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def core(model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), dtype="float32", num_threads=1))


@pytest.mark.parametrize(
    "constraint,fragment",
    [
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("lark", "start: nowhere"), "nowhere"),
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "must be an object"),
        (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}', strict=True), "no-such-format"),
    ],
)
def test_a_constraint_that_does_not_compile_is_named(constraint: Constraint, fragment: str) -> None:
    with pytest.raises(InvalidParameter) as e:
        constraint.check("response_format")
    assert e.value.param == "response_format" and fragment in str(e.value)


def test_strict_refuses_what_lenient_ignores() -> None:
    schema = '{"type": "string", "format": "no-such-format"}'
    Constraint("json_schema", schema, strict=False).check()
    with pytest.raises(InvalidParameter):
        Constraint("json_schema", schema, strict=True).check()


def test_unknown_kinds_and_constraints_travel_the_wire() -> None:
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(constraint=Constraint("xml", "<a/>")).validate()
    assert e.value.param == "constraint"
    for c in (
        Constraint("json_schema", json.dumps(PERSON), True),
        Constraint("regex", "[0-9]+"),
        Constraint("lark", "start: /x+/"),
    ):
        assert sampling_from_proto(sampling_to_proto(SamplingParams(constraint=c))).constraint == c


def test_masks_unpack_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    want = np.array([[(int(w) >> b) & 1 for w in row for b in range(32)] for row in bits], dtype=bool)[:, :150]
    assert (unpack_masks(bits, 150) == want).all()


def test_the_mask_excludes_what_the_grammar_forbids_and_no_other_row(model_dir, tokenizer) -> None:
    grammars = Grammars(model_dir / "tokenizer.json", 49152, (2,))
    digits = grammars.state(Constraint("regex", "[0-9]{3}"))
    bits = np.empty((1, grammars.words), dtype=np.int32)
    digits.fill(bits[0])
    allowed = set(np.nonzero(unpack_masks(bits, 49152)[0])[0].tolist())
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)

    sampler = Sampler(49152, (2,))
    logits = torch.randn(3, 49152)
    logits[:, tokenizer.encode("x")[0]] = 50.0  # the favourite of every row: not a digit
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    ids = [[1, 2], [1, 2], [1, 2]]
    draw_state = grammars.state(Constraint("regex", "[0-9]{3}"))
    out = sampler.sample(logits, params, ids, [2, 2, 2], [digits, None, draw_state])
    assert out[0].token_id in allowed and out[0].token_id == max(allowed, key=lambda t: float(logits[0, t]))
    assert out[1].token_id == tokenizer.encode("x")[0]  # the unconstrained row is untouched
    assert out[2].token_id in allowed

    # all greedy: the favourite is checked first and, refused, the masked argmax taken; the other row untouched
    digits = grammars.state(Constraint("regex", "[0-9]{3}"))
    out = sampler.sample(logits[:2], params[:2], ids[:2], [2, 2], [digits, None])
    assert out[0].token_id == max(allowed, key=lambda t: float(logits[0, t]))
    assert out[1].token_id == tokenizer.encode("x")[0]
    logits[0, out[0].token_id] = 60.0  # now the favourite is allowed: taken as is
    assert sampler.sample(logits[:1], params[:1], ids[:1], [2], [digits])[0].token_id == out[0].token_id

    done = grammars.state(Constraint("regex", "ab"), tokenizer.encode("ab"))
    assert done.done
    banned = SamplingParams(temperature=0.0, min_tokens=5)  # only EOS is left, and min_tokens bans it
    out = sampler.sample(logits[:2], [banned, params[1]], [[1, 2, 3], [1, 2]], [1, 2], [done, None])
    assert isinstance(out[0], SamplingError) and not isinstance(out[1], SamplingError)


def test_tokens_that_break_the_grammar_are_refused(model_dir, tokenizer) -> None:
    grammars = Grammars(model_dir / "tokenizer.json", 49152, (2,))
    with pytest.raises(InvalidParameter, match="breaks the constraint"):
        grammars.state(Constraint("regex", "[0-9]+"), tokenizer.encode("12a"))
    assert (grammars.compiles, grammars.hits) == (1, 0) and grammars.compile_seconds > 0
    grammars.state(Constraint("regex", "[0-9]+"), tokenizer.encode("12"))
    assert (grammars.compiles, grammars.hits) == (1, 1)  # compiled once, copied since
    with pytest.raises(InvalidParameter):
        grammars.state(Constraint("regex", "[0-9"))
    assert (grammars.compiles, grammars.hits) == (2, 1)  # a failed compile counts, and is not cached


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_under_a_schema_validates(core, tokenizer, name: str) -> None:
    """Greedy and four seeded draws (temperature 0.8, nothing trimmed): all parse and validate."""
    schema = SCHEMAS[name]
    constraint = Constraint("json_schema", json.dumps(schema), strict=True)
    prompt = _chat(tokenizer, f"Answer in JSON: an example {name}.")
    params = [SamplingParams(max_tokens=300, temperature=0.0, constraint=constraint)]
    params += [SamplingParams(max_tokens=300, temperature=0.8, seed=s, constraint=constraint) for s in range(4)]
    seqs = [core.add_request(prompt, p) for p in params]
    while core.has_work:
        for out in core.step():
            assert out.error is None, out.error
    answers = []
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, tokenizer.decode(seq.output_ids))
        text = tokenizer.decode(seq.output_ids)
        jsonschema.validate(json.loads(text), schema)
        answers.append(text)
    if name == "person":  # the draws are draws (the short schemas' answers concentrate on two or three values)
        assert len(set(answers)) > 1


def test_regex_choice_and_lark_constraints(core, tokenizer) -> None:
    prompt = _chat(tokenizer, "Is the sky blue?")
    choices = ['say "yes"', "no, it is\\not", "maybe"]
    lark = "start: " + " | ".join(json.dumps(c) for c in choices)
    cases = [
        (Constraint("regex", r"(Yes|No)\. [A-Z][a-z]+ [a-z]+\."), r"(Yes|No)\. [A-Z][a-z]+ [a-z]+\."),
        (Constraint("lark", lark), None),
        (Constraint("lark", 'start: "The answer is " NUM\nNUM: /[0-9]{1,3}/'), r"The answer is [0-9]{1,3}"),
    ]
    for seed in (None, 7):
        for constraint, pattern in cases:
            temp = 0.0 if seed is None else 1.0
            [out] = core.generate(
                [prompt], SamplingParams(max_tokens=40, temperature=temp, seed=seed, constraint=constraint)
            )
            text = tokenizer.decode(out)
            if pattern is None:
                assert text in choices, text
            else:
                assert re.fullmatch(pattern, text), text


def test_constrained_and_free_requests_share_a_batch_untouched(core, tokenizer) -> None:
    free = _chat(tokenizer, "Name three colours.")
    alone = core.generate([free], SamplingParams(max_tokens=24, temperature=0.0))[0]
    json_mode = SamplingParams(
        max_tokens=200, temperature=0.0, constraint=Constraint("json_schema", '{"type": "object"}')
    )
    together = core.generate(
        [free, _chat(tokenizer, "A JSON object, please."), free],
        [SamplingParams(max_tokens=24, temperature=0.0), json_mode, SamplingParams(max_tokens=24, temperature=0.0)],
    )
    assert together[0] == alone and together[2] == alone
    assert isinstance(json.loads(tokenizer.decode(together[1])), dict)


def test_a_grammar_rebuilt_from_generated_tokens_continues_the_same(core, tokenizer) -> None:
    """What a decode worker does with a prefill worker's first token, and a new worker with a moved stream:
    replay the tokens into a fresh state. Greedy output then continues token for token."""
    constraint = Constraint("json_schema", json.dumps(PERSON))
    prompt = _chat(tokenizer, "Describe a person in JSON.")
    whole = core.generate([prompt], SamplingParams(max_tokens=120, temperature=0.0, constraint=constraint))[0]
    for cut in (1, len(whole) // 2):
        params = SamplingParams(max_tokens=120, temperature=0.0, constraint=constraint)
        seq = Sequence("moved", prompt + whole[:cut], params, num_prompt_tokens=len(prompt))
        core.add(seq)  # its grammar state is built by replaying whole[:cut]
        while core.has_work:
            core.step()
        assert seq.output_ids == whole, cut
