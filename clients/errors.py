"""`SlotwiseError`: every failed call, with its status code, message and the google.rpc.Status
details the server attached (read with grpcio-status's `rpc_status.from_call`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

if TYPE_CHECKING:
    from clients.events import Finished

__all__ = ["SlotwiseError"]


class SlotwiseError(grpc.RpcError):
    """A call failed: the gRPC status code and the server's message.

    Like the errors grpc raises, `code()` is a `grpc.StatusCode` and `details()` the message;
    `status` holds the google.rpc.Status with its details, when the server sent one: `reason`
    and `metadata` come from its ErrorInfo (e.g. PROMPT_TOO_LONG with cells_needed and
    capacity, QUEUE_FULL, STALE_DESCRIPTOR, SESSION_NOT_SAVED), `retry_delay` from RetryInfo,
    `field_violations` from BadRequest. `finished` is the stream's Finished event when the
    failure came after it (a turn that completed but was not saved, or an error mid-stream).
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, status: status_pb2.Status | None = None
    ):
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self.message = message
        self.status = status
        self.reason = ""
        self.metadata: dict[str, str] = {}
        self.retry_delay: float | None = None
        self.field_violations: dict[str, str] = {}
        self.finished: Finished | None = None
        for detail in status.details if status is not None else ():
            info, retry, bad = (
                error_details_pb2.ErrorInfo(),
                error_details_pb2.RetryInfo(),
                error_details_pb2.BadRequest(),
            )
            if detail.Unpack(info):
                self.reason, self.metadata = info.reason, dict(info.metadata)
            elif detail.Unpack(retry):
                self.retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
            elif detail.Unpack(bad):
                self.field_violations = {v.field: v.description for v in bad.field_violations}

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def __str__(self) -> str:
        return f"{self._code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError, *, finished: Finished | None = None) -> SlotwiseError:
        """The error grpc raised (sync or aio) as a SlotwiseError; `finished`: the stream's
        Finished event, when the error came after it."""
        if isinstance(e, SlotwiseError):
            error = e
        else:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            message = (e.details() if hasattr(e, "details") else None) or str(e)
            try:
                status = rpc_status.from_call(e) if hasattr(e, "trailing_metadata") else None
            except Exception:  # a malformed or mismatched detail must not hide the error itself
                status = None
            error = cls(code or grpc.StatusCode.UNKNOWN, message, status=status)
        if finished is not None:
            error.finished = finished
        return error
