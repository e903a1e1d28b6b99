"""The request path's deltas as OpenAI's JSON: whole completions, server-sent-event chunks, logprobs, usage, and
errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) with the HTTP status of their row in
the failure table."""

from __future__ import annotations

import json
import time
import uuid

from fastapi.responses import JSONResponse

from pdserve.gateway.request import Delta, RequestError
from pdserve.gateway.tokenizer import Tokenizer
from pdserve.gateway.tool_calls import ToolCall, ToolPlan
from pdserve.protos import common_pb2


def error_body(e: RequestError) -> tuple[int, dict]:
    row = e.failure
    return row.http, {
        "error": {"message": e.message, "type": row.openai_type, "param": e.param, "code": row.openai_code}
    }


def error_response(e: RequestError) -> JSONResponse:
    status, body = error_body(e)
    return JSONResponse(body, status_code=status)


class Renderer:
    """Turns the request path's deltas into OpenAI's JSON, for one request."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat: bool,
        model: str,
        top: int | None,
        tools: ToolPlan | None = None,
        index: int = 0,
    ) -> None:
        self.tokenizer, self.chat, self.model, self.top, self.tools = tokenizer, chat, model, top, tools
        self.index = index
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offset = 0
        self._first = True  # no chunk streamed yet
        # streamed deltas held back while the answer may be a tool call: all of them when the output is one by
        # construction, else until its first characters say (None: not holding)
        self._held: list[Delta] | None = [] if tools is not None and tools.choice != "none" else None

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, delta: Delta) -> dict | None:
        if self.top is None:
            return None
        if self.chat:
            content = []
            for lp in delta.logprobs:
                token = self._token(lp.token_id)
                content.append(
                    {
                        "token": token,
                        "logprob": lp.logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": (t := self._token(x.token_id)), "logprob": x.logprob, "bytes": list(t.encode())}
                            for x in lp.top
                        ],
                    }
                )
            return {"content": content}
        tokens, offsets = [], []
        for lp in delta.logprobs:
            tokens.append(self._token(lp.token_id))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in delta.logprobs],
            "top_logprobs": [{self._token(x.token_id): x.logprob for x in lp.top} for lp in delta.logprobs],
            "text_offset": offsets,
        }

    @staticmethod
    def usage(u: common_pb2.Usage) -> dict:
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        }

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def stream_choices(self, delta: Delta) -> list[dict]:
        """The choices to stream for one delta: none while a possible tool call is held back."""
        if self._held is None or self.tools is None:
            return [self.stream_choice(delta)]
        self._held.append(delta)
        if not delta.finish_reason:
            if self.tools.constrained or _may_be_call("".join(d.text for d in self._held)):
                return []
            held, self._held = self._held, None
            return [self.stream_choice(Delta.joined(held))]
        held, self._held = self._held, None
        merged = Delta.joined(held)
        calls = self._calls(merged.text, delta.finish_reason)
        if calls is None:
            return [self.stream_choice(merged)]
        d: dict = {"role": "assistant"} if self._first else {}
        d |= {"content": None, "tool_calls": [c.as_openai(i) for i, c in enumerate(calls)]}
        self._first = False
        return [{"index": self.index, "delta": d, "logprobs": self.logprobs(merged), "finish_reason": "tool_calls"}]

    def _calls(self, text: str, finish: str) -> list[ToolCall] | None:
        if self.tools is None or finish != "stop":
            return None
        return self.tools.calls(text)

    def stream_choice(self, delta: Delta) -> dict:
        """One delta as a streamed choice (the first one carries the role)."""
        first, self._first = self._first, False
        if self.chat:
            d = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            if delta.finish_reason and not delta.text and not first:
                d = {}
            return {
                "index": self.index,
                "delta": d,
                "logprobs": self.logprobs(delta),
                "finish_reason": delta.finish_reason,
            }
        return {
            "index": self.index,
            "text": delta.text,
            "logprobs": self.logprobs(delta),
            "finish_reason": delta.finish_reason,
        }

    def choice(self, text: str, logprobs: dict | None, finish: str) -> dict:
        """This renderer's choice of a whole answer (tool calls read out of it where the request offered tools)."""
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            calls = self._calls(text, finish)
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [c.as_openai() for c in calls]}
                finish = "tool_calls"
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def response(self, choices: list[dict], usage: common_pb2.Usage) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(usage),
        }

    def for_choice(self, index: int) -> Renderer:
        """A renderer for choice `index` of the same response (same id; its own stream state)."""
        other = Renderer(self.tokenizer, self.chat, self.model, self.top, self.tools, index)
        other.id, other.created = self.id, self.created
        return other


_CALL_STARTS = ("{", "[", "<tool_call>")


def _may_be_call(text: str) -> bool:
    """Whether an answer that begins with `text` may still be a tool call (auto): undecided while it is blank or
    a prefix of a call's opening."""
    head = text.lstrip()
    return not head or any(head.startswith(s) or s.startswith(head) for s in _CALL_STARTS)
