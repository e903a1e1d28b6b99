from pdserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_address", "num_prompt_tokens", "prefill_may_refuse")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MAY_REFUSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    num_prompt_tokens: int
    prefill_may_refuse: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., prefill_may_refuse: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "cached_prompt_tokens", "stream_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    cached_prompt_tokens: int
    stream_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ..., stream_id: _Optional[str] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("stream_id", "reason")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    reason: _common_pb2.FinishReason
    def __init__(self, stream_id: _Optional[str] = ..., reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("finished",)
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    finished: bool
    def __init__(self, finished: _Optional[bool] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("address", "layout_fingerprint", "transfer_id", "secret")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    address: str
    layout_fingerprint: str
    transfer_id: str
    secret: str
    def __init__(self, address: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., transfer_id: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "kv_target", "start_within_s", "may_refuse", "skip_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    START_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    MAY_REFUSE_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    kv_target: KVTarget
    start_within_s: float
    may_refuse: bool
    skip_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_target: _Optional[_Union[KVTarget, _Mapping]] = ..., start_within_s: _Optional[float] = ..., may_refuse: _Optional[bool] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class TransferFigures(_message.Message):
    __slots__ = ("bytes", "seconds", "layers", "blocks", "transport", "path", "tail_seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    layers: int
    blocks: int
    transport: str
    path: str
    tail_seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., layers: _Optional[int] = ..., blocks: _Optional[int] = ..., transport: _Optional[str] = ..., path: _Optional[str] = ..., tail_seconds: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_id", "logprob", "cached_tokens", "computed_tokens", "transfer")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    computed_tokens: int
    transfer: TransferFigures
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., transfer: _Optional[_Union[TransferFigures, _Mapping]] = ...) -> None: ...

class WatchCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("snapshot", "stored", "removed", "block_size")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "model", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "block_size", "running", "waiting", "prefix_hit_tokens", "requests_total", "kv_address", "max_model_len", "pending_transfers", "preemptions_total", "local_prefills_total", "remote_prefills_total", "queued_tokens", "local_prefill_max_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    block_size: int
    running: int
    waiting: int
    prefix_hit_tokens: int
    requests_total: int
    kv_address: str
    max_model_len: int
    pending_transfers: int
    preemptions_total: int
    local_prefills_total: int
    remote_prefills_total: int
    queued_tokens: int
    local_prefill_max_tokens: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., block_size: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., requests_total: _Optional[int] = ..., kv_address: _Optional[str] = ..., max_model_len: _Optional[int] = ..., pending_transfers: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., local_prefills_total: _Optional[int] = ..., remote_prefills_total: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., local_prefill_max_tokens: _Optional[int] = ...) -> None: ...
