"""Traces, metrics and request logs of the real services: one trace per request across three processes."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import math
from collections import defaultdict

import grpc
import pytest
from opentelemetry import trace

from pdserve.client import Client
from pdserve.logs import JsonFormatter, TextFormatter, log_request
from pdserve.trace_console import format_tree
from pdserve.tracing import Tracing, TracingConfig, inject
from tests.stack import scrape

N = 3
# the stack's workers register their caches where NIXL is installed (--kv-plane auto)
PATH = "one-sided" if importlib.util.find_spec("nixl_cu13") or importlib.util.find_spec("nixl_cu12") else "staged"
PROMPTS = ["The tide came in and", "Write one line about a lighthouse keeper who", "Count: one, two,"]


def total(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def kv_bytes(model_dir, prompt_tokens: int, block_size: int = 16, itemsize: int = 4) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block = block_size * cfg["num_key_value_heads"] * head_dim * itemsize
    return cfg["num_hidden_layers"] * 2 * math.ceil(prompt_tokens / block_size) * block


@pytest.mark.slow
async def test_one_trace_per_request_across_three_processes(observed_stack, model_dir):
    stack, otlp, logs = observed_stack
    before = {role: scrape(url) for role, url in stack.metrics.items()}
    async with Client(stack.gateway) as client:
        done = await asyncio.gather(
            *(
                client.complete(prompt=p, max_tokens=6, ignore_eos=True, request_id=f"obs-{i}")
                for i, p in enumerate(PROMPTS)
            )
        )
    after = {role: scrape(url) for role, url in stack.metrics.items()}
    stack.wait_idle()

    def by_request(spans):
        ids = defaultdict(set)
        for s in spans:
            if "pdserve.request_id" in s.attributes:
                ids[s.attributes["pdserve.request_id"]].add(s.trace_id)
        return ids

    wanted = {
        "gateway.tokenize",
        "gateway.route",
        "decode.admit",
        "decode.first_token",
        "decode.stream",
        "prefill.queue",
        "prefill.forward",
        "kv.transfer",
        "kv.receive",
    }

    def complete(spans, rid: str) -> bool:
        """The request's spans are one trace whose every parent has arrived, and hold every wanted name."""
        ids = by_request(spans)[rid]
        tree = [s for s in spans if s.trace_id in ids]
        have = {s.span_id for s in tree}
        return (
            len(ids) == 1
            and wanted <= {s.name for s in tree}
            and all(s.parent_id in have or not s.parent_id for s in tree)
        )

    spans = otlp.wait_for(lambda spans: all(complete(spans, f"obs-{i}") for i in range(N)))
    ours = {f"obs-{i}" for i in range(N)}  # the session's stack also serves other tests
    trace_ids = {rid: ids.pop() for rid, ids in by_request(spans).items() if rid in ours}
    assert len(set(trace_ids.values())) == N  # one trace per request, none shared

    for i, result in enumerate(done):
        tree = otlp.trace(trace_ids[f"obs-{i}"])
        assert {s.service for s in tree} == {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"}
        one = {}
        for s in tree:
            one.setdefault((s.name, s.kind), []).append(s)
        names = {name for name, _ in one}
        assert wanted <= names, names
        text = format_tree(tree)
        print(text)
        assert all(name in text for name in wanted) and len(text.splitlines()) == len(tree) + 1

        def only(name, kind=None, one=one):
            matches = [s for (n, k), ss in one.items() for s in ss if n == name and kind in (None, k)]
            assert len(matches) == 1, (name, kind, matches)
            return matches[0]

        gw = only("/pdserve.v1.Generation/Generate", "SERVER")
        to_decode = only("/pdserve.v1.DecodeService/Decode", "CLIENT")
        decode = only("/pdserve.v1.DecodeService/Decode", "SERVER")
        first = only("decode.first_token")
        to_prefill = only("/pdserve.v1.PrefillService/Prefill", "CLIENT")
        prefill = only("/pdserve.v1.PrefillService/Prefill", "SERVER")
        send, receive = only("kv.transfer"), only("kv.receive")
        links = [
            (gw, None),
            (to_decode, gw),
            (decode, to_decode),
            (first, decode),
            (only("gateway.tokenize"), gw),
            (only("gateway.route"), gw),
            (only("decode.admit"), decode),
            (only("decode.stream"), decode),
            (to_prefill, first),
            (prefill, to_prefill),
            (only("prefill.queue"), prefill),
            (only("prefill.forward"), prefill),
            (send, prefill),
            (receive, send),
        ]
        for span, parent in links:
            assert span.parent_id == (parent.span_id if parent else ""), (span.name, span.service)
        assert gw.service == to_decode.service == "pdserve-gateway"
        assert decode.service == receive.service == "pdserve-decode"
        assert prefill.service == send.service == "pdserve-prefill"

        shipped = kv_bytes(model_dir, result.prompt_tokens)
        assert send.attributes["kv.bytes"] == receive.attributes["kv.bytes"] == shipped
        assert send.attributes["kv.layers"] == json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        assert send.attributes["kv.blocks"] == math.ceil(result.prompt_tokens / 16)
        assert send.attributes["kv.gbps"] > 0 and send.attributes["kv.transport"] == "ucx"
        assert send.attributes["kv.path"] == receive.attributes["kv.path"] == PATH
        assert 0 < send.attributes["kv.tail_seconds"] <= send.attributes["kv.seconds"]
        stream = only("decode.stream")
        assert stream.attributes["pdserve.completion_tokens"] == result.completion_tokens == 6
        assert stream.attributes["pdserve.finish_reason"] == "length"
        assert gw.attributes["pdserve.prompt_tokens"] == result.prompt_tokens

    # metrics moved by exactly these N requests
    tokens = sum(r.completion_tokens for r in done)
    shipped = sum(kv_bytes(model_dir, r.prompt_tokens) for r in done)

    def delta(role, name, **labels):
        return total(after[role], name, **labels) - total(before[role], name, **labels)

    assert delta("gateway", "pdserve_gateway_requests_total", status="OK", finish_reason="length") == N
    assert delta("gateway", "pdserve_gateway_time_to_first_token_seconds_count") == N
    assert delta("gateway", "pdserve_gateway_e2e_request_latency_seconds_count") == N
    assert delta("gateway", "pdserve_gateway_inter_token_latency_seconds_count") == tokens - N
    assert delta("gateway", "pdserve_gateway_generation_tokens_total") == tokens
    assert delta("gateway", "pdserve_gateway_prompt_tokens_total") == sum(r.prompt_tokens for r in done)
    assert delta("decode", "pdserve_decode_requests_total", status="ok") == N
    assert delta("decode", "pdserve_decode_time_to_first_token_seconds_count") == N
    assert delta("decode", "pdserve_decode_queue_time_seconds_count") == N
    assert delta("decode", "pdserve_decode_inter_token_latency_seconds_count") == tokens - N
    assert delta("decode", "pdserve_decode_generation_tokens_total") == tokens
    assert delta("decode", "pdserve_kv_transfer_received_bytes_total") == shipped
    assert delta("prefill", "pdserve_prefill_requests_total", status="ok") == N
    assert delta("prefill", "pdserve_prefill_queue_time_seconds_count") == N
    assert delta("prefill", "pdserve_kv_transfer_sent_bytes_total") == shipped
    assert delta("prefill", "pdserve_kv_transfer_seconds_count") == N
    assert delta("prefill", "pdserve_kv_transfers_sent_total", path=PATH) == N
    assert delta("decode", "pdserve_kv_transfers_received_total", path=PATH) == N
    assert delta("decode", "pdserve_kv_transfer_receive_tail_seconds_count") == N
    assert delta("prefill", "pdserve_prefill_prompt_tokens_total") == sum(r.prompt_tokens for r in done)
    assert delta("prefill", "pdserve_prefill_batch_tokens_count") >= 1
    idle = scrape(stack.metrics["decode"])
    assert total(idle, "pdserve_decode_kv_blocks", state="used") == 0
    assert total(idle, "pdserve_decode_kv_blocks", state="free") > 0
    assert total(idle, "pdserve_decode_requests_running") == 0

    # one structured line per request in every service, carrying the request's trace id
    for role in ("gateway", "decode", "prefill"):
        lines = [json.loads(line) for line in (logs / f"{role}.log").read_text().splitlines() if line.startswith("{")]
        finished = {rec["request_id"]: rec for rec in lines if rec["msg"] == "request"}
        for i in range(N):
            rec = finished[f"obs-{i}"]
            assert rec["trace_id"] == trace_ids[f"obs-{i}"], role
            assert rec["service"] == role and rec["status"] in ("OK", "ok")


@pytest.mark.slow
async def test_failed_request_is_counted_by_status(observed_stack):
    stack, otlp, _ = observed_stack
    before = scrape(stack.metrics["gateway"])
    async with Client(stack.gateway) as client:
        with pytest.raises(Exception, match="does not exist"):
            await client.complete(prompt="hi", model="no-such-model")
    name = "pdserve_gateway_requests_total"
    for _ in range(50):  # the server counts after the client has its answer
        after = scrape(stack.metrics["gateway"])
        if total(after, name) > total(before, name):
            break
        await asyncio.sleep(0.1)
    assert total(after, name, status="NOT_FOUND") - total(before, name, status="NOT_FOUND") == 1


def test_tracing_off_records_nothing_and_installs_nothing():
    off = Tracing("pdserve-test", TracingConfig(endpoint=None))
    assert not off.enabled
    assert off.server_interceptors() == [] and off.client_interceptors() == []
    with off.tracer.start_as_current_span("x") as span:
        assert not span.is_recording()
        assert inject() == {}
    off.shutdown()


def test_tracing_on_propagates_through_a_carrier():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    sent, received = InMemorySpanExporter(), InMemorySpanExporter()
    sender, receiver = Tracing("a", exporter=sent), Tracing("b", exporter=received)
    with sender.tracer.start_as_current_span("send") as span:
        carrier = inject(span)
    from pdserve.tracing import extract

    receiver.tracer.start_span("receive", context=extract(carrier)).end()
    sender.shutdown()
    receiver.shutdown()
    spans = {s.name: s for s in [*sent.get_finished_spans(), *received.get_finished_spans()]}
    assert spans["receive"].parent.span_id == spans["send"].context.span_id
    assert spans["receive"].context.trace_id == spans["send"].context.trace_id


def test_request_log_line_formats():
    record = logging.LogRecord("pdserve.requests", logging.INFO, __file__, 1, "request", (), None)
    logger = logging.getLogger("pdserve.requests.test")
    captured: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = captured.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_request(logger, request_id="r1", trace_id="ab" * 16, status="OK", e2e_s=0.5)
    finally:
        logger.removeHandler(handler)
    record = captured[0]
    as_json = json.loads(JsonFormatter("gateway").format(record))
    assert as_json["request_id"] == "r1" and as_json["trace_id"] == "ab" * 16 and as_json["service"] == "gateway"
    text = TextFormatter("gateway").format(record)
    assert "request_id=r1" in text and f"trace_id={'ab' * 16}" in text and "e2e_s=0.5000" in text


async def test_cancelled_and_timed_out_requests_say_so_on_their_server_spans(observed_stack):
    """A client that cancels, and one whose deadline passes: the gateway's and the decode worker's server spans
    carry CANCELLED (1) and DEADLINE_EXCEEDED (4), not OK."""
    stack, otlp, _ = observed_stack
    async with Client(stack.gateway) as client:
        call = client.stream(prompt="Write a long essay", max_tokens=400, ignore_eos=True, request_id="obs-cancel")
        async for _ in call:
            break  # the first token arrived: the request is decoding
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(
                prompt="Write a long essay", max_tokens=400, ignore_eos=True, timeout=3.0, request_id="obs-deadline"
            )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle()
    methods = {"/pdserve.v1.Generation/Generate", "/pdserve.v1.DecodeService/Decode"}

    def server_spans(spans, rid):
        ids = {s.trace_id for s in spans if s.attributes.get("pdserve.request_id") == rid}
        return [s for s in spans if s.trace_id in ids and s.kind == "SERVER" and s.name in methods]

    spans = otlp.wait_for(
        lambda spans: all(len(server_spans(spans, rid)) == 2 for rid in ("obs-cancel", "obs-deadline"))
    )
    for rid, code in (("obs-cancel", grpc.StatusCode.CANCELLED), ("obs-deadline", grpc.StatusCode.DEADLINE_EXCEEDED)):
        for span in server_spans(spans, rid):
            assert span.attributes["rpc.grpc.status_code"] == code.value[0], (rid, span.name, span.attributes)
    # the gateway's client span of the call it cancelled says so too (it said nothing: status 0)
    ids = {sp.trace_id for sp in spans if sp.attributes.get("pdserve.request_id") == "obs-cancel"}
    spans = otlp.wait_for(
        lambda spans: any(
            sp.trace_id in ids and sp.kind == "CLIENT" and sp.name == "/pdserve.v1.DecodeService/Decode" for sp in spans
        )
    )
    (client,) = [
        sp
        for sp in spans
        if sp.trace_id in ids and sp.kind == "CLIENT" and sp.name == "/pdserve.v1.DecodeService/Decode"
    ]
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0], client.attributes


