"""Channels to the services: options, TLS and token credentials, and the gRPC service config
that retries idempotent calls.

Retries are gRPC's own (the `retryPolicy` of the service config, gRFC A6), not a loop in
Python: the channel re-sends a call that failed UNAVAILABLE, with exponential backoff, only for
the methods in IDEMPOTENT_METHODS. Generate (a stream whose tokens would be generated twice)
and the session calls that change state (Create, Delete, Save, Restore) are never retried.
`RetryPolicy` is the knob; `service_config(policy, timeout)` the JSON it becomes, e.g. for the
default policy and a 30 s client timeout:

    {"methodConfig": [{"name": [{"service": "grpc.health.v1.Health", "method": "Check"},
                                {"service": "slotwise.v1.InferService", "method": "GetServerInfo"},
                                ...],
                       "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s",
                                       "maxBackoff": "2s", "backoffMultiplier": 2.0,
                                       "retryableStatusCodes": ["UNAVAILABLE"]}}]}

What gRPC decides, and this module therefore documents rather than offers: at most 5 attempts;
each backoff is jittered by +/-20%; the call's deadline covers all attempts, and a deadline that
falls during a backoff ends the call with DEADLINE_EXCEEDED. So that a server that stays away is
reported as what it is (UNAVAILABLE), the schedule is cut to the attempts whose longest wait
fits within half of the client's default timeout. A call whose request is larger than the
retry buffer is not retried, so the buffer is as large as the largest message.

`RetryPolicy(wait_for_ready=True)` makes the idempotent calls wait (up to their deadline) for a
server that is not reachable yet, starting or restarting, instead of failing at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "IDEMPOTENT_METHODS",
    "MAX_ATTEMPTS",
    "NO_RETRY",
    "RetryPolicy",
    "Tls",
    "channel_options",
    "open_channel",
    "service_config",
]

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # a PreparedPrompt carries raw RGB pixels
MAX_ATTEMPTS = 5  # gRPC clamps retryPolicy.maxAttempts to this
JITTER = 0.2  # gRPC's, on every backoff; not configurable

PREP_SERVICE = "slotwise.v1.PrepService"
INFER_SERVICE = "slotwise.v1.InferService"
HEALTH_SERVICE = "grpc.health.v1.Health"

# (service, method) that cannot change anything: safe to send again
IDEMPOTENT_METHODS: frozenset[tuple[str, str]] = frozenset(
    {
        (PREP_SERVICE, "GetModelInfo"),
        (PREP_SERVICE, "Prepare"),
        (PREP_SERVICE, "CountTokens"),
        (PREP_SERVICE, "Tokenize"),
        (PREP_SERVICE, "Detokenize"),
        (INFER_SERVICE, "GetServerInfo"),
        (INFER_SERVICE, "GetSession"),
        (INFER_SERVICE, "ListSessions"),
        (INFER_SERVICE, "LoraListAdapters"),
        (INFER_SERVICE, "LoraSetScales"),  # (the scales are set, not added to: twice is once)
        (HEALTH_SERVICE, "Check"),
    }
)


@dataclass(frozen=True)
class Tls:
    """TLS settings: root certificates to trust, and a client certificate + key for mTLS."""

    root_certificates: bytes | None = None  # None: the system's roots
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # override the name checked in the server's certificate

    @classmethod
    def from_files(
        cls,
        ca: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        server_name: str | None = None,
    ) -> Tls:
        def read(p: str | os.PathLike[str] | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return cls(read(ca), read(cert), read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            self.root_certificates, self.private_key, self.certificate_chain
        )


@dataclass(frozen=True)
class RetryPolicy:
    """How the channel retries idempotent calls: gRPC's retryPolicy, see the module docstring.

    Attempt k (1-based) that fails with one of retry_codes is followed, while attempts remain,
    by a wait of min(max_backoff, initial_backoff * multiplier ** (k - 1)), +/-20% (gRPC's
    jitter). max_attempts above 5 counts as 5. wait_for_ready: idempotent calls wait for the
    channel to connect (until their deadline) rather than fail UNAVAILABLE while it cannot.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    retry_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})
    wait_for_ready: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts is at least 1 (1: no retries)")
        if min(self.initial_backoff, self.max_backoff, self.multiplier) <= 0:
            raise ValueError("initial_backoff, max_backoff and multiplier must be > 0")
        if self.max_attempts > 1 and not self.retry_codes:
            raise ValueError("retry_codes is empty: use NO_RETRY")

    def backoffs(self) -> list[float]:
        """The waits between the attempts (without jitter)."""
        n = min(self.max_attempts, MAX_ATTEMPTS) - 1
        return [min(self.max_backoff, self.initial_backoff * self.multiplier**k) for k in range(n)]

    def attempts_within(self, timeout: float | None) -> int:
        """The attempts whose longest total wait fits within half of timeout (None: all)."""
        attempts, waited = 1, 0.0
        for wait in self.backoffs():
            waited += wait * (1 + JITTER)
            if timeout is not None and timeout > 0 and waited > timeout / 2:
                break
            attempts += 1
        return attempts


NO_RETRY = RetryPolicy(max_attempts=1)


def _duration(seconds: float) -> str:
    """Seconds as a google.protobuf.Duration in JSON ("0.1s"), to the microsecond."""
    return f"{max(seconds, 1e-6):.6f}".rstrip("0").rstrip(".") + "s"


def service_config(retry: RetryPolicy, timeout: float | None = None) -> dict[str, Any]:
    """The service config for a client whose calls default to `timeout` seconds."""
    attempts = retry.attempts_within(timeout)
    if attempts < 2:
        return {}
    names = [{"service": s, "method": m} for s, m in sorted(IDEMPOTENT_METHODS)]
    policy = {
        "maxAttempts": attempts,
        "initialBackoff": _duration(retry.initial_backoff),
        "maxBackoff": _duration(retry.max_backoff),
        "backoffMultiplier": retry.multiplier,
        "retryableStatusCodes": sorted(code.name for code in retry.retry_codes),
    }
    return {"methodConfig": [{"name": names, "retryPolicy": policy}]}


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    retry: RetryPolicy = NO_RETRY,
    timeout: float | None = None,
    tls: Tls | None = None,
) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # reconnect soon after a server (re)appears
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        # retries: ours, whatever a resolver says; a request up to the largest message can be
        # sent again (beyond the buffer, 256 KiB by default, a call is not retried)
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(service_config(retry, timeout))),
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
    ]
    if tls and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def open_channel(
    address: str,
    *,
    aio: bool,
    tls: Tls | None,
    options: list[tuple[str, Any]],
    compression: grpc.Compression | None,
) -> Any:
    """A grpc.Channel (aio: a grpc.aio.Channel) to address, with TLS when tls is given."""
    factory: Any = grpc.aio if aio else grpc
    if tls:
        return factory.secure_channel(
            address, tls.credentials(), options=options, compression=compression
        )
    return factory.insecure_channel(address, options=options, compression=compression)
