"""A thin Python client over the generated stubs of the gateway's `Generation` service."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from pdserve.finish_reason import from_proto
from pdserve.grpc_server import open_channel
from pdserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from pdserve.security import TLSConfig


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


def build_request(
    prompt: str | None = None,
    messages: Sequence[dict] | None = None,
    model: str = "",
    request_id: str = "",
    prompt_token_ids: Sequence[int] | None = None,
    **sampling,
) -> generation_pb2.GenerateRequest:
    """`sampling` takes the SamplingParams fields: max_tokens, temperature, top_p, seed, stop, ..."""
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    req = generation_pb2.GenerateRequest(
        model=model, request_id=request_id, sampling=common_pb2.SamplingParams(**sampling)
    )
    if prompt is not None:
        req.prompt = prompt
    elif prompt_token_ids is not None:
        req.token_ids.ids.extend(prompt_token_ids)
    elif messages is not None:
        req.chat.messages.extend(generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    return req


class Client:
    """`api_key` goes with every call (`authorization: Bearer <key>`); `tls` (a CA to verify the gateway, and a
    certificate where the server asks for one) switches the channel to TLS."""

    def __init__(
        self, address: str = "127.0.0.1:50051", api_key: str | None = None, tls: TLSConfig | None = None
    ) -> None:
        self.channel = open_channel(address, tls)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def stream(
        self, prompt: str | None = None, messages: Sequence[dict] | None = None, timeout: float | None = None, **kw
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Server-streaming Generate; cancel the returned call (or stop iterating) to cancel the request."""
        return self.stub.Generate(build_request(prompt, messages, **kw), timeout=timeout, metadata=self.metadata)

    async def complete(
        self, prompt: str | None = None, messages: Sequence[dict] | None = None, timeout: float | None = None, **kw
    ) -> Completion:
        out = Completion()
        async for resp in self.stream(prompt, messages, timeout=timeout, **kw):
            out.text += resp.text
            out.token_ids.extend(resp.token_ids)
            out.logprobs.extend(resp.logprobs)
            if resp.finish_reason:
                out.finish_reason = from_proto(resp.finish_reason) or ""
                out.prompt_tokens = resp.usage.prompt_tokens
                out.completion_tokens = resp.usage.completion_tokens
                out.cached_prompt_tokens = resp.usage.cached_prompt_tokens
        return out

    async def tokenize(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        req = generation_pb2.TokenizeRequest()
        if prompt is not None:
            req.prompt = prompt
        else:
            req.chat.messages.extend(generation_pb2.ChatMessage(**m) for m in messages or [])
        return list((await self.stub.Tokenize(req, metadata=self.metadata)).token_ids)

    async def list_models(self) -> list[generation_pb2.ModelInfo]:
        return list((await self.stub.ListModels(generation_pb2.ListModelsRequest(), metadata=self.metadata)).models)
