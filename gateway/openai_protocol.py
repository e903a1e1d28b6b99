"""The OpenAI API's request bodies, validated by pydantic models and read into the gateway's own request.

OpenAI's parameters plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos, repetition_penalty, stop_token_ids,
and the structured-output fields guided_json / guided_regex / guided_choice / guided_grammar), logit_bias, and
pdserve's speculative_tokens.
`response_format` json_object and json_schema, and the guided_* fields, become one output constraint (at most one
per request). Types are strict (a string is not a number, a bool is not an integer) and ranges are the proto fields'
(a value beyond them is the caller's error, not a protobuf exception). Chat `tools`, `tool_choice` and
`parallel_tool_calls` are read into a `ToolPlan` (`gateway.tool_calls`). A parameter this server does not implement
(the deprecated `functions`, audio, ...) or does not know gets a 400 naming it, as OpenAI answers; so does every
value of the wrong type or out of range: a `RequestError` whose `param` is the field at fault.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.engine.grammar import Constraint
from pdserve.gateway.request import GenerationRequest, invalid
from pdserve.gateway.tool_calls import ToolPlan, chat_messages, plan
from pdserve.protos import common_pb2
from pdserve.wire import constraint_to_proto

MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n and best_of: each choice is a request of its own on the workers
U32 = 2**32 - 1

# OpenAI parameters this server does not implement: refused by name rather than silently ignored (OpenAI itself
# refuses arguments it does not know); `response_format: {"type": "text"}` is the default and accepted
UNSUPPORTED: tuple[str, ...] = ("functions", "function_call")  # the deprecated forms of tools / tool_choice
UNSUPPORTED += ("audio", "modalities", "prediction", "web_search_options", "reasoning_effort")

Count = Annotated[int, Field(ge=0, le=U32)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    """A chat message: its role and text, an assistant's earlier tool calls, a tool result's call id (other
    fields a client sends with it are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(_Strict):
    model: str = ""
    max_tokens: Annotated[int, Field(ge=1, le=U32)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    min_tokens: Count | None = None
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    ignore_eos: bool | None = None
    speculative_tokens: Count | None = None
    stop_token_ids: list[Count] | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    best_of: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=U32)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class CompletionBody(_Common):
    prompt: str | list[Count] | list[str | list[Count]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    suffix: str | None = None


@dataclass
class ParsedRequest:
    """A generation request read from an OpenAI body, and how to answer it."""

    request: GenerationRequest
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs
    tools: ToolPlan | None = None
    n: int = 1  # choices returned
    best_of: int = 1  # choices generated, the n with the highest mean token logprob returned (>= n)


def parse_request(body: dict, chat: bool, renders_tools: bool = False) -> ParsedRequest:
    """The gateway request an OpenAI body asks for; a RequestError naming the parameter when it is wrong.
    `renders_tools`: the model's chat template writes tools itself (`gateway.tool_calls`)."""
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise invalid(name, f"{name} is not supported by this server")
    body = {k: v for k, v in body.items() if k not in UNSUPPORTED}  # each one here is null: nothing asked
    parsed = _validate(ChatBody if chat else CompletionBody, body)
    sampling, top = _sampling(parsed)
    req = GenerationRequest(uuid.uuid4().hex, sampling, stop=_stop(parsed.stop), model=parsed.model)
    tools = plan(parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls) if isinstance(parsed, ChatBody) else None
    constrained = _constraint(parsed)
    tool_constraint = tools.constraint() if tools is not None else None
    if tools is not None and tool_constraint is not None:
        if constrained is not None:
            raise invalid("tool_choice", f"tool_choice {tools.choice!r} constrains the output: {constrained[0]} cannot")
        constrained = ("tools", tool_constraint)
    if constrained is not None:
        req.constraint_param, constraint = constrained
        sampling.constraint.CopyFrom(constraint_to_proto(constraint))
    if isinstance(parsed, ChatBody):
        messages = [m.as_template_input() for m in parsed.messages]
        req.messages = chat_messages(messages, tools, renders_tools)
        if renders_tools and tools is not None and tools.choice != "none":
            req.template_tools = tools.template_tools()
    else:
        req.prompt, req.token_ids = _prompt(parsed.prompt)
    stream = bool(parsed.stream)
    include_usage = stream and bool((parsed.stream_options or {}).get("include_usage"))
    n, best_of = _choices(parsed, stream)
    if best_of > n and top is None:
        sampling.logprobs = 0  # ranking needs each token's logprob; not returned unless asked for
    return ParsedRequest(req, stream, include_usage, top, tools, n, best_of)


def _choices(body: ChatBody | CompletionBody, stream: bool) -> tuple[int, int]:
    """`n` and `best_of`, each in [1, MAX_CHOICES], best_of >= n, and no best_of above n when streaming."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"n must be in [1, {MAX_CHOICES}], got {n}")
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise invalid("best_of", f"best_of must be in [n, {MAX_CHOICES}] (n is {n}), got {best_of}")
    if stream and best_of > n:
        raise invalid("best_of", "best_of above n cannot be streamed")
    return n, best_of


def _validate(model: type[ChatBody] | type[CompletionBody], body: dict) -> ChatBody | CompletionBody:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        message = f"unknown parameter {param!r}" if first["type"] == "extra_forbidden" else first["msg"]
        raise invalid(param, f"{param}: {message}") from None


def _param(loc: tuple[int | str, ...]) -> str:
    """The parameter a validation error is about: the top-level field, or the message (and its content) at fault."""
    if loc[0] == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        return f"messages[{loc[1]}]" + (".content" if "content" in loc else "")
    return str(loc[0])


def _sampling(body: ChatBody | CompletionBody) -> tuple[common_pb2.SamplingParams, int | None]:
    """The workers' sampling params and how many top logprobs to return (None: none)."""
    s = common_pb2.SamplingParams()
    for key, value in (body.logit_bias or {}).items():
        if not (key.isdigit() and int(key) <= U32):
            raise invalid("logit_bias", f"logit_bias keys must be token ids (as strings), got {key!r}")
        if not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {value!r}")
        s.logit_bias[int(key)] = value
    max_tokens = body.max_completion_tokens if isinstance(body, ChatBody) else None
    max_tokens = max_tokens if max_tokens is not None else body.max_tokens
    if max_tokens is not None:
        s.max_tokens = max_tokens
    elif isinstance(body, CompletionBody):
        s.max_tokens = 16  # OpenAI's default for completions
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    for name in ("top_k", "min_tokens", "seed", "speculative_tokens"):
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    s.ignore_eos = bool(body.ignore_eos)
    s.stop_token_ids.extend(body.stop_token_ids or [])
    top = _chat_logprobs(body) if isinstance(body, ChatBody) else _completion_checks(body)
    if top is not None:
        s.logprobs = top
    return s, top


def _constraint(body: ChatBody | CompletionBody) -> tuple[str, Constraint] | None:
    """The output constraint the body asks for, and the parameter that asked; None if none. Checked by the
    gateway's request check (`request.check`), which names that parameter when it does not compile."""
    asked: list[tuple[str, Constraint]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", Constraint("json_schema", '{"type": "object"}')))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format", "response_format: json_schema needs json_schema.schema")
        spec = json.dumps(fmt.json_schema.schema_)
        asked.append(("response_format", Constraint("json_schema", spec, bool(fmt.json_schema.strict))))
    if body.guided_json is not None:
        spec = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        asked.append(("guided_json", Constraint("json_schema", spec)))
    if body.guided_regex is not None:
        asked.append(("guided_regex", Constraint("regex", body.guided_regex)))
    if body.guided_choice is not None:
        lark = "start: " + " | ".join(json.dumps(choice) for choice in body.guided_choice)
        asked.append(("guided_choice", Constraint("lark", lark)))
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", Constraint("lark", body.guided_grammar)))
    if len(asked) > 1:
        raise invalid(asked[1][0], f"{asked[1][0]}: only one of {', '.join(p for p, _ in asked)} may be given")
    return asked[0] if asked else None


def _chat_logprobs(body: ChatBody) -> int | None:
    if body.logprobs:
        return body.top_logprobs or 0
    if body.top_logprobs is not None:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return None


def _completion_checks(body: CompletionBody) -> int | None:
    if body.echo:
        raise invalid("echo", "echo is not supported")
    if body.suffix:
        raise invalid("suffix", "suffix is not supported")
    return body.logprobs


def _stop(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _prompt(prompt: str | list[int] | list[str | list[int]]) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(t, int) for t in prompt):
        return None, [t for t in prompt if isinstance(t, int)]
    raise invalid("prompt", "prompt must be a string or a list of token ids (one prompt per request)")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict:
    """The body's JSON object; RequestError naming what is wrong (bad JSON, nesting too deep for the parser, a
    lone surrogate, which no tokenizer or protobuf string can hold)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid(None, "the request body nests too deeply") from None
    except ValueError as e:
        raise invalid(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    if not _SURROGATE_ESCAPE.search(raw):  # valid UTF-8 holds no surrogates: only a \uD8xx..\uDFxx escape can
        return body
    for name, value in body.items():
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid(name, f"{name} holds a lone UTF-16 surrogate: not valid Unicode text") from None
        except RecursionError:
            raise invalid(name, f"{name} nests too deeply") from None
    return body
