"""OpenAI bodies are validated by the protocol's pydantic models, and every refusal names the parameter at fault
the way OpenAI does (`param`), with no server in the way."""

from __future__ import annotations

import pytest

from pdserve.gateway.openai_protocol import parse_request
from pdserve.gateway.request import RequestError

M = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "chat,body,param",
    [
        (True, {"messages": []}, "messages"),
        (True, {"messages": "hi"}, "messages"),
        (True, {"messages": [{"content": "x"}]}, "messages[0]"),
        (True, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        (True, {"messages": M, "n": 0}, "n"),
        (True, {"messages": M, "n": 17}, "n"),
        (True, {"messages": M, "n": 3, "best_of": 2}, "best_of"),
        (False, {"prompt": "hi", "n": 1, "best_of": 3, "stream": True}, "best_of"),
        (True, {"messages": M, "temperature": "hot"}, "temperature"),
        (True, {"messages": M, "temperature": True}, "temperature"),
        (True, {"messages": M, "max_tokens": 0}, "max_tokens"),
        (True, {"messages": M, "max_completion_tokens": 0}, "max_completion_tokens"),
        (True, {"messages": M, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        (True, {"messages": M, "top_logprobs": 2}, "top_logprobs"),
        (True, {"messages": M, "tools": [{"type": "function"}]}, "tools"),
        (True, {"messages": M, "tool_choice": "auto"}, "tool_choice"),
        (True, {"messages": M, "response_format": {"type": "xml"}}, "response_format"),
        (
            True,
            {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
            "response_format",
        ),
        (True, {"messages": M, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        (True, {"messages": M, "guided_choice": []}, "guided_choice"),
        (False, {"prompt": "hi", "guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
        (True, {"messages": M, "frobnicate": 1}, "frobnicate"),
        (True, {"messages": M, "prompt": "completions only"}, "prompt"),
        (True, {"messages": M, "logit_bias": {"x": 1}}, "logit_bias"),
        (True, {"messages": M, "logit_bias": {"5": 101}}, "logit_bias"),
        (True, {"messages": M, "seed": -1}, "seed"),
        (True, {"messages": M, "top_k": 2**40}, "top_k"),
        (True, {"messages": M, "ignore_eos": 1}, "ignore_eos"),
        (True, {"messages": M, "stop_token_ids": [True]}, "stop_token_ids"),
        (False, {"prompt": 5}, "prompt"),
        (False, {"prompt": []}, "prompt"),
        (False, {"prompt": ["a", "b"]}, "prompt"),
        (False, {"prompt": "hi", "logprobs": 9}, "logprobs"),
        (False, {"prompt": "hi", "stop": [1, 2]}, "stop"),
        (False, {"prompt": "hi", "echo": True}, "echo"),
        (False, {"prompt": "hi", "max_tokens": 2**33}, "max_tokens"),
    ],
)
def test_a_bad_body_is_refused_naming_its_parameter(chat: bool, body: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        parse_request(body, chat)
    assert e.value.param == param and e.value.failure.http == 400 and param in e.value.message


def test_a_good_body_reads_into_the_gateway_s_request() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "tools": None,  # null: nothing asked of what is not implemented
        "response_format": {"type": "text"},
        "temperature": 1,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {"5": -100},
        "stop": "x",
        "seed": 2**64 - 1,
        "max_completion_tokens": 5,
    }
    parsed = parse_request(body, chat=True)
    req, s = parsed.request, parsed.request.sampling
    assert req.messages == [{"role": "user", "content": "ab"}] and req.stop == ["x"]
    assert (parsed.stream, parsed.include_usage, parsed.top_logprobs) == (True, True, 2)
    assert s.max_tokens == 5 and s.temperature == 1.0 and s.seed == 2**64 - 1 and dict(s.logit_bias) == {5: -100.0}
    completion = parse_request({"prompt": [[1, 2, 3]], "max_tokens": None}, chat=False)
    assert completion.request.token_ids == [1, 2, 3] and completion.request.sampling.max_tokens == 16


def test_each_choice_is_a_request_of_its_own() -> None:
    from pdserve.gateway.choices import children, merged_usage
    from pdserve.protos import common_pb2

    parsed = parse_request({"prompt": "hi", "n": 3, "seed": 2**64 - 2, "temperature": 1.0}, chat=False)
    assert parsed.n == 3 and parsed.best_of == 3
    kids = children(parsed.request, 3)
    assert [k.request_id for k in kids] == [f"{parsed.request.request_id}-{i}" for i in range(3)]
    assert [k.sampling.seed for k in kids] == [2**64 - 2, 2**64 - 1, 0]  # seed + i, wrapping at 64 bits
    assert all(k.sampling.temperature == 1.0 and k.prompt == "hi" for k in kids)
    assert parsed.request.sampling.seed == 2**64 - 2  # the parent is untouched
    unseeded = children(parse_request({"prompt": "hi", "n": 2}, chat=False).request, 2)
    assert not any(k.sampling.HasField("seed") for k in unseeded)
    best = parse_request({"prompt": "hi", "n": 1, "best_of": 3}, chat=False)
    assert best.best_of == 3 and best.request.sampling.logprobs == 0 and best.top_logprobs is None
    usage = merged_usage([common_pb2.Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=0)] * 3)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (9, 12, 0)
