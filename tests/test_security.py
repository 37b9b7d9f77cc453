"""TLS, mutual TLS and bearer tokens on the real services (prep + infer), and what reaches the
logs: never image bytes, never a token. Certificates are made per run with the openssl CLI."""

from __future__ import annotations

import base64
import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients.client import (
    NO_RETRY,
    Delta,
    Finished,
    Message,
    SlotwiseClient,
    SlotwiseError,
    Tls,
)
from infer_service.__main__ import start as start_infer
from infer_service.runner.runtime import RuntimeConfig
from prep_service import __main__ as prep_main
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2
from slotwise_core.images import decode_image
from slotwise_core.serving import Security, security_from_args
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.media import image_bytes
from support.rpc import OPTIONS, rgb_of

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

TOKEN = "s3cret-Token-0123456789abcdef"
WRONG = "wr0ng-Token-fedcba9876543210"
Code = grpc.StatusCode
PREP = "slotwise.v1.PrepService"
INFER = "slotwise.v1.InferService"


# -- certificates -------------------------------------------------------------------------------


def openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)


EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_ca(d: Path, name: str) -> None:
    openssl(d, "req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-subj", f"/CN={name}", "-days", "2")  # fmt: skip


def make_leaf(d: Path, name: str, ca: str) -> None:
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl(d, "req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    ca_args = ["-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial"]
    openssl(d, "x509", "-req", "-in", f"{name}.csr", *ca_args, "-out", f"{name}.pem",
            "-days", "2", "-extfile", "san.ext")  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca (signs server + client), rogue (signs rogue-client): PEM files in one folder."""
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "rogue")
    make_leaf(d, "server", "ca")
    make_leaf(d, "client", "ca")
    make_leaf(d, "rogue-client", "rogue")
    return d


def tls(pki: Path, *, ca: str = "ca", client: str | None = None) -> Tls:
    if client is None:
        return Tls.from_files(pki / f"{ca}.pem")
    return Tls.from_files(pki / f"{ca}.pem", pki / f"{client}.pem", pki / f"{client}.key")


# -- servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(
    loop_thread: LoopThread, tiny: dict[str, TinyPair]
) -> Iterator[Callable[[Security], tuple[str, str]]]:
    """start(security) -> (prep address, infer address), both stopped at the end of the module."""
    pair = tiny["mrope"]
    running: list[Any] = []

    def start(security: Security) -> tuple[str, str]:
        prep = loop_thread.run(prep_main.start(pair.model, pair.mmproj, security=security))
        running.append(prep)
        config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=512, threads=1)
        infer = loop_thread.run(start_infer(config, security=security))
        running.append(infer)
        return f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}"

    yield start
    for r in running:
        loop_thread.run(r.stop(0))


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def conversation() -> list[Message]:
    return [Message.user("What is in", image_bytes(112, 112, seed=4), "this picture?")]


def round_trip(client: SlotwiseClient) -> None:
    """Prepare an image prompt, generate from it: both services answered."""
    assert client.model_info().supports_vision
    assert client.server_info().num_slots == 1
    events = list(client.chat(conversation(), max_tokens=3, temperature=0.0))
    assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == 3
    assert isinstance(events[-1], Finished) and events[-1].error == ""


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    return err.value


def plain_call(
    address: str, which: str, metadata: tuple[tuple[str, str], ...] = ()
) -> Callable[[], Any]:
    """GetModelInfo (prep) or GetServerInfo (infer) on a plaintext channel."""

    def call() -> Any:
        with grpc.insecure_channel(address, options=OPTIONS) as ch:
            if which == "prep":
                stub = prep_pb2_grpc.PrepServiceStub(ch)
                return stub.GetModelInfo(
                    prep_pb2.GetModelInfoRequest(), timeout=5, metadata=metadata
                )
            return infer_pb2_grpc.InferServiceStub(ch).GetServerInfo(
                infer_pb2.GetServerInfoRequest(), timeout=5, metadata=metadata
            )

    return call


# -- TLS ----------------------------------------------------------------------------------------


def test_tls_refuses_plaintext_and_serves_clients_that_trust_its_ca(pki: Path, secured) -> None:
    prep, infer = secured(Security(cert=pki / "server.pem", key=pki / "server.key"))
    for address, which in ((prep, "prep"), (infer, "infer")):
        err = refused(plain_call(address, which))
        assert err.code() == Code.UNAVAILABLE, err.details()
    with SlotwiseClient(prep, infer, tls=tls(pki)) as client:
        round_trip(client)
        assert client.health("prep") == client.health("infer") == "SERVING"
    # a client that trusts another CA does not accept the server's certificate
    with SlotwiseClient(prep, infer, tls=tls(pki, ca="rogue"), retry=NO_RETRY) as client:
        for call in (client.model_info, client.server_info):
            with pytest.raises(SlotwiseError) as e:
                call()
            assert e.value.code() == Code.UNAVAILABLE
    # localhost is in the certificate too
    local = prep.replace("127.0.0.1", "localhost")
    with SlotwiseClient(local, tls=tls(pki)) as client:
        assert client.model_info().media_marker


def test_mutual_tls_wants_a_client_certificate_from_its_ca(pki: Path, secured) -> None:
    prep, infer = secured(
        Security(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
    )
    for who in (None, "rogue-client"):
        with SlotwiseClient(prep, infer, tls=tls(pki, client=who), retry=NO_RETRY) as client:
            for call in (client.model_info, client.server_info):
                with pytest.raises(SlotwiseError) as e:
                    call()
                assert e.value.code() == Code.UNAVAILABLE, who
    with SlotwiseClient(prep, infer, tls=tls(pki, client="client")) as client:
        round_trip(client)


def test_tls_needs_both_certificate_and_key(pki: Path) -> None:
    with pytest.raises(ValueError, match="TLS needs both --tls-cert and --tls-key"):
        Security(cert=pki / "server.pem").credentials()
    with pytest.raises(ValueError, match="TLS needs both"):
        Security(key=pki / "server.key").credentials()
    assert Security(token=TOKEN).credentials() is None


def test_the_cli_refuses_half_a_tls_configuration(
    pki: Path, tiny: dict[str, TinyPair], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="slotwise")
    args = [
        "--model",
        str(tiny["mrope"].model),
        "--port",
        "0",
        "--tls-cert",
        str(pki / "server.pem"),
    ]
    assert prep_main.main(args) == 2
    assert "TLS needs both --tls-cert and --tls-key" in caplog.text


def test_security_arguments(pki: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    args = prep_main.parser().parse_args(
        ["--model", "m.gguf", "--tls-cert", str(pki / "server.pem"), "--tls-key",
         str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"),
         "--token-file", str(token_file), "--metrics-port", "9999"]
    )  # fmt: skip
    s = security_from_args(args)
    assert (s.cert, s.key, s.client_ca) == (pki / "server.pem", pki / "server.key", pki / "ca.pem")
    # a token file of one key is a keys file: that key, tenant default
    assert s.keys is not None and s.keys.tenant_of(TOKEN) == "default"
    assert s.keys.tenant_of(TOKEN + "x") is None
    assert args.metrics_port == 9999
    assert security_from_args(prep_main.parser().parse_args(["--model", "m"])) == Security()


# -- bearer token -------------------------------------------------------------------------------


def test_bearer_token_is_required_except_for_probes(secured) -> None:
    prep, infer = secured(Security(token=TOKEN))
    for address, which in ((prep, "prep"), (infer, "infer")):
        for metadata in ((), (("authorization", f"Bearer {WRONG}"),), (("authorization", TOKEN),)):
            err = refused(plain_call(address, which, metadata))
            assert err.code() == Code.UNAUTHENTICATED, err.details()
            assert err.details() == "missing or wrong bearer token"
            assert TOKEN not in err.details() and WRONG not in err.details()
    # the streaming method is refused the same way, before any work
    ch = grpc.insecure_channel(infer, options=OPTIONS)
    stub = infer_pb2_grpc.InferServiceStub(ch)
    err = refused(lambda: stub.Generate(infer_pb2.GenerateRequest(), timeout=5))
    assert (err.code(), err.details()) == (Code.UNAUTHENTICATED, "missing or wrong bearer token")
    # with the token: a well-formed refusal of an empty prompt shows the call got through
    err = refused(
        lambda: stub.Generate(
            infer_pb2.GenerateRequest(prompt=prompt_pb2.PreparedPrompt()),
            timeout=5,
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
    )
    assert (err.code(), err.details()) == (Code.INVALID_ARGUMENT, "prompt has no chunks")
    # probes need no token: health and reflection
    for address, service in ((prep, PREP), (infer, INFER)):
        ch = grpc.insecure_channel(address, options=OPTIONS)
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        listed = next(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        assert service in {s.name for s in listed.list_services_response.service}
        ch.close()
    # the client library sends the token on every call
    with SlotwiseClient(prep, infer, token=TOKEN) as client:
        round_trip(client)
    with SlotwiseClient(prep, infer, token=WRONG, retry=NO_RETRY) as client:
        with pytest.raises(SlotwiseError) as e:
            client.model_info()
        assert e.value.code() == Code.UNAUTHENTICATED
        with pytest.raises(SlotwiseError) as e:
            list(client.chat(conversation(), max_tokens=2))
        assert e.value.code() == Code.UNAUTHENTICATED


def test_token_and_mutual_tls_together(pki: Path, secured) -> None:
    prep, infer = secured(
        Security(
            cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem", token=TOKEN
        )
    )
    with SlotwiseClient(prep, infer, tls=tls(pki, client="client"), token=TOKEN) as client:
        round_trip(client)
    with SlotwiseClient(prep, infer, tls=tls(pki, client="client"), retry=NO_RETRY) as client:
        with pytest.raises(SlotwiseError) as e:
            client.server_info()
        assert e.value.code() == Code.UNAUTHENTICATED


# -- logs ---------------------------------------------------------------------------------------

LONG_BLOB = re.compile(r"[A-Za-z0-9+/=]{120,}|(?:\\x[0-9a-f]{2}){16,}")


def test_logs_hold_no_image_bytes_and_no_token(secured, caplog: pytest.LogCaptureFixture) -> None:
    """Today the services log little on these paths; this guards against a future
    `log.debug("%s", request)` (a protobuf repr of pixels) or a logged token."""
    caplog.set_level(logging.DEBUG, logger="slotwise")
    prep, infer = secured(Security(token=TOKEN))
    png = image_bytes(112, 112, seed=4)
    rgb = decode_image(png).rgb
    details: list[str] = []
    with SlotwiseClient(prep, infer, token=TOKEN) as client:
        prepared = client.prepare(conversation())
        list(client.generate(prepared, max_tokens=3))
        # an invalid request: pixels that do not match their media_id
        forged = prompt_pb2.PreparedPrompt()
        forged.CopyFrom(prepared.prompt)
        media = next(c.media for c in forged.chunks if c.HasField("media"))
        media.rgb = bytes(b ^ 0x55 for b in rgb_of(media))
        with pytest.raises(SlotwiseError) as e:
            list(client.generate(forged, max_tokens=3))
        details.append(e.value.details())
        # an image prep cannot decode, and a truncated one
        for bad in (b"\x89PNG" + rgb[:4000], png[: len(png) // 2]):
            with pytest.raises(SlotwiseError) as e:
                client.prepare([Message.user(bad, "?")])
            details.append(e.value.details())
    with SlotwiseClient(prep, infer, token=WRONG, retry=NO_RETRY) as client:
        with pytest.raises(SlotwiseError) as e:
            client.prepare(conversation())
        details.append(e.value.details())

    # the capture works: the services' lines about these very requests are in it
    assert any(r.name.startswith("slotwise.") for r in caplog.records), caplog.records

    texts = [caplog.text, *details]
    secrets = [TOKEN, WRONG]
    for blob in (rgb, media.rgb, png):
        for start in (0, len(blob) // 2):
            piece = blob[start : start + 48]
            secrets += [piece.hex(), base64.b64encode(piece).decode(), repr(piece)[2:-1]]
    for text in texts:
        for secret in secrets:
            assert secret not in text
        assert not LONG_BLOB.search(text), LONG_BLOB.search(text)
