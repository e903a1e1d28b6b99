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

    def __init__(self, tokenizer: Tokenizer, chat: bool, model: str, top: int | None) -> None:
        self.tokenizer, self.chat, self.model, self.top = tokenizer, chat, model, top
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offset = 0

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

    def stream_choice(self, delta: Delta, first: bool) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            if delta.finish_reason and not delta.text and not first:
                d = {}
            return {"index": 0, "delta": d, "logprobs": self.logprobs(delta), "finish_reason": delta.finish_reason}
        return {"index": 0, "text": delta.text, "logprobs": self.logprobs(delta), "finish_reason": delta.finish_reason}

    def whole(self, text: str, logprobs: dict | None, finish: str, usage: common_pb2.Usage) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(usage),
        }
