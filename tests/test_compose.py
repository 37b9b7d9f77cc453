"""compose.yaml, compose.cpu.yaml, docker/*.Dockerfile and .dockerignore, checked statically.

No Docker engine runs where these tests run, so nothing is built or started. The generic checks
are the tools': every compose file against the Compose Specification's schema
(`check-jsonschema --builtin-schema vendor.compose-spec`), every Dockerfile with hadolint (its
settings in .hadolint.yaml). What is slotwise's own is checked here: every command (compose
`command`, Dockerfile `CMD`) is parsed by the service's own argument parser, so renaming a flag
in prep_service/infer_service/clients fails here; ports, healthchecks, EXPOSE, the model and
session volumes and the GPU reservation agree; the healthcheck one-liners run against real
services. The compose files are read with PyYAML: every variable is `${NAME:-default}` (`$$` a
literal `$`, in nginx's shell script), and compose.cpu.yaml replaces whole keys of one service
(`!override`, `!reset`); where a docker CLI with the compose plugin exists, `docker compose
config` confirms that reading.

nginx is the entry (prep and infer publish nothing and scale with --scale): its ports agree with
the template's listen values, the template is mounted, and the shell script that lists the infer
replicas before nginx starts runs here against a stand-in nslookup (what nginx then makes of the
rendered configuration: tests/test_deploy.py, with `nginx -t`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from slotwise.v1 import infer_pb2, prep_pb2

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
CPU_OVERRIDE = ROOT / "compose.cpu.yaml"
COMPOSE_FILES = sorted(ROOT.glob("compose*.yaml"))
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
MODULES = {"prep": "prep_service", "infer": "infer_service"}
GRPC_SERVICES = {
    "prep": prep_pb2.DESCRIPTOR.services_by_name["PrepService"].full_name,
    "infer": infer_pb2.DESCRIPTOR.services_by_name["InferService"].full_name,
}


def tool(name: str) -> str:
    """A command of the test extra (check-jsonschema, hadolint): in this venv, or on PATH."""
    here = Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def run_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def service_parser(module: str) -> argparse.ArgumentParser:
    if module == "prep_service":
        from prep_service.__main__ import parser
    elif module == "infer_service":
        from infer_service.__main__ import parser
    else:
        raise AssertionError(f"no parser for {module}")
    return parser()


def parse_command(argv: list[str], module: str) -> argparse.Namespace:
    """argv is `python -m MODULE FLAGS...`; every flag must be one the service's parser knows
    exactly (argparse would accept an abbreviation), and the whole list must parse."""
    assert argv[:3] == ["python", "-m", module], argv
    parser = service_parser(module)
    known = set(parser._option_string_actions)
    unknown = [a for a in argv[3:] if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:
        pytest.fail(f"{module} has no flag {unknown}: its parser knows {sorted(known)}")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv[3:])
    except SystemExit:
        pytest.fail(f"{module} rejects {shlex.join(argv)}: {stderr.getvalue()}")


# -- reading the compose files ---------------------------------------------------------------


@dataclass
class Tagged:
    """A value under one of Compose's merge tags: `!reset` removes the key, `!override`
    replaces it whole."""

    tag: str
    value: Any


class ComposeLoader(yaml.SafeLoader):
    pass


def _tagged(loader: ComposeLoader, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        return Tagged(node.tag, loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Tagged(node.tag, loader.construct_sequence(node, deep=True))
    return Tagged(node.tag, loader.construct_scalar(node))  # type: ignore[arg-type]


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _tagged)

VARIABLE = re.compile(r"\$\{(?P<name>[A-Z][A-Z0-9_]*):-(?P<default>[^}$]*)\}")
ESCAPED_OR_VARIABLE = re.compile(r"\$\$|" + VARIABLE.pattern)  # `$$`: a literal `$`


def read_yaml(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return ESCAPED_OR_VARIABLE.sub(
            lambda m: "$" if m[0] == "$$" else env.get(m["name"]) or m["default"], value
        )
    return value


def compose_config(cpu: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml, with compose.cpu.yaml over it for the CPU stack, variables substituted."""
    config = read_yaml(COMPOSE)
    if cpu:
        for name, keys in read_yaml(CPU_OVERRIDE)["services"].items():
            for key, value in keys.items():
                # a plain mapping or list would be merged into the base's: not read here
                assert isinstance(value, Tagged | str), f"{name}.{key}: use !override"
                if isinstance(value, Tagged) and value.tag == "!reset":
                    del config["services"][name][key]
                else:
                    config["services"][name][key] = getattr(value, "value", value)
    return interpolate(config, env or {})


