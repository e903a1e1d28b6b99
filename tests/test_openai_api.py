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
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
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
        ("/v1/completions", {"prompt": "hi", "speculative_tokens": 17}, 400, "speculative_tokens"),
        ("/v1/completions", {"prompt": "hi", "speculative_tokens": -1}, 400, "speculative_tokens"),
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
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("functions", [{"name": "weather", "parameters": {"type": "object"}}]),
        ("tool_choice", "required"),  # without tools
        ("frobnicate", 1),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        ("guided_regex", "a(b"),
        ("guided_grammar", "start: missing_rule"),
        ("guided_json", "{not json"),
    ],
    ids=[
        "audio",
        "functions",
        "tool_choice-without-tools",
        "unknown",
        "bad-schema",
        "bad-regex",
        "bad-grammar",
        "bad-json",
    ],
)
async def test_refused_fields_get_400_naming_them(stack, field, value):
    """Nothing is silently dropped: a field this server does not implement, or does not know, is refused, and so
    is a constraint that does not compile."""
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        async with s.post(stack.http + "/v1/chat/completions", json={**CHAT, field: value}) as resp:
            got = await resp.json()
    assert resp.status == 400 and got["error"]["param"] == field, got


async def test_response_format_text_is_the_default_and_accepted(stack):
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sesame"}) as s:
        body = {**CHAT, "response_format": {"type": "text"}}
        async with s.post(stack.http + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "day": {"enum": ["mon", "tue", "wed"]},
                    "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
                    "rain_mm": {"type": "number", "minimum": 0, "maximum": 99},
                },
                "required": ["day", "celsius"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"type": "string", "maxLength": 30},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


async def test_json_schema_answers_validate_through_the_official_client(stack):
    """response_format json_schema on the disaggregated stack (the prefill worker samples the first token under
    the grammar, the decode worker goes on from it): greedy and seeded draws, streamed and not, all validate."""
    import jsonschema

    client = _client(stack)
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER, "strict": True}}
    messages = [{"role": "user", "content": "The weather in Paris for three days, as JSON."}]
    answers = []
    before = _grammar_counts(stack)
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.8, "seed": 2}):
        chat = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=200, response_format=fmt, **sampling
        )
        text = chat.choices[0].message.content
        jsonschema.validate(json.loads(text), WEATHER)
        assert chat.choices[0].finish_reason == "stop"
        streamed = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            max_tokens=200,
            response_format=fmt,
            stream=True,
            **sampling,
        )
        pieces = [c.choices[0].delta.content or "" async for c in streamed if c.choices]
        assert "".join(pieces) == text  # the same draws streamed
        answers.append(text)
    assert len(set(answers)) > 1
    after = _grammar_counts(stack)
    for role in ("prefill", "decode"):  # six requests, one schema: compiled at most once per worker, then copied
        compiled, hits = (after[role][i] - before[role][i] for i in (0, 1))
        assert compiled <= 1 and compiled + hits == 6, (role, before, after)
        assert after[role][2] > 0  # seconds spent compiling
    mode = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Ada is 36. Her name and age as a JSON object."}],
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(mode.choices[0].message.content), dict), mode.choices[0].message.content


async def test_vllm_guided_fields_on_completions(stack):
    client = _client(stack)
    choices = ["sunny", "rainy", 'a "cloudy" day']
    for seed in (1, 2, 3):
        got = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Tomorrow will be",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert got.choices[0].text in choices and got.choices[0].finish_reason == "stop"
    got = await client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The year the first moon landing happened:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": "[12][0-9]{3}"},
    )
    assert len(got.choices[0].text) == 4 and got.choices[0].text.isdigit()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


async def test_tool_calls_through_the_official_client(stack):
    """required and a named function: the client parses message.tool_calls, whose arguments validate against the
    function's parameters, whole and streamed; auto answers either text or calls of offered functions."""
    import jsonschema

    client = _client(stack)
    params = {f["function"]["name"]: f["function"]["parameters"] for f in TOOLS}
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        chat = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=0,
        )
        got = chat.choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content is None and got.message.tool_calls
        for call in got.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        if choice is named:
            assert [c.function.name for c in got.message.tool_calls] == ["get_weather"]
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=0,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls
        ]
    # the tool's answer goes back as a tool message; the model then answers in text or calls again
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in got.message.tool_calls]},
        {"role": "tool", "tool_call_id": got.message.tool_calls[0].id, "content": "18 degrees, sunny"},
    ]
    auto = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=history, tools=TOOLS, max_tokens=60, temperature=0
    )
    answer = auto.choices[0]
    if answer.finish_reason == "tool_calls":
        assert all(c.function.name in params for c in answer.message.tool_calls)
    else:
        assert answer.message.content and not answer.message.tool_calls


def _grammar_counts(stack) -> dict[str, tuple[float, float, float]]:
    """Each worker's grammar compiles, cache hits and compile seconds, from its /metrics page."""
    counts = {}
    for role in ("prefill", "decode"):
        page = scrape(stack.metrics[role])
        counts[role] = tuple(  # type: ignore[assignment]
            page.get((f"pdserve_{role}_grammar_{name}_total", frozenset()), 0.0)
            for name in ("compiles", "cache_hits", "compile_seconds")
        )
    return counts


