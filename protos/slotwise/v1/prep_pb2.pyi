from slotwise.v1 import prompt_pb2 as _prompt_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_UNSPECIFIED: _ClassVar[ToolChoice]
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]
    TOOL_CHOICE_FUNCTION: _ClassVar[ToolChoice]

class ToolFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_FORMAT_UNSPECIFIED: _ClassVar[ToolFormat]
    TOOL_FORMAT_JSON: _ClassVar[ToolFormat]
    TOOL_FORMAT_HERMES: _ClassVar[ToolFormat]
    TOOL_FORMAT_LLAMA3: _ClassVar[ToolFormat]
    TOOL_FORMAT_MISTRAL: _ClassVar[ToolFormat]
TOOL_CHOICE_UNSPECIFIED: ToolChoice
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice
TOOL_CHOICE_FUNCTION: ToolChoice
TOOL_FORMAT_UNSPECIFIED: ToolFormat
TOOL_FORMAT_JSON: ToolFormat
TOOL_FORMAT_HERMES: ToolFormat
TOOL_FORMAT_LLAMA3: ToolFormat
TOOL_FORMAT_MISTRAL: ToolFormat

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("fingerprint", "media_marker", "uses_mrope", "media_non_causal", "supports_vision", "supports_audio", "n_ctx_train", "num_vocab", "bos_token_id", "eos_token_id", "has_chat_template", "model_description", "chat_template", "add_bos", "fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id", "fim_rep_token_id", "fim_sep_token_id", "memory_kind", "audio_sample_rate", "max_audio_seconds")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_MARKER_FIELD_NUMBER: _ClassVar[int]
    USES_MROPE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_VISION_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_AUDIO_FIELD_NUMBER: _ClassVar[int]
    N_CTX_TRAIN_FIELD_NUMBER: _ClassVar[int]
    NUM_VOCAB_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    FIM_PRE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIM_SUF_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIM_MID_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIM_REP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIM_SEP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: _prompt_pb2.Fingerprint
    media_marker: str
    uses_mrope: bool
    media_non_causal: bool
    supports_vision: bool
    supports_audio: bool
    n_ctx_train: int
    num_vocab: int
    bos_token_id: int
    eos_token_id: int
    has_chat_template: bool
    model_description: str
    chat_template: str
    add_bos: bool
    fim_pre_token_id: int
    fim_suf_token_id: int
    fim_mid_token_id: int
    fim_rep_token_id: int
    fim_sep_token_id: int
    memory_kind: _prompt_pb2.MemoryKind
    audio_sample_rate: int
    max_audio_seconds: float
    def __init__(self, fingerprint: _Optional[_Union[_prompt_pb2.Fingerprint, _Mapping]] = ..., media_marker: _Optional[str] = ..., uses_mrope: _Optional[bool] = ..., media_non_causal: _Optional[bool] = ..., supports_vision: _Optional[bool] = ..., supports_audio: _Optional[bool] = ..., n_ctx_train: _Optional[int] = ..., num_vocab: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., model_description: _Optional[str] = ..., chat_template: _Optional[str] = ..., add_bos: _Optional[bool] = ..., fim_pre_token_id: _Optional[int] = ..., fim_suf_token_id: _Optional[int] = ..., fim_mid_token_id: _Optional[int] = ..., fim_rep_token_id: _Optional[int] = ..., fim_sep_token_id: _Optional[int] = ..., memory_kind: _Optional[_Union[_prompt_pb2.MemoryKind, str]] = ..., audio_sample_rate: _Optional[int] = ..., max_audio_seconds: _Optional[float] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ImageSize(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "size")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    size: ImageSize
    def __init__(self, data: _Optional[bytes] = ..., size: _Optional[_Union[ImageSize, _Mapping]] = ...) -> None: ...

class Audio(_message.Message):
    __slots__ = ("data", "pcm_f32", "seconds")
    DATA_FIELD_NUMBER: _ClassVar[int]
    PCM_F32_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    pcm_f32: bytes
    seconds: float
    def __init__(self, data: _Optional[bytes] = ..., pcm_f32: _Optional[bytes] = ..., seconds: _Optional[float] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("text", "image", "audio")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    audio: Audio
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., audio: _Optional[_Union[Audio, _Mapping]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "parts", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools", "tool_choice", "tool_name", "parallel_tool_calls", "template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    tool_name: str
    parallel_tool_calls: bool
    template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, str]] = ..., tool_name: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., template_kwargs_json: _Optional[str] = ...) -> None: ...

