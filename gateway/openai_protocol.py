"""The OpenAI API's request bodies, validated by pydantic models and read into the gateway's own request.

OpenAI's parameters plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos, repetition_penalty, stop_token_ids) and
logit_bias. Types are strict (a string is not a number, a bool is not an integer) and ranges are the proto fields'
(a value beyond them is the caller's error, not a protobuf exception). A parameter this server does not implement
(tools, response_format other than text, ...) or does not know gets a 400 naming it, as OpenAI answers; so does
every value of the wrong type or out of range: a `RequestError` whose `param` is the field at fault.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.gateway.request import GenerationRequest, invalid
from pdserve.protos import common_pb2

MAX_TOP_LOGPROBS = 20
U32 = 2**32 - 1

# OpenAI parameters this server does not implement: refused by name rather than silently ignored (OpenAI itself
# refuses arguments it does not know); `response_format: {"type": "text"}` is the default and accepted
UNSUPPORTED: tuple[str, ...] = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
UNSUPPORTED += ("audio", "modalities", "prediction", "web_search_options", "reasoning_effort")

Count = Annotated[int, Field(ge=0, le=U32)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message: its role and text (other fields a client sends with it are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


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
    stop_token_ids: list[Count] | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=U32)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None


class CompletionBody(_Common):
    prompt: str | list[Count] | list[str | list[Count]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


@dataclass
class ParsedRequest:
    """A generation request read from an OpenAI body, and how to answer it."""

    request: GenerationRequest
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs


def parse_request(body: dict, chat: bool) -> ParsedRequest:
    """The gateway request an OpenAI body asks for; a RequestError naming the parameter when it is wrong."""
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise invalid(name, f"{name} is not supported by this server")
    body = {k: v for k, v in body.items() if k not in UNSUPPORTED}  # each one here is null: nothing asked
    parsed = _validate(ChatBody if chat else CompletionBody, body)
    sampling, top = _sampling(parsed)
    req = GenerationRequest(uuid.uuid4().hex, sampling, stop=_stop(parsed.stop), model=parsed.model)
    if isinstance(parsed, ChatBody):
        req.messages = [{"role": m.role, "content": m.text()} for m in parsed.messages]
    else:
        req.prompt, req.token_ids = _prompt(parsed.prompt)
    stream = bool(parsed.stream)
    include_usage = stream and bool((parsed.stream_options or {}).get("include_usage"))
    return ParsedRequest(req, stream, include_usage, top)


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
    for name in ("top_k", "min_tokens", "seed"):
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    s.ignore_eos = bool(body.ignore_eos)
    s.stop_token_ids.extend(body.stop_token_ids or [])
    if body.n not in (None, 1):
        raise invalid("n", "n must be 1: this server returns one choice per request")
    top = _chat_logprobs(body) if isinstance(body, ChatBody) else _completion_checks(body)
    if top is not None:
        s.logprobs = top
    return s, top


def _chat_logprobs(body: ChatBody) -> int | None:
    if body.response_format is not None and body.response_format.type != "text":
        raise invalid("response_format", "response_format is not supported by this server (only {'type': 'text'})")
    if body.logprobs:
        return body.top_logprobs or 0
    if body.top_logprobs is not None:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return None


def _completion_checks(body: CompletionBody) -> int | None:
    if body.best_of not in (None, 1):
        raise invalid("best_of", "best_of must be 1")
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