def _speculated(stack) -> tuple[float, float]:
    page = scrape(stack.metrics["decode"])
    return tuple(  # type: ignore[return-value]
        page.get((f"pdserve_decode_speculative_{kind}_tokens_total", frozenset()), 0.0)
        for kind in ("proposed", "accepted")
    )


async def test_speculative_tokens_extension_keeps_the_text(stack):
    """pdserve's speculative_tokens field turns prompt lookup on for one request (this worker's default is off):
    the greedy text is the same, and the decode worker counts what it guessed and kept."""
    phrase = "red, green, blue, yellow, "
    kw = dict(model="SmolLM2-135M-Instruct", prompt="Colours: " + phrase * 6, max_tokens=48, temperature=0.0)
    before = _speculated(stack)
    async with _client(stack) as client:
        plain = await client.completions.create(**kw)
        fast = await client.completions.create(**kw, extra_body={"speculative_tokens": 6})
    assert fast.choices[0].text == plain.choices[0].text
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    after = _speculated(stack)
    proposed, accepted = after[0] - before[0], after[1] - before[1]
    assert proposed > 0 and 0 < accepted <= proposed


def _prefill_computed(stack) -> float:
    """Prompt tokens the prefill worker computed so far: its prompt tokens less its prefix-cache hits."""
    page = scrape(stack.metrics["prefill"])
    hits = page.get(("pdserve_prefill_prefix_cache_hit_tokens_total", frozenset()), 0.0)
    return page.get(("pdserve_prefill_prompt_tokens_total", frozenset()), 0.0) - hits


def _decode_received(stack) -> tuple[float, float]:
    """KV bytes the decode worker received so far, and prompt tokens its prefix cache held."""
    page = scrape(stack.metrics["decode"])
    return (
        page.get(("pdserve_kv_transfer_received_bytes_total", frozenset()), 0.0),
        page.get(("pdserve_decode_prefix_cache_hit_tokens_total", frozenset()), 0.0),
    )


def _kv_block_bytes(hf_model) -> int:
    """Bytes of one KV block of the stack's cache: 16 tokens, K and V, every layer, fp32."""
    c = hf_model.config
    return 16 * 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


async def test_n_choices_cost_one_prefill_and_repeat_per_seed(stack, hf_model):
    """n=4 on a ~500-token prompt never seen: four distinct choices, the prompt computed once (the other choices
    compute only its last, partial block) and sent to the decode worker once (the other choices reserve the
    blocks that landed for the first one and are sent only the last block), usage counting the prompt once.
    Seeded choices repeat, streamed or not, and best_of returns the n with the best mean logprob. (The repeats draw
    among ten digits: over the whole vocabulary at temperature 1 a draw can flip with the last bits of the logits,
    which move with the batch a choice happens to share.)"""
    import random
    import re

    client = _client(stack)
    rng = random.Random(5)
    prompt = "Words: " + " ".join(rng.choice(["red", "sky", "tree", "blue", "stone", "river"]) for _ in range(480))
    kw = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 1.0}
    before, received_before = _prefill_computed(stack), _decode_received(stack)
    got = await client.completions.create(n=4, extra_body={"ignore_eos": True}, **kw)
    computed = _prefill_computed(stack) - before
    prompt_tokens = got.usage.prompt_tokens
    assert prompt_tokens > 450 and prompt_tokens <= computed <= prompt_tokens + 3 * 16, (computed, prompt_tokens)
    received, held = (b - a for a, b in zip(received_before, _decode_received(stack)))
    blocks = -(-prompt_tokens // 16)
    assert received == (blocks + 3) * _kv_block_bytes(hf_model), (received, blocks)
    assert held == 3 * 16 * ((prompt_tokens - 1) // 16)
    assert [c.index for c in got.choices] == [0, 1, 2, 3] and len({c.text for c in got.choices}) > 1
    assert got.usage.completion_tokens == 4 * 8

    digits = {**kw, "seed": 11, "extra_body": {"guided_regex": "[0-9]{8}"}, "max_tokens": 20}
    first = await client.completions.create(n=4, **digits)
    texts = [c.text for c in first.choices]
    assert all(re.fullmatch("[0-9]{8}", t) for t in texts) and len(set(texts)) > 1, texts
    again = await client.completions.create(n=4, **digits)
    assert [c.text for c in again.choices] == texts
    stream = await client.completions.create(n=4, stream=True, **digits)
    streamed = ["", "", "", ""]
    async for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    scored = await client.completions.create(n=4, logprobs=0, **digits)
    means = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in scored.choices}
    best = await client.completions.create(n=2, best_of=4, **digits)
    assert [c.text for c in best.choices] == sorted(texts, key=lambda t: -means[t])[:2]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == first.usage.completion_tokens
    chat = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name a colour."}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=3,
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in chat.choices)


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
