"""Conversions between the engine's plain dataclasses and the pdserve.v1 protobuf messages (worker side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.grammar import Constraint
from pdserve.engine.sampling_params import SampleOutput, SamplingParams
from pdserve.protos import common_pb2, worker_pb2

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineStats

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "min_tokens",
    "speculative_tokens",
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> engine params; unset optional fields keep the engine defaults. Not validated here."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    return SamplingParams(
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        constraint=constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None,
        **kwargs,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, logit_bias=dict(params.logit_bias)
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(params.constraint))
    return msg


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint:
    """A set Constraint message -> the engine's; one with no kind set reads as an unknown kind (refused)."""
    kind = msg.WhichOneof("kind") or ""
    return Constraint(kind, getattr(msg, kind) if kind else "", msg.strict)


def constraint_to_proto(constraint: Constraint) -> common_pb2.Constraint:
    msg = common_pb2.Constraint(strict=constraint.strict)
    setattr(msg, constraint.kind, constraint.spec)
    return msg


def logprob_to_proto(sample: SampleOutput) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=sample.token_id,
        logprob=sample.logprob or 0.0,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in sample.top_logprobs],
    )


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> SampleOutput:
    return SampleOutput(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top])


@dataclass
class PrefillJob:
    """What a decode worker asks a prefill worker to do for one sequence (the in-process PrefillRequest)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    kv_address: str
    layout_fingerprint: str
    transfer_id: str
    transfer_secret: str
    start_within: float = 0.0  # seconds until the decode worker expires the transfer unless KV arrives (0: never)
    may_refuse: bool = False  # the caller can send it elsewhere: refuse it rather than start it too late
    skip_blocks: int = 0  # leading blocks whose KV the caller holds already: only the blocks after them are sent


@dataclass
class PrefillResult:
    sample: SampleOutput
    cached_tokens: int = 0
    computed_tokens: int = 0
    transfer: dict = field(default_factory=dict)


def job_to_proto(job: PrefillJob) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=job.request_id,
        token_ids=job.token_ids,
        num_prompt_tokens=job.num_prompt_tokens,
        sampling=sampling_to_proto(job.params),
        kv_target=worker_pb2.KVTarget(
            address=job.kv_address,
            layout_fingerprint=job.layout_fingerprint,
            transfer_id=job.transfer_id,
            secret=job.transfer_secret,
        ),
        start_within_s=job.start_within,
        may_refuse=job.may_refuse,
        skip_blocks=job.skip_blocks,
    )


def job_from_proto(msg: worker_pb2.PrefillRequest) -> PrefillJob:
    t = msg.kv_target
    return PrefillJob(
        msg.request_id,
        list(msg.token_ids),
        msg.num_prompt_tokens,
        sampling_from_proto(msg.sampling),
        t.address,
        t.layout_fingerprint,
        t.transfer_id,
        t.secret,
        msg.start_within_s,
        msg.may_refuse,
        msg.skip_blocks,
    )


def result_to_proto(result: PrefillResult) -> worker_pb2.PrefillResponse:
    t = result.transfer
    return worker_pb2.PrefillResponse(
        token_id=result.sample.token_id,
        logprob=logprob_to_proto(result.sample),
        cached_tokens=result.cached_tokens,
        computed_tokens=result.computed_tokens,
        transfer=worker_pb2.TransferFigures(
            bytes=t.get("bytes", 0),
            seconds=t.get("seconds", 0.0),
            layers=t.get("layers", 0),
            blocks=t.get("blocks", 0),
            transport=t.get("transport", ""),
            path=t.get("path", ""),
            tail_seconds=t.get("tail_seconds", 0.0),
        ),
    )


def result_from_proto(msg: worker_pb2.PrefillResponse, wants_logprobs: bool) -> PrefillResult:
    sample = logprob_from_proto(msg.logprob) if wants_logprobs else SampleOutput(msg.token_id)
    sample.token_id = msg.token_id
    t = msg.transfer
    return PrefillResult(
        sample,
        msg.cached_tokens,
        msg.computed_tokens,
        {
            "bytes": t.bytes,
            "seconds": t.seconds,
            "layers": t.layers,
            "blocks": t.blocks,
            "transport": t.transport,
            "path": t.path,
            "tail_seconds": t.tail_seconds,
        },
    )


def worker_stats(core: EngineStats, role: str, model: str, requests_total: int, **own: Any) -> dict[str, Any]:
    """A worker's `GetStats` fields: its engine's pool and queues as both roles report them, with `own` (what a role
    counts its own way, and its extra fields) over them."""
    return {
        "kv_blocks_total": core.kv_blocks_total,
        "kv_blocks_used": core.kv_blocks_used,
        "kv_blocks_cached": core.kv_blocks_cached,
        "block_size": core.block_size,
        "running": core.running,
        "waiting": core.waiting,
        "queued_tokens": core.queued_tokens,
        "prefix_hit_tokens": core.prefix_hit_tokens,
        "max_model_len": core.max_model_len,
        "preemptions_total": core.preemptions_total,
        "role": role,
        "model": model,
        "requests_total": requests_total,
        **own,
    }
