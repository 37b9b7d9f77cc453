from slotwise.v1 import prompt_pb2 as _prompt_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShiftPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHIFT_POLICY_UNSPECIFIED: _ClassVar[ShiftPolicy]
    SHIFT_POLICY_AUTO: _ClassVar[ShiftPolicy]
    SHIFT_POLICY_SHIFT: _ClassVar[ShiftPolicy]
    SHIFT_POLICY_GAP: _ClassVar[ShiftPolicy]
    SHIFT_POLICY_REPREFILL: _ClassVar[ShiftPolicy]
    SHIFT_POLICY_STOP: _ClassVar[ShiftPolicy]

class EvictionUnit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVICTION_UNIT_UNSPECIFIED: _ClassVar[EvictionUnit]
    EVICTION_UNIT_TOKEN: _ClassVar[EvictionUnit]
    EVICTION_UNIT_MESSAGE: _ClassVar[EvictionUnit]

class SpecType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_TYPE_UNSPECIFIED: _ClassVar[SpecType]
    SPEC_TYPE_NONE: _ClassVar[SpecType]
    SPEC_TYPE_NGRAM_SIMPLE: _ClassVar[SpecType]
    SPEC_TYPE_NGRAM_MAP_K: _ClassVar[SpecType]
    SPEC_TYPE_DRAFT_SIMPLE: _ClassVar[SpecType]
    SPEC_TYPE_NGRAM_MAP_K4V: _ClassVar[SpecType]
    SPEC_TYPE_NGRAM_MOD: _ClassVar[SpecType]
    SPEC_TYPE_NGRAM_CACHE: _ClassVar[SpecType]
    SPEC_TYPE_SUFFIX: _ClassVar[SpecType]
    SPEC_TYPE_DRAFT_MTP: _ClassVar[SpecType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_GRAMMAR: _ClassVar[FinishReason]

class Persistence(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PERSISTENCE_UNSPECIFIED: _ClassVar[Persistence]
    PERSISTENCE_MEMORY: _ClassVar[Persistence]
    PERSISTENCE_SAVED: _ClassVar[Persistence]
    PERSISTENCE_NOT_SAVED: _ClassVar[Persistence]

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_UNSPECIFIED: _ClassVar[SlotState]
    SLOT_STATE_FREE: _ClassVar[SlotState]
    SLOT_STATE_IDLE: _ClassVar[SlotState]
    SLOT_STATE_PREFILLING: _ClassVar[SlotState]
    SLOT_STATE_DECODING: _ClassVar[SlotState]

class CellKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CELL_KIND_UNSPECIFIED: _ClassVar[CellKind]
    CELL_KIND_TEXT: _ClassVar[CellKind]
    CELL_KIND_MEDIA: _ClassVar[CellKind]
    CELL_KIND_GENERATED: _ClassVar[CellKind]
SHIFT_POLICY_UNSPECIFIED: ShiftPolicy
SHIFT_POLICY_AUTO: ShiftPolicy
SHIFT_POLICY_SHIFT: ShiftPolicy
SHIFT_POLICY_GAP: ShiftPolicy
SHIFT_POLICY_REPREFILL: ShiftPolicy
SHIFT_POLICY_STOP: ShiftPolicy
EVICTION_UNIT_UNSPECIFIED: EvictionUnit
EVICTION_UNIT_TOKEN: EvictionUnit
EVICTION_UNIT_MESSAGE: EvictionUnit
SPEC_TYPE_UNSPECIFIED: SpecType
SPEC_TYPE_NONE: SpecType
SPEC_TYPE_NGRAM_SIMPLE: SpecType
SPEC_TYPE_NGRAM_MAP_K: SpecType
SPEC_TYPE_DRAFT_SIMPLE: SpecType
SPEC_TYPE_NGRAM_MAP_K4V: SpecType
SPEC_TYPE_NGRAM_MOD: SpecType
SPEC_TYPE_NGRAM_CACHE: SpecType
SPEC_TYPE_SUFFIX: SpecType
SPEC_TYPE_DRAFT_MTP: SpecType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_GRAMMAR: FinishReason
PERSISTENCE_UNSPECIFIED: Persistence
PERSISTENCE_MEMORY: Persistence
PERSISTENCE_SAVED: Persistence
PERSISTENCE_NOT_SAVED: Persistence
SLOT_STATE_UNSPECIFIED: SlotState
SLOT_STATE_FREE: SlotState
SLOT_STATE_IDLE: SlotState
SLOT_STATE_PREFILLING: SlotState
SLOT_STATE_DECODING: SlotState
CELL_KIND_UNSPECIFIED: CellKind
CELL_KIND_TEXT: CellKind
CELL_KIND_MEDIA: CellKind
CELL_KIND_GENERATED: CellKind

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("fingerprint", "num_slots", "num_cells_per_slot", "n_ctx_train", "can_shift", "uses_mrope", "batch_size", "ubatch_size", "num_queued", "num_active", "stats", "pool", "memory_kind", "num_checkpoints_per_slot", "num_checkpoint_bytes", "cache_type_k", "cache_type_v", "flash_attn", "num_bytes_per_cell")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    N_CTX_TRAIN_FIELD_NUMBER: _ClassVar[int]
    CAN_SHIFT_FIELD_NUMBER: _ClassVar[int]
    USES_MROPE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    UBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINTS_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_TYPE_K_FIELD_NUMBER: _ClassVar[int]
    CACHE_TYPE_V_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_PER_CELL_FIELD_NUMBER: _ClassVar[int]
    fingerprint: _prompt_pb2.Fingerprint
    num_slots: int
    num_cells_per_slot: int
    n_ctx_train: int
    can_shift: bool
    uses_mrope: bool
    batch_size: int
    ubatch_size: int
    num_queued: int
    num_active: int
    stats: EngineStats
    pool: KvPool
    memory_kind: _prompt_pb2.MemoryKind
    num_checkpoints_per_slot: int
    num_checkpoint_bytes: int
    cache_type_k: str
    cache_type_v: str
    flash_attn: str
    num_bytes_per_cell: int
    def __init__(self, fingerprint: _Optional[_Union[_prompt_pb2.Fingerprint, _Mapping]] = ..., num_slots: _Optional[int] = ..., num_cells_per_slot: _Optional[int] = ..., n_ctx_train: _Optional[int] = ..., can_shift: _Optional[bool] = ..., uses_mrope: _Optional[bool] = ..., batch_size: _Optional[int] = ..., ubatch_size: _Optional[int] = ..., num_queued: _Optional[int] = ..., num_active: _Optional[int] = ..., stats: _Optional[_Union[EngineStats, _Mapping]] = ..., pool: _Optional[_Union[KvPool, _Mapping]] = ..., memory_kind: _Optional[_Union[_prompt_pb2.MemoryKind, str]] = ..., num_checkpoints_per_slot: _Optional[int] = ..., num_checkpoint_bytes: _Optional[int] = ..., cache_type_k: _Optional[str] = ..., cache_type_v: _Optional[str] = ..., flash_attn: _Optional[str] = ..., num_bytes_per_cell: _Optional[int] = ...) -> None: ...

class KvPool(_message.Message):
    __slots__ = ("num_cells", "num_cells_used", "num_shared_cells", "num_holders", "num_holders_in_use")
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOLDERS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    num_cells: int
    num_cells_used: int
    num_shared_cells: int
    num_holders: int
    num_holders_in_use: int
    def __init__(self, num_cells: _Optional[int] = ..., num_cells_used: _Optional[int] = ..., num_shared_cells: _Optional[int] = ..., num_holders: _Optional[int] = ..., num_holders_in_use: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_decodes", "num_multi_seq_decodes", "num_media_decodes", "num_generated_tokens", "num_shifts", "num_media_cache_hits", "num_media_cache_misses", "num_shared_prefixes", "num_shared_cells", "num_pool_waits", "num_checkpoints", "num_checkpoint_restores", "num_preemptions", "num_sessions_reclaimed")
    NUM_DECODES_FIELD_NUMBER: _ClassVar[int]
    NUM_MULTI_SEQ_DECODES_FIELD_NUMBER: _ClassVar[int]
    NUM_MEDIA_DECODES_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHIFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MEDIA_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MEDIA_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_POOL_WAITS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINT_RESTORES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    num_decodes: int
    num_multi_seq_decodes: int
    num_media_decodes: int
    num_generated_tokens: int
    num_shifts: int
    num_media_cache_hits: int
    num_media_cache_misses: int
    num_shared_prefixes: int
    num_shared_cells: int
    num_pool_waits: int
    num_checkpoints: int
    num_checkpoint_restores: int
    num_preemptions: int
    num_sessions_reclaimed: int
    def __init__(self, num_decodes: _Optional[int] = ..., num_multi_seq_decodes: _Optional[int] = ..., num_media_decodes: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_shifts: _Optional[int] = ..., num_media_cache_hits: _Optional[int] = ..., num_media_cache_misses: _Optional[int] = ..., num_shared_prefixes: _Optional[int] = ..., num_shared_cells: _Optional[int] = ..., num_pool_waits: _Optional[int] = ..., num_checkpoints: _Optional[int] = ..., num_checkpoint_restores: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_sessions_reclaimed: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "penalty_last_n", "presence_penalty", "frequency_penalty", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    penalty_last_n: int
    presence_penalty: float
    frequency_penalty: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ContextOptions(_message.Message):
    __slots__ = ("policy", "keep", "discard_fraction", "unit", "truncate_prompt")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FRACTION_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    policy: ShiftPolicy
    keep: int
    discard_fraction: float
    unit: EvictionUnit
    truncate_prompt: bool
    def __init__(self, policy: _Optional[_Union[ShiftPolicy, str]] = ..., keep: _Optional[int] = ..., discard_fraction: _Optional[float] = ..., unit: _Optional[_Union[EvictionUnit, str]] = ..., truncate_prompt: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "max_tokens", "stop", "context", "session_id", "stream_tokens", "constraint", "logit_bias", "logprobs", "top_logprobs", "turn_note", "cache_salt", "expect_turns", "speculative", "ignore_eos", "lora", "reasoning")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TURN_NOTE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXPECT_TURNS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    prompt: _prompt_pb2.PreparedPrompt
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    context: ContextOptions
    session_id: str
    stream_tokens: int
    constraint: _prompt_pb2.Constraint
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    turn_note: bytes
    cache_salt: str
    expect_turns: int
    speculative: SpeculativeOptions
    ignore_eos: bool
    lora: _containers.RepeatedCompositeFieldContainer[LoraScale]
    reasoning: ReasoningOptions
    def __init__(self, prompt: _Optional[_Union[_prompt_pb2.PreparedPrompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., context: _Optional[_Union[ContextOptions, _Mapping]] = ..., session_id: _Optional[str] = ..., stream_tokens: _Optional[int] = ..., constraint: _Optional[_Union[_prompt_pb2.Constraint, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., turn_note: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., expect_turns: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeOptions, _Mapping]] = ..., ignore_eos: _Optional[bool] = ..., lora: _Optional[_Iterable[_Union[LoraScale, _Mapping]]] = ..., reasoning: _Optional[_Union[ReasoningOptions, _Mapping]] = ...) -> None: ...

class ReasoningOptions(_message.Message):
    __slots__ = ("start_token_ids", "end_token_ids", "started", "budget_tokens", "forced_token_ids")
    START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    start_token_ids: _containers.RepeatedScalarFieldContainer[int]
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    started: bool
    budget_tokens: int
    forced_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start_token_ids: _Optional[_Iterable[int]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., started: _Optional[bool] = ..., budget_tokens: _Optional[int] = ..., forced_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculativeOptions(_message.Message):
    __slots__ = ("type", "n_max", "n_min", "p_min", "ngram_size_n", "ngram_size_m", "ngram_min_hits", "types", "ngram_mod_n_match", "ngram_mod_n_min", "ngram_mod_n_max")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    N_MIN_FIELD_NUMBER: _ClassVar[int]
    P_MIN_FIELD_NUMBER: _ClassVar[int]
    NGRAM_SIZE_N_FIELD_NUMBER: _ClassVar[int]
    NGRAM_SIZE_M_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MIN_HITS_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MOD_N_MATCH_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MOD_N_MIN_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MOD_N_MAX_FIELD_NUMBER: _ClassVar[int]
    type: SpecType
    n_max: int
    n_min: int
    p_min: float
    ngram_size_n: int
    ngram_size_m: int
    ngram_min_hits: int
    types: _containers.RepeatedScalarFieldContainer[SpecType]
    ngram_mod_n_match: int
    ngram_mod_n_min: int
    ngram_mod_n_max: int
    def __init__(self, type: _Optional[_Union[SpecType, str]] = ..., n_max: _Optional[int] = ..., n_min: _Optional[int] = ..., p_min: _Optional[float] = ..., ngram_size_n: _Optional[int] = ..., ngram_size_m: _Optional[int] = ..., ngram_min_hits: _Optional[int] = ..., types: _Optional[_Iterable[_Union[SpecType, str]]] = ..., ngram_mod_n_match: _Optional[int] = ..., ngram_mod_n_min: _Optional[int] = ..., ngram_mod_n_max: _Optional[int] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("slot", "num_prompt_cells", "num_prompt_positions", "num_capacity_cells", "num_truncated_cells", "truncated_media_ids", "num_truncated_chunks", "num_reused_cells")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CAPACITY_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRUNCATED_CELLS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_MEDIA_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRUNCATED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_CELLS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    num_prompt_cells: int
    num_prompt_positions: int
    num_capacity_cells: int
    num_truncated_cells: int
    truncated_media_ids: _containers.RepeatedScalarFieldContainer[str]
    num_truncated_chunks: int
    num_reused_cells: int
    def __init__(self, slot: _Optional[int] = ..., num_prompt_cells: _Optional[int] = ..., num_prompt_positions: _Optional[int] = ..., num_capacity_cells: _Optional[int] = ..., num_truncated_cells: _Optional[int] = ..., truncated_media_ids: _Optional[_Iterable[str]] = ..., num_truncated_chunks: _Optional[int] = ..., num_reused_cells: _Optional[int] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("num_cells_done", "num_cells_total")
    NUM_CELLS_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_cells_done: int
    num_cells_total: int
    def __init__(self, num_cells_done: _Optional[int] = ..., num_cells_total: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "piece", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    piece: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., piece: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ContextShift(_message.Message):
    __slots__ = ("policy", "num_cells_evicted", "num_positions_evicted", "media_ids_evicted", "num_cells_used_after", "next_position_after")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    MEDIA_IDS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_USED_AFTER_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_AFTER_FIELD_NUMBER: _ClassVar[int]
    policy: ShiftPolicy
    num_cells_evicted: int
    num_positions_evicted: int
    media_ids_evicted: _containers.RepeatedScalarFieldContainer[str]
    num_cells_used_after: int
    next_position_after: int
    def __init__(self, policy: _Optional[_Union[ShiftPolicy, str]] = ..., num_cells_evicted: _Optional[int] = ..., num_positions_evicted: _Optional[int] = ..., media_ids_evicted: _Optional[_Iterable[str]] = ..., num_cells_used_after: _Optional[int] = ..., next_position_after: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("num_prompt_cells", "num_prompt_positions", "num_generated_tokens", "num_shifts", "num_evicted_cells", "num_reused_cells", "prefill_seconds", "decode_seconds", "num_draft_tokens", "num_accepted_tokens", "drafts_by_type")
    NUM_PROMPT_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHIFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_CELLS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_BY_TYPE_FIELD_NUMBER: _ClassVar[int]
    num_prompt_cells: int
    num_prompt_positions: int
    num_generated_tokens: int
    num_shifts: int
    num_evicted_cells: int
    num_reused_cells: int
    prefill_seconds: float
    decode_seconds: float
    num_draft_tokens: int
    num_accepted_tokens: int
    drafts_by_type: _containers.RepeatedCompositeFieldContainer[DraftCount]
    def __init__(self, num_prompt_cells: _Optional[int] = ..., num_prompt_positions: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_shifts: _Optional[int] = ..., num_evicted_cells: _Optional[int] = ..., num_reused_cells: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., drafts_by_type: _Optional[_Iterable[_Union[DraftCount, _Mapping]]] = ...) -> None: ...

class DraftCount(_message.Message):
    __slots__ = ("type", "num_draft_tokens", "num_accepted_tokens", "num_cache_hits")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    type: SpecType
    num_draft_tokens: int
    num_accepted_tokens: int
    num_cache_hits: int
    def __init__(self, type: _Optional[_Union[SpecType, str]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_cache_hits: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage", "stop_string", "error", "persistence")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PERSISTENCE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    stop_string: str
    error: str
    persistence: Persistence
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stop_string: _Optional[str] = ..., error: _Optional[str] = ..., persistence: _Optional[_Union[Persistence, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "prefill", "delta", "shift", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: Started
    prefill: PrefillProgress
    delta: TokenDelta
    shift: ContextShift
    finished: Finished
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., prefill: _Optional[_Union[PrefillProgress, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., shift: _Optional[_Union[ContextShift, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "num_turns", "num_cells", "next_position", "resident", "context", "sampling", "num_shifts", "num_media", "error", "records", "title")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SHIFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MEDIA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_turns: int
    num_cells: int
    next_position: int
    resident: bool
    context: ContextOptions
    sampling: SamplingParams
    num_shifts: int
    num_media: int
    error: str
    records: _containers.RepeatedCompositeFieldContainer[TurnRecord]
    title: str
    def __init__(self, session_id: _Optional[str] = ..., num_turns: _Optional[int] = ..., num_cells: _Optional[int] = ..., next_position: _Optional[int] = ..., resident: _Optional[bool] = ..., context: _Optional[_Union[ContextOptions, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_shifts: _Optional[int] = ..., num_media: _Optional[int] = ..., error: _Optional[str] = ..., records: _Optional[_Iterable[_Union[TurnRecord, _Mapping]]] = ..., title: _Optional[str] = ...) -> None: ...

class TurnRecord(_message.Message):
    __slots__ = ("turn", "text", "reason", "usage", "note", "created")
    TURN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    turn: int
    text: str
    reason: FinishReason
    usage: Usage
    note: bytes
    created: float
    def __init__(self, turn: _Optional[int] = ..., text: _Optional[str] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., note: _Optional[bytes] = ..., created: _Optional[float] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("session_id", "context", "sampling", "title")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context: ContextOptions
    sampling: SamplingParams
    title: str
    def __init__(self, session_id: _Optional[str] = ..., context: _Optional[_Union[ContextOptions, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., title: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "num_records")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_records: int
    def __init__(self, session_id: _Optional[str] = ..., num_records: _Optional[int] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SaveSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class RestoreSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class RestoreSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class RenameSessionRequest(_message.Message):
    __slots__ = ("session_id", "title")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    title: str
    def __init__(self, session_id: _Optional[str] = ..., title: _Optional[str] = ...) -> None: ...

class RenameSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class WatchSlotsRequest(_message.Message):
    __slots__ = ("min_interval_ms", "once")
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ONCE_FIELD_NUMBER: _ClassVar[int]
    min_interval_ms: int
    once: bool
    def __init__(self, min_interval_ms: _Optional[int] = ..., once: _Optional[bool] = ...) -> None: ...

class WatchSlotsResponse(_message.Message):
    __slots__ = ("num_cells_per_slot", "uses_mrope", "slots", "shared_prefixes")
    NUM_CELLS_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    USES_MROPE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    num_cells_per_slot: int
    uses_mrope: bool
    slots: _containers.RepeatedCompositeFieldContainer[SlotView]
    shared_prefixes: _containers.RepeatedCompositeFieldContainer[SharedPrefixView]
    def __init__(self, num_cells_per_slot: _Optional[int] = ..., uses_mrope: _Optional[bool] = ..., slots: _Optional[_Iterable[_Union[SlotView, _Mapping]]] = ..., shared_prefixes: _Optional[_Iterable[_Union[SharedPrefixView, _Mapping]]] = ...) -> None: ...

class SharedPrefixView(_message.Message):
    __slots__ = ("holder", "num_cells", "slots", "runs")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    holder: int
    num_cells: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    runs: _containers.RepeatedCompositeFieldContainer[CellRun]
    def __init__(self, holder: _Optional[int] = ..., num_cells: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., runs: _Optional[_Iterable[_Union[CellRun, _Mapping]]] = ...) -> None: ...

class SlotView(_message.Message):
    __slots__ = ("slot", "visible", "session_id", "state", "num_cells", "next_position", "runs", "shifts", "num_shared_cells", "shared_prefix", "num_recurrent_bytes", "num_checkpoints", "num_checkpoint_bytes")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SHIFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_CELLS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUM_RECURRENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    visible: bool
    session_id: str
    state: SlotState
    num_cells: int
    next_position: int
    runs: _containers.RepeatedCompositeFieldContainer[CellRun]
    shifts: _containers.RepeatedCompositeFieldContainer[ShiftMark]
    num_shared_cells: int
    shared_prefix: int
    num_recurrent_bytes: int
    num_checkpoints: int
    num_checkpoint_bytes: int
    def __init__(self, slot: _Optional[int] = ..., visible: _Optional[bool] = ..., session_id: _Optional[str] = ..., state: _Optional[_Union[SlotState, str]] = ..., num_cells: _Optional[int] = ..., next_position: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[CellRun, _Mapping]]] = ..., shifts: _Optional[_Iterable[_Union[ShiftMark, _Mapping]]] = ..., num_shared_cells: _Optional[int] = ..., shared_prefix: _Optional[int] = ..., num_recurrent_bytes: _Optional[int] = ..., num_checkpoints: _Optional[int] = ..., num_checkpoint_bytes: _Optional[int] = ...) -> None: ...

class CellRun(_message.Message):
    __slots__ = ("kind", "pinned", "message_index", "media_id", "num_cells", "num_positions", "pos_start", "preview")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEDIA_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    kind: CellKind
    pinned: bool
    message_index: int
    media_id: str
    num_cells: int
    num_positions: int
    pos_start: int
    preview: str
    def __init__(self, kind: _Optional[_Union[CellKind, str]] = ..., pinned: _Optional[bool] = ..., message_index: _Optional[int] = ..., media_id: _Optional[str] = ..., num_cells: _Optional[int] = ..., num_positions: _Optional[int] = ..., pos_start: _Optional[int] = ..., preview: _Optional[str] = ...) -> None: ...

class ShiftMark(_message.Message):
    __slots__ = ("id", "shift", "at_cell", "evicted", "time")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    AT_CELL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    id: int
    shift: ContextShift
    at_cell: int
    evicted: _containers.RepeatedCompositeFieldContainer[CellRun]
    time: float
    def __init__(self, id: _Optional[int] = ..., shift: _Optional[_Union[ContextShift, _Mapping]] = ..., at_cell: _Optional[int] = ..., evicted: _Optional[_Iterable[_Union[CellRun, _Mapping]]] = ..., time: _Optional[float] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("texts", "normalize")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "num_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    num_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class LoraScale(_message.Message):
    __slots__ = ("id", "scale")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    id: int
    scale: float
    def __init__(self, id: _Optional[int] = ..., scale: _Optional[float] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("id", "path", "scale", "task_name", "prompt_prefix")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    TASK_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    id: int
    path: str
    scale: float
    task_name: str
    prompt_prefix: str
    def __init__(self, id: _Optional[int] = ..., path: _Optional[str] = ..., scale: _Optional[float] = ..., task_name: _Optional[str] = ..., prompt_prefix: _Optional[str] = ...) -> None: ...

class LoraListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class LoraSetScalesRequest(_message.Message):
    __slots__ = ("scales",)
    SCALES_FIELD_NUMBER: _ClassVar[int]
    scales: _containers.RepeatedCompositeFieldContainer[LoraScale]
    def __init__(self, scales: _Optional[_Iterable[_Union[LoraScale, _Mapping]]] = ...) -> None: ...

class LoraSetScalesResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...
