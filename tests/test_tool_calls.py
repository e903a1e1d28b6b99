"""Tool calls without a server: what `tools` and `tool_choice` make of the prompt and the constraint, reading calls
back out of answers (bare JSON, lists, Hermes tags), and the renderer's answers, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.gateway.openai_protocol import parse_request
from pdserve.gateway.openai_render import Renderer
from pdserve.gateway.request import Delta, RequestError
from pdserve.gateway.tool_calls import chat_messages, plan
from pdserve.protos import common_pb2

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(**kw) -> dict:
    return {"messages": ASK, "tools": [WEATHER, TIME], **kw}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": ASK, "tool_choice": "auto"}, "tool_choice"),
        (_chat(tool_choice="sometimes"), "tool_choice"),
        (_chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools"),
        ({"messages": ASK, "tools": [{"type": "retrieval"}]}, "tools"),
        (_chat(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        ({"messages": ASK, "functions": [WEATHER["function"]]}, "functions"),
    ],
)
def test_bad_tools_are_refused_naming_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        parse_request(body, chat=True)
    assert e.value.param == param, e.value.message


def test_required_constrains_to_calls_of_the_offered_functions() -> None:
    parsed = parse_request(_chat(tool_choice="required"), chat=True)
    constraint = parsed.request.sampling.constraint
    schema = json.loads(constraint.json_schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(
        parse_request(
            _chat(tool_choice="required", parallel_tool_calls=False), chat=True
        ).request.sampling.constraint.json_schema
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    named = parse_request(_chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}), chat=True)
    assert json.loads(named.request.sampling.constraint.json_schema) == WEATHER["function"]["parameters"]
    assert named.request.constraint_param == "tools"
    assert not parse_request(_chat(), chat=True).request.sampling.HasField("constraint")  # auto: free


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    parsed = parse_request(_chat(), chat=True, renders_tools=False)
    system = parsed.request.messages[0]
    assert system["role"] == "system" and "get_weather" in system["content"] and '"arguments"' in system["content"]
    assert parsed.request.template_tools is None and parsed.request.messages[1] == {
        "role": "user",
        "content": ASK[0]["content"],
    }
    native = parse_request(_chat(), chat=True, renders_tools=True)
    assert native.request.template_tools == [WEATHER, TIME] and native.request.messages[0]["role"] == "user"
    none = parse_request(_chat(tool_choice="none"), chat=True, renders_tools=False)
    assert none.request.messages[0]["role"] == "user"  # nothing offered that cannot be called
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    flat = chat_messages(history, plan([WEATHER], "auto", None), template_renders_tools=False)
    assert json.loads(flat[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert flat[3] == {"role": "tool", "content": "18 C, sunny"}
    kept = parse_request({"messages": history, "tools": [WEATHER]}, chat=True, renders_tools=True).request.messages
    assert kept[1]["tool_calls"][0]["function"]["name"] == "get_weather" and kept[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize(
    "text,names",
    [
        ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', ["get_weather"]),
        ('{"name": "get_time", "arguments": {}}', ["get_time"]),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', ["get_weather"]),  # Llama 3 style
        (
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "get_weather", '
            '"arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
            ["get_time", "get_weather"],
        ),  # Hermes, twice
        ("It is sunny in Paris.", None),
        ('{"name": "launch_rockets", "arguments": {}}', None),  # not offered: text
        ('[{"name": "get_weather", "arguments": {"city": "Par', None),  # cut short
    ],
)
def test_auto_reads_calls_out_of_answers(text: str, names: list[str] | None) -> None:
    tools = plan([WEATHER, TIME], "auto", None)
    assert tools is not None
    calls = tools.calls(text)
    assert (None if calls is None else [c.name for c in calls]) == names
    for call in calls or []:
        assert isinstance(json.loads(call.arguments), dict) and call.id.startswith("call_")


class _Tokens:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _deltas(text: str, finish: str = "stop") -> list[Delta]:
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=len(pieces))
    return [Delta(p, [1], [], finish if i == len(pieces) - 1 else None, usage) for i, p in enumerate(pieces)]


def _stream(renderer: Renderer, deltas: list[Delta]) -> list[dict]:
    return [c for d in deltas for c in renderer.stream_choices(d)]


def test_streamed_calls_come_as_tool_call_deltas_and_text_streams_at_once() -> None:
    tools = plan([WEATHER, TIME], "auto", None)
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    chunks = _stream(Renderer(_Tokens(), True, "m", None, tools), _deltas(call))
    assert len(chunks) == 1 and chunks[0]["finish_reason"] == "tool_calls"
    delta = chunks[0]["delta"]
    assert delta["role"] == "assistant" and delta["content"] is None
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}

    text = "Sunny, I think, all week."
    chunks = _stream(Renderer(_Tokens(), True, "m", None, tools), _deltas(text))
    assert len(chunks) == len(_deltas(text)) and "".join(c["delta"].get("content", "") for c in chunks) == text
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "stop"

    cut = _stream(Renderer(_Tokens(), True, "m", None, tools), _deltas(call[:20], "length"))
    assert cut[-1]["finish_reason"] == "length" and cut[0]["delta"]["content"] == call[:20]

    whole = Renderer(
        _Tokens(), True, "m", None, plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    )
    body = whole.response([whole.choice('{"city": "Oslo"}', None, "stop")], common_pb2.Usage())
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