class ToolCalling(_message.Message):
    __slots__ = ("format", "constraint")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    format: ToolFormat
    constraint: _prompt_pb2.Constraint
    def __init__(self, format: _Optional[_Union[ToolFormat, str]] = ..., constraint: _Optional[_Union[_prompt_pb2.Constraint, _Mapping]] = ...) -> None: ...

class RawPrompt(_message.Message):
    __slots__ = ("text", "images", "add_special", "media")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    text: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    add_special: bool
    media: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, text: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., add_special: _Optional[bool] = ..., media: _Optional[_Iterable[_Union[Part, _Mapping]]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("chat", "raw", "first_message")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    FIRST_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    raw: RawPrompt
    first_message: int
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ..., raw: _Optional[_Union[RawPrompt, _Mapping]] = ..., first_message: _Optional[int] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("prompt", "rendered_text", "tool_calling", "reasoning")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RENDERED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLING_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    prompt: _prompt_pb2.PreparedPrompt
    rendered_text: str
    tool_calling: ToolCalling
    reasoning: Reasoning
    def __init__(self, prompt: _Optional[_Union[_prompt_pb2.PreparedPrompt, _Mapping]] = ..., rendered_text: _Optional[str] = ..., tool_calling: _Optional[_Union[ToolCalling, _Mapping]] = ..., reasoning: _Optional[_Union[Reasoning, _Mapping]] = ...) -> None: ...

class Reasoning(_message.Message):
    __slots__ = ("start", "end", "start_token_ids", "end_token_ids", "started", "opened_text", "num_opened_tokens")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OPENED_TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_OPENED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    start: str
    end: str
    start_token_ids: _containers.RepeatedScalarFieldContainer[int]
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    started: bool
    opened_text: str
    num_opened_tokens: int
    def __init__(self, start: _Optional[str] = ..., end: _Optional[str] = ..., start_token_ids: _Optional[_Iterable[int]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., started: _Optional[bool] = ..., opened_text: _Optional[str] = ..., num_opened_tokens: _Optional[int] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("chat", "raw", "first_message")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    FIRST_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    raw: RawPrompt
    first_message: int
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ..., raw: _Optional[_Union[RawPrompt, _Mapping]] = ..., first_message: _Optional[int] = ...) -> None: ...

class ChunkCount(_message.Message):
    __slots__ = ("message_index", "media_group", "is_media", "num_cells", "num_positions", "is_audio")
    MESSAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEDIA_GROUP_FIELD_NUMBER: _ClassVar[int]
    IS_MEDIA_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    IS_AUDIO_FIELD_NUMBER: _ClassVar[int]
    message_index: int
    media_group: int
    is_media: bool
    num_cells: int
    num_positions: int
    is_audio: bool
    def __init__(self, message_index: _Optional[int] = ..., media_group: _Optional[int] = ..., is_media: _Optional[bool] = ..., num_cells: _Optional[int] = ..., num_positions: _Optional[int] = ..., is_audio: _Optional[bool] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("num_cells", "num_positions", "chunks")
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    num_cells: int
    num_positions: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkCount]
    def __init__(self, num_cells: _Optional[int] = ..., num_positions: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkCount, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special", "parse_special", "with_pieces", "max_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    WITH_PIECES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special: bool
    parse_special: bool
    with_pieces: bool
    max_tokens: int
    def __init__(self, text: _Optional[str] = ..., add_special: _Optional[bool] = ..., parse_special: _Optional[bool] = ..., with_pieces: _Optional[bool] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "pieces")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("pieces", "text")
    PIECES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    text: str
    def __init__(self, pieces: _Optional[_Iterable[bytes]] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeBatchRequest(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[TokenizeRequest]
    def __init__(self, texts: _Optional[_Iterable[_Union[TokenizeRequest, _Mapping]]] = ...) -> None: ...

class TokenizeBatchResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[TokenizeResponse]
    def __init__(self, texts: _Optional[_Iterable[_Union[TokenizeResponse, _Mapping]]] = ...) -> None: ...