@pytest.mark.parametrize("ended_by", ["cancel", "deadline"])
async def test_a_stream_cut_while_the_server_writes_ends_its_span_with_the_cause(ended_by):
    """grpc cancels a streaming call wherever its task waits; a handler that never waits (replies ready, the
    client not reading) is cut inside grpc's write, so the handler only sees its generator closed at a `yield`.
    The span still says CANCELLED or DEADLINE_EXCEEDED, and the handler is closed before the span ends."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = Tracing("flood", exporter=exporter)
    closed: list[bool] = []

    async def flood(request: bytes, context):
        try:
            for _ in range(10_000):  # far more than the transport's windows hold
                yield b"x" * 65536
        finally:
            closed.append(trace.get_current_span().is_recording())

    handler = grpc.method_handlers_generic_handler("t.Flood", {"Flood": grpc.unary_stream_rpc_method_handler(flood)})
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.Flood/Flood")(b"", timeout=2.0 if ended_by == "deadline" else None)
            await call.read()
            if ended_by == "cancel":
                call.cancel()
            code = await asyncio.wait_for(call.code(), 30)
        for _ in range(300):
            if closed:
                break
            await asyncio.sleep(0.1)
    finally:
        await server.stop(None)
    tracing.shutdown()
    want = grpc.StatusCode.CANCELLED if ended_by == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED
    assert code == want
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "/t.Flood/Flood"]
    assert span.attributes["rpc.grpc.status_code"] == want.value[0], span.attributes
    assert closed == [True]


async def test_http_spans_carry_the_semantic_convention_attributes(observed_stack):
    """A trace backend filters HTTP requests by method, route and status: the OpenAI API's root spans say them."""
    import aiohttp

    stack, otlp, _ = observed_stack
    agent = {"User-Agent": "semconv-check/1"}
    async with aiohttp.ClientSession(headers=agent) as session:
        for body in ({"prompt": "Hi", "max_tokens": 2}, {"prompt": "Hi", "max_tokens": 0}):
            async with session.post(stack.http + "/v1/completions", json=body) as resp:
                await resp.read()

    def mine(spans):
        return [sp for sp in spans if sp.attributes.get("user_agent.original") == "semconv-check/1"]

    spans = mine(otlp.wait_for(lambda spans: len(mine(spans)) == 2))
    by_status = {sp.attributes["http.response.status_code"]: sp for sp in spans}
    assert set(by_status) == {200, 400}
    for sp in spans:
        assert sp.kind == "SERVER" and sp.name == "POST /v1/completions"
        assert sp.attributes["http.request.method"] == "POST" and sp.attributes["http.route"] == "/v1/completions"
        assert sp.attributes["url.path"] == "/v1/completions"
    assert by_status[400].attributes["error.type"] == "400" and "error.type" not in by_status[200].attributes


