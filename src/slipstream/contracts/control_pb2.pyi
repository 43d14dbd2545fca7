from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("healthy", "model")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    model: str
    def __init__(self, healthy: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("healthy", "model", "pool", "num_waiting", "num_running", "backlog_prompt_tokens", "queue_backlog_seconds", "slo_deviation", "utilization", "kv_blocks_used", "kv_blocks_total", "preemptions_total", "prefill_tokens_per_second", "ttft_first_tokens", "ttft_met", "tpot_finished", "tpot_met", "prefill_load")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_BACKLOG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLO_DEVIATION_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MET_FIELD_NUMBER: _ClassVar[int]
    TPOT_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TPOT_MET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOAD_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    model: str
    pool: str
    num_waiting: int
    num_running: int
    backlog_prompt_tokens: int
    queue_backlog_seconds: float
    slo_deviation: float
    utilization: float
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions_total: int
    prefill_tokens_per_second: float
    ttft_first_tokens: int
    ttft_met: int
    tpot_finished: int
    tpot_met: int
    prefill_load: float
    def __init__(self, healthy: _Optional[bool] = ..., model: _Optional[str] = ..., pool: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., backlog_prompt_tokens: _Optional[int] = ..., queue_backlog_seconds: _Optional[float] = ..., slo_deviation: _Optional[float] = ..., utilization: _Optional[float] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., prefill_tokens_per_second: _Optional[float] = ..., ttft_first_tokens: _Optional[int] = ..., ttft_met: _Optional[int] = ..., tpot_finished: _Optional[int] = ..., tpot_met: _Optional[int] = ..., prefill_load: _Optional[float] = ...) -> None: ...

class SetPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class SetPoolResponse(_message.Message):
    __slots__ = ("previous_pool", "pool")
    PREVIOUS_POOL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    previous_pool: str
    pool: str
    def __init__(self, previous_pool: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...
