from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "contextual_penalty", "penalty_window")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONTEXTUAL_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int
    contextual_penalty: float
    penalty_window: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., contextual_penalty: _Optional[float] = ..., penalty_window: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "raw", "sampling", "max_new_tokens", "stop", "ignore_eos", "method", "context_id", "request_id", "timeout_s", "messages", "stream_interval_s")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    raw: bool
    sampling: SamplingParams
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    method: str
    context_id: str
    request_id: str
    timeout_s: float
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    stream_interval_s: float
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., raw: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., method: _Optional[str] = ..., context_id: _Optional[str] = ..., request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., stream_interval_s: _Optional[float] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("tau", "acceptance_by_depth", "ttft_s", "tokens_per_s", "cached_prefix_tokens", "prompt_tokens", "generated_tokens", "steps", "mean_batch_size", "prefill_time_s", "decode_time_s", "drafted_tokens", "method", "replica", "latency_s", "queue_time_s", "controller_plain_steps", "controller_probe_steps", "controller_verified_nodes", "controller_proposed_nodes")
    TAU_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_PROBE_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_VERIFIED_NODES_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_PROPOSED_NODES_FIELD_NUMBER: _ClassVar[int]
    tau: float
    acceptance_by_depth: _containers.RepeatedScalarFieldContainer[float]
    ttft_s: float
    tokens_per_s: float
    cached_prefix_tokens: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    mean_batch_size: float
    prefill_time_s: float
    decode_time_s: float
    drafted_tokens: int
    method: str
    replica: str
    latency_s: float
    queue_time_s: float
    controller_plain_steps: int
    controller_probe_steps: int
    controller_verified_nodes: int
    controller_proposed_nodes: int
    def __init__(self, tau: _Optional[float] = ..., acceptance_by_depth: _Optional[_Iterable[float]] = ..., ttft_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., cached_prefix_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., prefill_time_s: _Optional[float] = ..., decode_time_s: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., method: _Optional[str] = ..., replica: _Optional[str] = ..., latency_s: _Optional[float] = ..., queue_time_s: _Optional[float] = ..., controller_plain_steps: _Optional[int] = ..., controller_probe_steps: _Optional[int] = ..., controller_verified_nodes: _Optional[int] = ..., controller_proposed_nodes: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "accepted_tokens", "batch_size", "final", "finish_reason", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    accepted_tokens: int
    batch_size: int
    final: bool
    finish_reason: str
    stats: Stats
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., accepted_tokens: _Optional[int] = ..., batch_size: _Optional[int] = ..., final: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: Stats
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaHealth(_message.Message):
    __slots__ = ("name", "live_sequences", "waiting", "free_kv_slots", "total_kv_slots", "steps", "finished", "aborted", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    live_sequences: int
    waiting: int
    free_kv_slots: int
    total_kv_slots: int
    steps: int
    finished: int
    aborted: int
    counters: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., live_sequences: _Optional[int] = ..., waiting: _Optional[int] = ..., free_kv_slots: _Optional[int] = ..., total_kv_slots: _Optional[int] = ..., steps: _Optional[int] = ..., finished: _Optional[int] = ..., aborted: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "replicas", "queue_depth", "in_flight", "rejected")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    status: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaHealth]
    queue_depth: int
    in_flight: int
    rejected: int
    def __init__(self, status: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaHealth, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "context_length", "methods", "default_method", "max_new_tokens_limit", "max_batch", "num_verifiers", "vocab_size", "context_cache", "cache_block_size", "max_queued", "dtype", "device", "linear_backend")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LINEAR_BACKEND_FIELD_NUMBER: _ClassVar[int]
    model: str
    context_length: int
    methods: _containers.RepeatedScalarFieldContainer[str]
    default_method: str
    max_new_tokens_limit: int
    max_batch: int
    num_verifiers: int
    vocab_size: int
    context_cache: bool
    cache_block_size: int
    max_queued: int
    dtype: str
    device: str
    linear_backend: str
    def __init__(self, model: _Optional[str] = ..., context_length: _Optional[int] = ..., methods: _Optional[_Iterable[str]] = ..., default_method: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., max_batch: _Optional[int] = ..., num_verifiers: _Optional[int] = ..., vocab_size: _Optional[int] = ..., context_cache: _Optional[bool] = ..., cache_block_size: _Optional[int] = ..., max_queued: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., linear_backend: _Optional[str] = ...) -> None: ...