def test_constrained_requests_name_their_constraint_on_their_spans():
    """decode.admit and prefill.forward carry pdserve.constraint (the kind) for a constrained request only."""
    import time

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.decode_service.observe import DecodeObserver
    from pdserve.engine.grammar import Constraint
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.engine.sequence import Sequence
    from pdserve.prefill_service.observe import PrefillObserver
    from pdserve.wire import PrefillJob

    exporter = InMemorySpanExporter()
    tracing = Tracing("spans", exporter=exporter)
    decode, prefill = DecodeObserver(tracing.tracer), PrefillObserver(tracing.tracer)
    for rid, constraint in (("free", None), ("schema", Constraint("json_schema", '{"type": "object"}'))):
        params = SamplingParams(constraint=constraint)
        with decode.request(Sequence(rid, [1, 2, 3], params), "").admitting():
            pass
        job = PrefillJob(rid, [1, 2, 3], 3, params, "127.0.0.1:1", "fp", rid, "secret")
        now = time.time_ns()
        prefill.job(job).stepped(Sequence(rid, [1, 2, 3], params), ScheduledBatch(), now, now + 1000, last=True)
    tracing.shutdown()
    spans = exporter.get_finished_spans()
    admitted = {s.attributes["pdserve.request_id"]: s for s in spans if s.name == "decode.admit"}
    assert "pdserve.constraint" not in admitted["free"].attributes
    assert admitted["schema"].attributes["pdserve.constraint"] == "json_schema"
    forward = [s for s in spans if s.name == "prefill.forward"]
    assert [s.attributes.get("pdserve.constraint") for s in forward] == [None, "json_schema"]