VARIANTS = {"gpu": False, "cpu": True}


@pytest.fixture(params=sorted(VARIANTS))
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    return compose_config(VARIANTS[request.param])


def container_ports(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each published port (short syntax)."""
    out = []
    for spec in service.get("ports", []):
        parts = str(spec).split(":")
        host = parts[0] if len(parts) == 3 else ""
        out.append((host, int(parts[-2]), int(parts[-1])))
    return out


def health_target(service: dict[str, Any]) -> tuple[int, str]:
    """(port, gRPC service name) the healthcheck one-liner asks."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], "exec form: python -c ONE-LINER"
    code = test[3]
    port = re.findall(r"insecure_channel\('127\.0\.0\.1:(\d+)'\)", code)
    name = re.findall(r"HealthCheckRequest\(service='([^']*)'\)", code)
    assert len(port) == 1 and len(name) == 1, code
    return int(port[0]), name[0]


# -- the tools -------------------------------------------------------------------------------


def untagged(value: Any) -> Any:
    if isinstance(value, Tagged):
        return untagged(value.value)
    if isinstance(value, dict):
        return {k: untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untagged(v) for v in value]
    return value


def check_compose_schema(paths: list[Path], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema on compose files. One with Compose's merge tags (which no YAML library
    knows) goes as JSON with the tags dropped and their values kept."""
    inputs = []
    for path in paths:
        document = read_yaml(path)
        if document != untagged(document):
            path = tmp_path / f"{path.stem}.json"
            path.write_text(json.dumps(untagged(document)))
        inputs.append(str(path))
    schema = ("--builtin-schema", "vendor.compose-spec")
    return run_tool(tool("check-jsonschema"), *schema, *inputs)


def test_compose_files_follow_the_compose_spec(tmp_path: Path) -> None:
    assert {p.name for p in COMPOSE_FILES} >= {COMPOSE.name, CPU_OVERRIDE.name}
    done = check_compose_schema(COMPOSE_FILES, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_compose_schema_check_fails_on_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:", "    health_check:", 1))
    done = check_compose_schema([broken], tmp_path)
    assert done.returncode != 0 and "health_check" in done.stdout, done.stdout + done.stderr


def hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    config = ("--config", str(ROOT / ".hadolint.yaml"), "--no-color")
    return run_tool(tool("hadolint"), *config, *map(str, paths))


def test_dockerfiles_pass_hadolint() -> None:
    assert DOCKERFILES
    done = hadolint(*DOCKERFILES)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_on_a_broken_dockerfile(tmp_path: Path) -> None:
    text = (ROOT / "docker" / "prep.Dockerfile").read_text()
    cmd = text[text.rindex("\nCMD [") :]
    broken = tmp_path / "prep.Dockerfile"
    broken.write_text(text.replace(cmd, "\nCMD python -m prep_service --port 50051\n"))
    done = hadolint(broken)
    assert done.returncode != 0 and "DL3025" in done.stdout, done.stdout  # CMD in exec form


# -- compose files ---------------------------------------------------------------------------


def test_a_renamed_or_abbreviated_flag_fails() -> None:
    good = ["python", "-m", "infer_service", "--model", "/models/m.gguf", "--ctx-size", "8"]
    assert parse_command(good, "infer_service").ctx_size == 8
    for bad in (["--ctx", "8"], ["--context-size", "8"], ["--ctx-size", "eight"]):
        with pytest.raises(pytest.fail.Exception):
            parse_command([*good[:5], *bad], "infer_service")
    with pytest.raises(AssertionError):
        parse_command(["python", "-m", "prep_service", "--model", "m"], "infer_service")


def test_every_variable_has_a_default_and_is_documented() -> None:
    header = "\n".join(ln for ln in COMPOSE.read_text().splitlines() if ln.startswith("#"))
    for path in COMPOSE_FILES:
        body = "\n".join(ln for ln in path.read_text().splitlines() if not ln.startswith("#"))
        body = body.replace("$$", "")  # a literal `$` (the shell's, in nginx's command)
        uses = VARIABLE.findall(body)
        assert body.count("$") == len(uses), f"{path.name}: write every variable ${{NAME:-default}}"
        for name, _ in uses:
            assert name in header, f"{name} is not documented in the header of compose.yaml"


@pytest.mark.parametrize("name", ["prep", "infer"])
def test_command_flags_exist_in_the_service_parser(config: dict[str, Any], name: str) -> None:
    command = config["services"][name]["command"]
    assert all(isinstance(a, str) for a in command), "quote numbers: Compose wants strings"
    args = parse_command(command, MODULES[name])
    assert args.host == "0.0.0.0"  # reachable from the other containers and the published port


def test_the_gateway_command_parses_and_its_ports_and_healthcheck_agree(
    config: dict[str, Any],
) -> None:
    from slotwise_cli import parser

    service = config["services"]["gateway"]
    command = service["command"]
    assert command[:2] == ["slotwise", "gateway"]
    sub = parser()._subparsers._group_actions[0].choices["gateway"]  # type: ignore[union-attr]
    known = set(sub._option_string_actions)
    assert all(a in known for a in command[2:] if a.startswith("--")), command
    args = parser().parse_args(command[1:])
    assert (args.prep, args.infer) == entry_addresses(config)  # through nginx
    assert args.host == "0.0.0.0"
    assert container_ports(service) == [("127.0.0.1", 8080, args.port)]
    assert f"127.0.0.1:{args.port}/ready" in service["healthcheck"]["test"][3]
    assert service["depends_on"] == {"nginx": {"condition": "service_healthy"}}
    assert service["image"] == config["services"]["prep"]["image"]  # the package is in it


@pytest.mark.parametrize("name", ["prep", "infer"])
def test_ports_and_healthchecks_agree(config: dict[str, Any], name: str) -> None:
    service = config["services"][name]
    args = parse_command(service["command"], MODULES[name])
    assert "ports" not in service  # published by nginx: a fixed host port allows one replica
    assert health_target(service) == (args.port, GRPC_SERVICES[name])


def test_published_ports_and_models_follow_the_environment() -> None:
    env = {
        "SLOTWISE_MODEL": "qwen2.5-vl-7b-q4_k_m.gguf",
        "SLOTWISE_MMPROJ": "mmproj-qwen2.5-vl-7b-f16.gguf",
        "SLOTWISE_MODELS_DIR": "/srv/models",
        "SLOTWISE_CTX_SIZE": "8192",
        "SLOTWISE_PARALLEL": "2",
        "SLOTWISE_GPU_LAYERS": "20",
        "SLOTWISE_PREP_PORT": "6001",
        "SLOTWISE_INFER_PORT": "6002",
        "SLOTWISE_BIND": "0.0.0.0",
        "SLOTWISE_TAG": "v1",
    }
    config = compose_config(env=env)
    prep, infer = config["services"]["prep"], config["services"]["infer"]
    p = parse_command(prep["command"], "prep_service")
    i = parse_command(infer["command"], "infer_service")
    assert p.model == i.model == Path("/models/qwen2.5-vl-7b-q4_k_m.gguf")
    assert p.mmproj == i.mmproj == Path("/models/mmproj-qwen2.5-vl-7b-f16.gguf")
    assert (i.ctx_size, i.parallel, i.gpu_layers) == (8192, 2, 20)
    nginx = config["services"]["nginx"]
    assert container_ports(nginx) == [("0.0.0.0", 6001, p.port), ("0.0.0.0", 6002, i.port)]
    assert prep["volumes"][0]["source"] == "/srv/models"
    assert infer["image"] == "slotwise/infer:v1-cuda"


@pytest.mark.parametrize("name", ["prep", "infer"])
def test_models_come_from_the_read_only_volume(config: dict[str, Any], name: str) -> None:
    service = config["services"][name]
    args = parse_command(service["command"], MODULES[name])
    mounts = [v for v in service["volumes"] if v["target"] == "/models"]
    assert mounts == [
        {
            "type": "bind",
            "source": "./models",
            "target": "/models",
            "read_only": True,
            "bind": {"create_host_path": False},
        }
    ]
    for model in (args.model, args.mmproj):
        assert model.parent == Path("/models"), model
    assert (args.model.name, args.mmproj.name) == ("model.gguf", "mmproj.gguf")


def test_sessions_persist_in_a_named_volume(config: dict[str, Any]) -> None:
    infer = config["services"]["infer"]
    args = parse_command(infer["command"], "infer_service")
    volume = {"type": "volume", "source": "sessions", "target": str(args.sessions_dir)}
    assert volume in infer["volumes"]


def test_the_router_profile_serves_the_models_folder() -> None:
    from slotwise_serve.router_command import is_router
    from slotwise_serve.serve_command import parser

    router = compose_config()["services"]["router"]
    assert router["profiles"] == ["router"]
    command = router["command"]
    assert command[:2] == ["slotwise", "serve"] and is_router(command[2:])
    args = parser().parse_args(command[2:])
    assert str(args.models_dir) == "/models" and args.models_max == 4
    assert any(v.get("target") == "/models" and v.get("read_only") for v in router["volumes"])
    assert router["ports"][0].endswith(f":{args.http_port}") and args.http_port == 8080
    assert f":{args.http_port}/health" in " ".join(router["healthcheck"]["test"])


def test_gpu_is_reserved_for_the_model_services_only() -> None:
    config = compose_config()
    for name in ("infer", "router"):  # (the router's processes load its models)
        devices = config["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    loads = ("infer", "router")
    assert all("deploy" not in s for n, s in config["services"].items() if n not in loads)
    args = parse_command(config["services"]["infer"]["command"], "infer_service")
    assert args.gpu_layers == 999
    assert config["services"]["infer"]["build"]["dockerfile"] == "docker/infer.Dockerfile"


def test_cpu_override_removes_the_gpu() -> None:
    gpu, cpu = compose_config(), compose_config(cpu=True)
    assert all("deploy" not in s for s in cpu["services"].values())
    infer = cpu["services"]["infer"]
    assert infer["build"] == {
        "context": ".",
        "dockerfile": "docker/prep.Dockerfile",
        "target": "infer-cpu",
        "args": {"PYTHON_IMAGE": "python:3.11-slim-bookworm"},  # the prep image's base
    }
    assert infer["image"] != gpu["services"]["infer"]["image"]  # two tags, not one overwritten
    assert infer["image"].endswith("-cpu") and gpu["services"]["infer"]["image"].endswith("-cuda")
    # everything else is the GPU stack's: same command, (no) ports, healthcheck, volumes
    for key in ("command", "ports", "healthcheck", "volumes", "container_name"):
        assert infer.get(key) == gpu["services"]["infer"].get(key)
    for name in ("prep", "nginx", "gateway", "client"):
        assert cpu["services"][name] == gpu["services"][name]


def test_client_waits_for_healthy_services(config: dict[str, Any]) -> None:
    from slotwise_cli import parser

    services = config["services"]
    client = services["client"]
    assert client["profiles"] == ["client"]  # not started by `docker compose up`
    assert client["depends_on"] == {"nginx": {"condition": "service_healthy"}}
    assert client["entrypoint"] == ["slotwise"]
    parser().parse_args(client["command"])
    env = client["environment"]
    assert (env["SLOTWISE_PREP"], env["SLOTWISE_INFER"]) == entry_addresses(config)
    # the same image as prep (which has the CLI installed), built from the same definition
    assert (client["image"], client["build"]) == (
        services["prep"]["image"],
        services["prep"]["build"],
    )


# -- nginx, the entry -------------------------------------------------------------------------

TEMPLATE = ROOT / "deploy" / "nginx" / "slotwise.conf.template"
TEMPLATE_TARGET = "/etc/nginx/templates/slotwise.conf.template"  # the image renders it to conf.d
SERVER = re.compile(r"server (?P<host>[^\s:;]+):(?P<port>\d+)(?P<params>[^;]*);")


def template_variables() -> set[str]:
    return set(re.findall(r"\$\{(\w+)\}", TEMPLATE.read_text()))


def entry_addresses(config: dict[str, Any]) -> tuple[str, str]:
    """nginx's addresses for prep and infer, as the other containers reach them."""
    env = config["services"]["nginx"]["environment"]
    return f"nginx:{env['SLOTWISE_PREP_LISTEN']}", f"nginx:{env['SLOTWISE_INFER_LISTEN']}"


def service_ports(config: dict[str, Any]) -> dict[str, int]:
    services = config["services"]
    return {n: parse_command(services[n]["command"], m).port for n, m in MODULES.items()}


# What nginx's script reads from `nslookup -type=a infer`: busybox's answer in the image (alpine)
# and the older busybox format; the DNS server's own address comes first and is no replica.
NSLOOKUP_ANSWERS = {
    "busybox": "Server:\t\t127.0.0.11\nAddress:\t127.0.0.11:53\n\nNon-authoritative answer:\n"
    "Name:\tinfer\nAddress: 172.18.0.5\n\nName:\tinfer\nAddress: 172.18.0.3\n\n",
    "busybox-old": "Server:    127.0.0.11\nAddress 1: 127.0.0.11\n\nName:      infer\n"
    "Address 1: 172.18.0.3 slotwise-infer-1.slotwise_default\n"
    "Address 2: 172.18.0.5 slotwise-infer-2.slotwise_default\n",
}


@dataclass
class NginxStart:
    env: dict[str, str]  # the environment the image's entrypoint (and so envsubst) gets
    argv: list[str]  # what the entrypoint is asked to run
    looked_up: list[str]  # nslookup's arguments
    default_conf_removed: bool


def run_nginx_startup(tmp_path: Path, answer: str, status: int = 0) -> NginxStart:
    """The nginx service's script (its entrypoint and command), run by this machine's sh with a
    stand-in nslookup that answers `answer`, and a stand-in for the image's entrypoint that
    records what it was given. The image runs it with busybox's sh, awk and sort: the script
    keeps to POSIX sh and awk."""
    service = compose_config()["services"]["nginx"]
    assert service["entrypoint"] == ["/bin/sh", "-ec"]
    (script,) = service["command"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "answer").write_text(answer)
    record = 'for a in "$@"; do printf "%s\\n" "$a"; done'
    fakes = {
        bin_dir / "nslookup": f"{record} > {tmp_path}/looked_up\ncat {tmp_path}/answer\n"
        f"exit {status}\n",
        tmp_path / "entrypoint.sh": f"{record} > {tmp_path}/argv\nenv > {tmp_path}/env\n",
    }
    for path, body in fakes.items():
        path.write_text(f"#!/bin/sh\n{body}")
        path.chmod(0o755)
    default_conf = tmp_path / "default.conf"
    default_conf.write_text("server { listen 80; }\n")
    for path, stand_in in (
        ("/docker-entrypoint.sh", tmp_path / "entrypoint.sh"),
        ("/etc/nginx/conf.d/default.conf", default_conf),
    ):
        assert script.count(path) == 1, path
        script = script.replace(path, str(stand_in))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **service["environment"]}
    done = subprocess.run(
        ["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "env").read_text().splitlines()
    return NginxStart(
        env=dict(line.split("=", 1) for line in lines if "=" in line),
        argv=(tmp_path / "argv").read_text().splitlines(),
        looked_up=(tmp_path / "looked_up").read_text().splitlines(),
        default_conf_removed=not default_conf.exists(),
    )


def test_nginx_is_the_entry(config: dict[str, Any]) -> None:
    services = config["services"]
    nginx = services["nginx"]
    assert re.fullmatch(r"nginx:\d+\.\d+-alpine", nginx["image"]), "the official image, pinned"
    env = nginx["environment"]
    listen = {name: int(env[f"SLOTWISE_{name.upper()}_LISTEN"]) for name in MODULES}
    # the host ports prep and infer had: a client of the stack changes nothing
    assert listen == service_ports(config) == {"prep": 50051, "infer": 50052}
    assert container_ports(nginx) == [
        ("127.0.0.1", 50051, listen["prep"]),
        ("127.0.0.1", 50052, listen["infer"]),
    ]
    test = nginx["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    assert [int(p) for p in re.findall(r"nc -z 127\.0\.0\.1 (\d+)", test[1])] == [
        listen["prep"],
        listen["infer"],
    ]
    assert nginx["volumes"] == [
        {
            "type": "bind",
            "source": "./deploy/nginx/slotwise.conf.template",
            "target": TEMPLATE_TARGET,
            "read_only": True,
            "bind": {"create_host_path": False},
        }
    ]
    assert (ROOT / nginx["volumes"][0]["source"]).is_file()
    # every variable of the template is given: by the environment, or (the infer replicas) by
    # the script before the image's entrypoint; envsubst renders those and nothing else
    given = {k for k in env if k.startswith("SLOTWISE_")} | {"SLOTWISE_INFER_SERVERS"}
    assert template_variables() == given
    assert all(re.match(env["NGINX_ENVSUBST_FILTER"], name) for name in given)
    prep = SERVER.fullmatch(env["SLOTWISE_PREP_SERVERS"])
    assert prep and (prep["host"], int(prep["port"])) == ("prep", service_ports(config)["prep"])
    assert nginx["depends_on"] == {
        "prep": {"condition": "service_healthy"},
        "infer": {"condition": "service_healthy"},
    }
    assert "init" not in nginx  # nginx is PID 1, stopped by the image's STOPSIGNAL (graceful)


def test_prep_and_infer_scale(config: dict[str, Any]) -> None:
    """`docker compose up --scale infer=N`: no fixed name, host port or hostname; every replica
    mounts the one sessions volume read-write."""
    for name in MODULES:
        service = config["services"][name]
        assert not {"container_name", "ports", "hostname"} & set(service), name
    infer = config["services"]["infer"]
    args = parse_command(infer["command"], "infer_service")
    (mount,) = [v for v in infer["volumes"] if v["target"] == str(args.sessions_dir)]
    assert mount["type"] == "volume" and mount["source"] in config["volumes"]
    assert not mount.get("read_only")


@pytest.mark.parametrize("answer", sorted(NSLOOKUP_ANSWERS))
def test_nginx_lists_every_infer_replica_by_address(tmp_path: Path, answer: str) -> None:
    """One `server` line per replica: nginx's consistent hash places server *names* on its ring
    (one name for every replica would be one point, shared round robin)."""
    start = run_nginx_startup(tmp_path, NSLOOKUP_ANSWERS[answer])
    assert start.looked_up == ["-type=a", "infer"]
    servers = [m.groupdict() for m in SERVER.finditer(start.env["SLOTWISE_INFER_SERVERS"])]
    assert [(s["host"], int(s["port"])) for s in servers] == [
        ("172.18.0.3", service_ports(compose_config())["infer"]),
        ("172.18.0.5", service_ports(compose_config())["infer"]),
    ]
    prep = SERVER.fullmatch(start.env["SLOTWISE_PREP_SERVERS"])
    assert prep and all(s["params"] == prep["params"] for s in servers)  # the same failover
    assert start.argv == ["nginx", "-g", "daemon off;"]  # the image's own CMD
    assert start.default_conf_removed  # the image's welcome page on port 80: not served


def test_nginx_falls_back_to_the_service_name(tmp_path: Path) -> None:
    start = run_nginx_startup(tmp_path, "** server can't find infer: NXDOMAIN\n", status=1)
    assert start.env["SLOTWISE_INFER_SERVERS"] == "server infer:50052 max_fails=1 fail_timeout=5s;"


def test_nothing_is_downloaded() -> None:
    for path in [*COMPOSE_FILES, *DOCKERFILES]:
        text = path.read_text().lower()
        for word in ("curl ", "wget ", "huggingface", "hf_hub", "hf.co", "git clone", "add http"):
            assert word not in text, f"{path.name} downloads something ({word.strip()})"


def test_docker_compose_config_agrees(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI here")
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI here has no compose plugin")
    (tmp_path / "models").mkdir()
    for variant, cpu in VARIANTS.items():
        files = [COMPOSE, CPU_OVERRIDE] if cpu else [COMPOSE]
        cmd = [docker, "compose", "--project-directory", str(ROOT)]
        cmd += [a for f in files for a in ("-f", str(f))]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTWISE_")}
        env["SLOTWISE_MODELS_DIR"] = str(tmp_path / "models")
        done = subprocess.run(
            [*cmd, "--profile", "client", "config", "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        theirs = json.loads(done.stdout)["services"]
        ours = compose_config(cpu, env={"SLOTWISE_MODELS_DIR": str(tmp_path / "models")})
        for name in ("prep", "infer", "gateway", "client"):
            assert theirs[name]["command"] == ours["services"][name]["command"], variant
        assert ("deploy" in theirs["infer"]) == (variant == "gpu")


# -- healthchecks, run for real --------------------------------------------------------------


def run_healthcheck(service: dict[str, Any], port: int) -> int:
    code = service["healthcheck"]["test"][3]
    default_port, _ = health_target(service)
    code = code.replace(f"127.0.0.1:{default_port}", f"127.0.0.1:{port}")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_healthchecks_pass_against_serving_services(
    prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    services = compose_config()["services"]
    assert run_healthcheck(services["prep"], prep_servers("mrope")) == 0
    assert run_healthcheck(services["infer"], infer_server("mrope").port) == 0


def test_healthchecks_fail_when_nothing_serves() -> None:
    services = compose_config()["services"]
    port = free_port()
    assert run_healthcheck(services["prep"], port) != 0
    assert run_healthcheck(services["infer"], port) != 0


def test_gpu_layers_are_harmless_without_a_gpu_backend(
    infer_server: Callable[..., Any], channel_to: Callable[[int], Any]
) -> None:
    """compose.cpu.yaml keeps --gpu-layers 999: a CPU-only llama.cpp keeps the layers on the CPU."""
    from slotwise.v1 import infer_pb2_grpc

    running = infer_server("rope", gpu_layers=999)
    info = infer_pb2_grpc.InferServiceStub(channel_to(running.port)).GetServerInfo(
        infer_pb2.GetServerInfoRequest(), timeout=30
    )
    assert info.num_slots >= 1


# -- Dockerfiles: what hadolint cannot know --------------------------------------------------


@dataclass
class Stage:
    base: str  # an image, or the name of an earlier stage
    instructions: list[tuple[str, str]]  # (INSTRUCTION, its arguments)

    def all(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def read_dockerfile(path: Path) -> tuple[dict[str, str], dict[str, Stage]]:
    """(the ARG defaults before the first FROM, the stages by name in order)."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    for line in re.sub(r"\\\n", " ", path.read_text()).splitlines():
        instruction, _, args = line.strip().partition(" ")
        if not instruction or instruction.startswith("#"):
            continue
        if instruction == "FROM":
            base, _, name = args.partition(" AS ")
            stages[name.strip() or str(len(stages))] = Stage(base.strip(), [])
        elif not stages:
            assert instruction == "ARG", f"{path.name}: {instruction} before FROM"
            key, _, default = args.partition("=")
            global_args[key] = default.strip('"')
        else:
            stages[list(stages)[-1]].instructions.append((instruction, args.strip()))
    return global_args, stages


def inherited(stages: dict[str, Stage], target: str, instruction: str) -> list[str]:
    """The instruction's arguments in the target and the stages it is built FROM, oldest first
    (the last one is in effect: CMD, USER, EXPOSE)."""
    out: list[str] = []
    stage = stages[target]
    while True:
        out = stage.all(instruction) + out
        if stage.base not in stages:
            return out
        stage = stages[stage.base]


BUILDS = [
    (variant, name, service["build"])
    for variant, cpu in VARIANTS.items()
    for name, service in compose_config(cpu)["services"].items()
    if "build" in service
]


@pytest.mark.parametrize(
    ("variant", "name", "build"), BUILDS, ids=[f"{v}-{n}" for v, n, _ in BUILDS]
)
def test_dockerfile_targets_run_the_service(variant: str, name: str, build: dict[str, Any]) -> None:
    global_args, stages = read_dockerfile(ROOT / build["context"] / build["dockerfile"])
    target = build.get("target", list(stages)[-1])
    assert target in stages
    declared = set(global_args) | {a.split("=")[0] for s in stages.values() for a in s.all("ARG")}
    assert set(build.get("args", {})) <= declared
    cmd = json.loads(inherited(stages, target, "CMD")[-1])  # exec form: hadolint's DL3025
    assert not inherited(stages, target, "ENTRYPOINT")  # compose's command replaces CMD
    module = "infer_service" if name == "infer" else "prep_service"
    args = parse_command(cmd, module)
    assert inherited(stages, target, "EXPOSE")[-1] == str(args.port)
    assert args.model.parent == args.mmproj.parent == Path("/models")
    service = compose_config(VARIANTS[variant])["services"]["prep" if name == "client" else name]
    assert parse_command(service["command"], module).port == args.port
    assert inherited(stages, target, "USER")[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_llama_cpp_python_is_built_from_source_in_the_build_stage(path: Path) -> None:
    _, stages = read_dockerfile(path)
    runs = {name: " ".join(stage.all("RUN")) for name, stage in stages.items()}
    # from source, the version pinned once (pyproject.toml), nothing else installed by hand
    assert "--no-binary llama-cpp-python" in runs["build"]
    assert "tomllib" in runs["build"] and "pyproject.toml" in runs["build"]
    assert "llama-cpp-python==" not in path.read_text()
    for name, run in runs.items():  # build tools stay in the build stage
        assert name == "build" or ("build-essential" not in run and "pip install" not in run)
    # the requirements the image installs, as its own one-liner computes them: the serve extra
    # (llama.cpp) included, since `pip install .` alone is the client
    script = re.search(r'python -c "(.+?)" > requirements.txt', runs["build"])
    assert script, runs["build"]
    out = subprocess.run(
        [sys.executable, "-c", script.group(1)], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "llama-cpp-python==0.3.36" in out.stdout.split("\n")
    assert "grpcio-reflection>=1.85.1" in out.stdout.split("\n")


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_a_build_needs_no_registry_but_its_base_images(path: Path) -> None:
    """`# syntax=docker/dockerfile:1` makes BuildKit fetch that frontend image from Docker Hub
    at every build (found by tests/compose_up.sh where Docker Hub is not reachable): the
    built-in frontend reads these files; and every base is a build argument."""
    text = path.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    global_args, stages = read_dockerfile(path)
    for stage in stages.values():
        assert stage.base in stages or stage.base.strip("${}") in global_args, stage.base


def test_cuda_image_builds_with_cuda_and_runs_on_the_runtime_base() -> None:
    global_args, stages = read_dockerfile(ROOT / "docker" / "infer.Dockerfile")
    build, runtime = stages["build"], list(stages.values())[-1]
    # the bases are build arguments whose defaults are NVIDIA's devel and runtime images
    assert (build.base, runtime.base) == ("${BUILD_IMAGE}", "${RUNTIME_IMAGE}")
    assert global_args["BUILD_IMAGE"].startswith("nvidia/cuda:${CUDA_VERSION}-devel-ubuntu")
    assert global_args["RUNTIME_IMAGE"].startswith("nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu")
    cmake_args = next(a for a in build.all("ARG") if a.startswith("LLAMA_CMAKE_ARGS="))
    assert "-DGGML_CUDA=on" in cmake_args
    assert "-DGGML_NATIVE=OFF" in cmake_args  # no GPU at build time: "native" cannot work
    cmd = json.loads(inherited(stages, list(stages)[-1], "CMD")[-1])
    assert parse_command(cmd, "infer_service").gpu_layers > 0


def test_cpu_images_use_python_3_11_slim() -> None:
    global_args, stages = read_dockerfile(ROOT / "docker" / "prep.Dockerfile")
    assert global_args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert list(stages) == ["build", "runtime", "infer-cpu", "prep"]  # prep: the default target
    cmd = json.loads(inherited(stages, "infer-cpu", "CMD")[-1])
    assert parse_command(cmd, "infer_service").gpu_layers == 0


def test_the_build_context_is_what_the_images_copy() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert patterns[0] == "*", ".dockerignore is an allow-list (no models, .venv, .git, tests)"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for path in DOCKERFILES:
        for stage in read_dockerfile(path)[1].values():
            for args in stage.all("COPY"):
                if not args.startswith("--from="):
                    copied.update(source.rstrip("/") for source in args.split()[:-1])
    assert copied == allowed, "every COPY source, and nothing else, is in the build context"
    assert all((ROOT / source).exists() for source in copied)
