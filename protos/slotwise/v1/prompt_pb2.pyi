from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_ATTENTION: _ClassVar[MemoryKind]
    MEMORY_KIND_HYBRID: _ClassVar[MemoryKind]
    MEMORY_KIND_RECURRENT: _ClassVar[MemoryKind]
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_ATTENTION: MemoryKind
MEMORY_KIND_HYBRID: MemoryKind
MEMORY_KIND_RECURRENT: MemoryKind

class Fingerprint(_message.Message):
    __slots__ = ("model", "mmproj")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MMPROJ_FIELD_NUMBER: _ClassVar[int]
    model: str
    mmproj: str
    def __init__(self, model: _Optional[str] = ..., mmproj: _Optional[str] = ...) -> None: ...

class TextChunk(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaChunk(_message.Message):
    __slots__ = ("media_id", "num_cells", "num_positions", "width", "height", "rgb", "encoded", "audio", "pcm")
    MEDIA_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    RGB_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    media_id: str
    num_cells: int
    num_positions: int
    width: int
    height: int
    rgb: bytes
    encoded: bytes
    audio: bytes
    pcm: bytes
    def __init__(self, media_id: _Optional[str] = ..., num_cells: _Optional[int] = ..., num_positions: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., rgb: _Optional[bytes] = ..., encoded: _Optional[bytes] = ..., audio: _Optional[bytes] = ..., pcm: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("message_index", "media_group", "text", "media")
    MESSAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEDIA_GROUP_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    message_index: int
    media_group: int
    text: TextChunk
    media: MediaChunk
    def __init__(self, message_index: _Optional[int] = ..., media_group: _Optional[int] = ..., text: _Optional[_Union[TextChunk, _Mapping]] = ..., media: _Optional[_Union[MediaChunk, _Mapping]] = ...) -> None: ...

class PreparedPrompt(_message.Message):
    __slots__ = ("fingerprint", "chunks", "num_cells", "num_positions")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CELLS_FIELD_NUMBER: _ClassVar[int]
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: Fingerprint
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    num_cells: int
    num_positions: int
    def __init__(self, fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., num_cells: _Optional[int] = ..., num_positions: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("grammar", "json_schema", "trigger_patterns")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    grammar: str
    json_schema: str
    trigger_patterns: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, grammar: _Optional[str] = ..., json_schema: _Optional[str] = ..., trigger_patterns: _Optional[_Iterable[str]] = ...) -> None: ...
