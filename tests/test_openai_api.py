"""The OpenAI-compatible HTTP API on a live stack: the official `openai` client, raw SSE framing, errors in
OpenAI's shape naming the parameter, and a client that disconnects freeing every block."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.conftest import EOS, hf_greedy, until_eos
from tests.stack import scrape, start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    s = start_stack(gateway_extra=["--api-key", "sesame"])
    yield s
    s.stop()


def _client(stack, key: str = "sesame"):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=stack.http + "/v1", api_key=key, max_retries=0, timeout=120)


async def test_official_client_gets_transformers_greedy_text(stack, hf_model, tokenizer):
    client = _client(stack)
    messages = [{"role": "user", "content": "Name three colours."}]
    want_chat = until_eos(hf_greedy(hf_model, tokenizer.apply_chat_template(messages), 20))
    want_text = tokenizer.decode(want_chat)
    chat = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20, temperature=0
    )
    assert chat.choices[0].message.content == want_text and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(want_chat)
    assert chat.choices[0].finish_reason == ("stop" if want_chat[-1] == EOS else "length")
    streamed = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, roles = [], None, []
    async for chunk in streamed:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            roles.append(chunk.choices[0].delta.role)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == want_text and roles[0] == "assistant" and usage.completion_tokens == len(want_chat)

    prompt = "The capital of France is"
    want = until_eos(hf_greedy(hf_model, tokenizer.encode(prompt), 12))
    done = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == tokenizer.decode(want)
    ids = await client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=tokenizer.encode(prompt), max_tokens=12, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in ids if c.choices]) == tokenizer.decode(want)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    stack.wait_idle()


async def test_sse_framing_and_logprobs_raw(stack):
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        async with s.post(stack.http + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks, usage = payloads[:-1], payloads[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert "prompt_tokens_details" in usage["usage"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    lp = [c["choices"][0]["logprobs"] for c in chunks]
    assert all(len(x["tokens"]) == len(x["token_logprobs"]) == len(x["top_logprobs"]) for x in lp)
    assert all(len(t) == 2 for x in lp for t in x["top_logprobs"])


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 3}, 400, "top_p"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ],
)
async def test_bad_parameters_are_named_in_openai_errors(stack, path, body, status, param):
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        async with s.post(stack.http + path, json=body) as resp:
            got = await resp.json()
    assert resp.status == status, got
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


async def test_api_key_is_required(stack):
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.http + "/v1/completions", json={"prompt": "hi"}) as resp:
            got = await resp.json()
        assert resp.status == 401 and got["error"]["code"] == "invalid_api_key"
        async with s.get(stack.http + "/health") as resp:
            assert resp.status == 200


async def test_disconnect_cancels_the_request_everywhere(stack):
    """Two 500-token requests whose clients leave early (one streaming, one waiting for the whole answer): the
    decode worker stops generating for both and every block comes back."""
    stack.wait_idle()
    steps = ("pdserve_decode_batch_size_sum", frozenset())
    before = scrape(stack.metrics["decode"])[steps]
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        body = {"prompt": "Count from one to a thousand:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with s.post(stack.http + "/v1/completions", json=body) as resp:
            seen = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    seen += 1
                if seen >= 3:
                    break
        # the connection is closed here, mid-stream
        body["stream"] = False
        task = asyncio.ensure_future(s.post(stack.http + "/v1/completions", json=body))
        await asyncio.sleep(1.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    stack.wait_idle(timeout=60)
    assert scrape(stack.metrics["decode"])[steps] - before < 500, "generation went on after the clients left"


CHAT = {"messages": [{"role": "user", "content": "What is the weather?"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]),
        ("tool_choice", "auto"),
        ("parallel_tool_calls", True),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}),
        ("frobnicate", 1),
    ],
    ids=["tools", "tool_choice", "parallel_tool_calls", "json_object", "json_schema", "unknown"],
)
async def test_unimplemented_fields_get_400_naming_them(stack, field, value):
    """Nothing is silently dropped: a field this server does not implement, or does not know, is refused."""
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        async with s.post(stack.http + "/v1/chat/completions", json={**CHAT, field: value}) as resp:
            got = await resp.json()
    assert resp.status == 400 and got["error"]["param"] == field, got


async def test_response_format_text_is_the_default_and_accepted(stack):
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        body = {**CHAT, "response_format": {"type": "text"}}
        async with s.post(stack.http + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()


async def test_logit_bias_steers_sampling(stack, tokenizer):
    """+100 on one token makes greedy decoding pick it every step; -100 on the greedy token makes it pick another;
    over HTTP and gRPC alike."""
    from pdserve.client import Client

    prompt = "The capital of France is"
    forced = tokenizer.encode(" banana")[0]
    async with Client(stack.gateway, api_key="sesame") as client:
        plain = await client.complete(prompt, max_tokens=3, temperature=0.0)
        pushed = await client.complete(prompt, max_tokens=3, temperature=0.0, logit_bias={forced: 100.0})
        banned = await client.complete(prompt, max_tokens=1, temperature=0.0, logit_bias={plain.token_ids[0]: -100.0})
    assert pushed.token_ids == [forced] * 3
    assert banned.token_ids[0] != plain.token_ids[0]
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": {str(forced): 100}}
        async with s.post(stack.http + "/v1/completions", json=body) as resp:
            text = (await resp.json())["choices"][0]["text"]
        assert text == pushed.text
        for bad in ({"x": 1}, {str(forced): 101}, {str(forced): "high"}):
            async with s.post(stack.http + "/v1/completions", json={**body, "logit_bias": bad}) as resp:
                got = await resp.json()
            assert resp.status == 400 and got["error"]["param"] == "logit_bias", got


async def test_one_model_and_metrics_on_the_api_port(stack):
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        async with s.get(stack.http + "/v1/models") as resp:
            name = (await resp.json())["data"][0]["id"]
        async with s.get(stack.http + f"/v1/models/{name}") as resp:
            card = await resp.json()
        assert resp.status == 200 and card["id"] == name and card["object"] == "model"
        async with s.get(stack.http + "/v1/models/gpt-9") as resp:
            got = await resp.json()
        assert resp.status == 404 and got["error"]["code"] == "model_not_found" and got["error"]["param"] == "model"
        async with s.get(stack.http + "/metrics") as resp:
            page = await resp.text()
        assert resp.status == 200 and "pdserve_gateway_workers" in page
    async with aiohttp.ClientSession() as s, s.get(stack.http + "/metrics") as resp:
        assert resp.status == 401  # behind the key, like the API
