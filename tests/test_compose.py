"""compose.yaml, compose.cpu.yaml, docker/*.Dockerfile and .dockerignore, checked statically.

No Docker engine runs where these tests run (and the docker CLI, where present, may lack the
compose plugin), so nothing is built or started: `docker compose config` would be the
reference, and `test_docker_compose_config_agrees` uses it when it is available. Everything else
reads the files with PyYAML and a small model of what Compose does with them: `${VAR:-default}`
interpolation, and merging an override file (`!reset`, `!override`; other keys deep-merged).

The strongest check: every command (compose `command`, Dockerfile `CMD`) is parsed by the
service's own argparse parser, so renaming a flag in prep_service/infer_service/clients fails
here. Ports, healthcheck targets, model paths and the GPU reservation are cross-checked, and the
healthcheck one-liners are run against real services.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from slotwise.v1 import infer_pb2, prep_pb2

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
CPU_OVERRIDE = ROOT / "compose.cpu.yaml"
MODULES = {"prep": "prep_service", "infer": "infer_service"}
GRPC_SERVICES = {
    "prep": prep_pb2.DESCRIPTOR.services_by_name["PrepService"].full_name,
    "infer": infer_pb2.DESCRIPTOR.services_by_name["InferService"].full_name,
}


def service_parser(module: str) -> argparse.ArgumentParser:
    if module == "prep_service":
        from prep_service.__main__ import parser
    elif module == "infer_service":
        from infer_service.__main__ import parser
    else:
        raise AssertionError(f"no parser for {module}")
    return parser()


# -- a small model of Compose ----------------------------------------------------------------


class _Reset:
    def __repr__(self) -> str:
        return "!reset"


RESET = _Reset()


@dataclass
class Override:
    value: Any


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: `!reset` removes a key, `!override` replaces it whole."""


def _construct_reset(loader: ComposeLoader, node: yaml.Node) -> _Reset:
    return RESET


def _construct_override(loader: ComposeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))  # type: ignore[arg-type]


ComposeLoader.add_constructor("!reset", _construct_reset)
ComposeLoader.add_constructor("!override", _construct_override)

_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        got = env.get(name)
        if op == ":-":
            return got if got else arg
        if op == "-":
            return arg if got is None else got
        if op in (":?", "?") and not got:
            raise KeyError(f"{name}: {arg}")
        return got or ""

    return _VARIABLE.sub(substitute, value)


def merge(base: Any, override: Any) -> Any:
    """Merge an override file into a base (mappings deep-merged; anything else replaced)."""
    if isinstance(override, Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value)
        return out
    return override


def read_yaml(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def compose_config(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for path in files:
        config = merge(config, read_yaml(path))
    return interpolate(config, env or {})


VARIANTS = {"gpu": (COMPOSE,), "cpu": (COMPOSE, CPU_OVERRIDE)}


@pytest.fixture(params=sorted(VARIANTS))
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    return compose_config(*VARIANTS[request.param])


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


# -- a small Dockerfile reader ---------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for instr, args in self.instructions if instr == instruction]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str | None) -> Stage:
        if name is None:
            return self.stages[-1]
        found = [s for s in self.stages if s.name == name]
        assert found, f"{self.path.name} has no stage {name!r}"
        return found[0]

    def chain(self, name: str | None) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        stages = [self.stage(name)]
        while stages[-1].base in {s.name for s in self.stages}:
            stages.append(self.stage(stages[-1].base))
        return stages

    def effective(self, name: str | None, instruction: str) -> str | None:
        """The last value of an instruction that a target inherits (CMD, USER, ...)."""
        for stage in self.chain(name):
            values = stage.all(instruction)
            if values:
                return values[-1]
        return None


def read_dockerfile(path: Path) -> Dockerfile:
    text = re.sub(r"\\\n", " ", path.read_text())  # line continuations
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        instruction, args = instruction.upper(), args.strip()
        if instruction == "FROM":
            words = args.split()
            image = re.sub(
                r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), words[0]
            )
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, image))
        elif instruction == "ARG" and not stages:
            key, _, default = args.partition("=")
            global_args[key] = default.strip('"')
        else:
            assert stages, f"{path.name}: {instruction} before FROM"
            stages[-1].instructions.append((instruction, args))
    return Dockerfile(path, global_args, stages)


def copy_sources(args: str) -> tuple[dict[str, str], list[str]]:
    """(flags, sources) of a COPY instruction (shell form)."""
    words = args.split()
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1]


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path (or a parent folder) decides."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
            if part in ("**", "**/"):
                out += "(?:.*/)?" if part == "**/" else ".*"
            elif part == "*":
                out += "[^/]*"
            elif part == "?":
                out += "[^/]"
            else:
                out += re.escape(part)
        return re.compile(out + r"\Z")

    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        compiled = regex(pattern.lstrip("!"))
        if any(compiled.match(c) for c in candidates):
            excluded = not negated
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def builds(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, service in config["services"].items():
        if "build" in service:
            yield name, service["build"]


# -- compose files ---------------------------------------------------------------------------


def test_the_model_of_compose_is_faithful() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d}", env) == "v d d"
    assert interpolate("${SET-d} ${EMPTY-d} ${UNSET-d} $SET $$HOME", env) == "v  d v $HOME"
    with pytest.raises(KeyError):
        interpolate("${UNSET:?needed}", env)
    base = {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}, "f": 1}
    override = {"a": {"c": [3]}, "d": Override({"g": 2}), "f": RESET}
    assert merge(base, override) == {"a": {"b": 1, "c": [3]}, "d": {"g": 2}}
    loaded = yaml.load("a: !reset {}\nb: !override {c: 1}\n", Loader=ComposeLoader)
    assert loaded == {"a": RESET, "b": Override({"c": 1})}


def test_a_renamed_or_abbreviated_flag_fails() -> None:
    good = ["python", "-m", "infer_service", "--model", "/models/m.gguf", "--ctx-size", "8"]
    assert parse_command(good, "infer_service").ctx_size == 8
    for bad in (["--ctx", "8"], ["--context-size", "8"], ["--ctx-size", "eight"]):
        with pytest.raises(pytest.fail.Exception):
            parse_command([*good[:5], *bad], "infer_service")
    with pytest.raises(AssertionError):
        parse_command(["python", "-m", "prep_service", "--model", "m"], "infer_service")


def test_compose_files_parse() -> None:
    base = read_yaml(COMPOSE)
    assert base["name"] == "slotwise"
    assert set(base["services"]) == {"prep", "infer", "gateway", "client"}
    assert set(base["volumes"]) == {"sessions"}
    override = read_yaml(CPU_OVERRIDE)
    # the merge model above covers exactly what the override uses
    assert set(override) == {"services"} and set(override["services"]) == {"infer"}
    assert set(override["services"]["infer"]) == {"build", "image", "deploy"}


def test_every_variable_has_a_default_and_is_documented() -> None:
    header = "\n".join(ln for ln in COMPOSE.read_text().splitlines() if ln.startswith("#"))
    for path in (COMPOSE, CPU_OVERRIDE):
        body = "\n".join(ln for ln in path.read_text().splitlines() if not ln.startswith("#"))
        for m in _VARIABLE.finditer(body):
            if m.group(0) == "$$":
                continue
            name = m.group("name") or m.group("bare")
            assert m.group("op") == ":-", f"{path.name}: ${{{name}}} needs a :-default"
            assert "$" not in m.group("arg"), f"{path.name}: nested variable in ${{{name}}}"
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
    from clients.cli import parser

    service = config["services"]["gateway"]
    command = service["command"]
    assert command[:2] == ["slotwise", "gateway"]
    sub = parser()._subparsers._group_actions[0].choices["gateway"]  # type: ignore[union-attr]
    known = set(sub._option_string_actions)
    assert all(a in known for a in command[2:] if a.startswith("--")), command
    args = parser().parse_args(command[1:])
    assert (args.prep, args.infer) == ("prep:50051", "infer:50052")
    assert args.host == "0.0.0.0"
    assert container_ports(service) == [("127.0.0.1", 8080, args.port)]
    assert f"127.0.0.1:{args.port}/ready" in service["healthcheck"]["test"][3]
    assert set(service["depends_on"]) == {"prep", "infer"}
    assert service["image"] == config["services"]["prep"]["image"]  # the package is in it


@pytest.mark.parametrize("name", ["prep", "infer"])
def test_ports_agree(config: dict[str, Any], name: str) -> None:
    service = config["services"][name]
    args = parse_command(service["command"], MODULES[name])
    ports = container_ports(service)
    assert ports == [("127.0.0.1", args.port, args.port)]
    port, grpc_service = health_target(service)
    assert port == args.port
    assert grpc_service == GRPC_SERVICES[name]
    build = service["build"]
    dockerfile = read_dockerfile(ROOT / build["context"] / build["dockerfile"])
    assert dockerfile.effective(build.get("target"), "EXPOSE") == str(args.port)


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
    config = compose_config(COMPOSE, env=env)
    prep, infer = config["services"]["prep"], config["services"]["infer"]
    p = parse_command(prep["command"], "prep_service")
    i = parse_command(infer["command"], "infer_service")
    assert p.model == i.model == Path("/models/qwen2.5-vl-7b-q4_k_m.gguf")
    assert p.mmproj == i.mmproj == Path("/models/mmproj-qwen2.5-vl-7b-f16.gguf")
    assert (i.ctx_size, i.parallel, i.gpu_layers) == (8192, 2, 20)
    assert container_ports(prep) == [("0.0.0.0", 6001, 50051)]
    assert container_ports(infer) == [("0.0.0.0", 6002, 50052)]
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
    assert {"type": "volume", "source": "sessions", "target": str(args.sessions_dir)} in infer[
        "volumes"
    ]


def test_gpu_is_reserved_for_infer_only() -> None:
    config = compose_config(COMPOSE)
    devices = config["services"]["infer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert all("deploy" not in s for n, s in config["services"].items() if n != "infer")
    args = parse_command(config["services"]["infer"]["command"], "infer_service")
    assert args.gpu_layers == 999
    assert config["services"]["infer"]["build"]["dockerfile"] == "docker/infer.Dockerfile"


def test_cpu_override_removes_the_gpu() -> None:
    gpu, cpu = compose_config(COMPOSE), compose_config(COMPOSE, CPU_OVERRIDE)
    assert all("deploy" not in s for s in cpu["services"].values())
    infer = cpu["services"]["infer"]
    assert infer["build"] == {
        "context": ".",
        "dockerfile": "docker/prep.Dockerfile",
        "target": "infer-cpu",
    }
    assert infer["image"] != gpu["services"]["infer"]["image"]  # two tags, not one overwritten
    assert infer["image"].endswith("-cpu") and gpu["services"]["infer"]["image"].endswith("-cuda")
    # everything else is the GPU stack's: same command, ports, healthcheck, volumes
    for key in ("command", "ports", "healthcheck", "volumes"):
        assert infer[key] == gpu["services"]["infer"][key]
    for name in ("prep", "client"):
        assert cpu["services"][name] == gpu["services"][name]


def test_client_waits_for_healthy_services(config: dict[str, Any]) -> None:
    from clients.cli import parser

    services = config["services"]
    client = services["client"]
    assert client["profiles"] == ["client"]  # not started by `docker compose up`
    assert client["depends_on"] == {
        "prep": {"condition": "service_healthy"},
        "infer": {"condition": "service_healthy"},
    }
    assert client["entrypoint"] == ["slotwise"]
    parser().parse_args(client["command"])
    for name in ("prep", "infer"):
        port = parse_command(services[name]["command"], MODULES[name]).port
        assert client["environment"][f"SLOTWISE_{name.upper()}"] == f"{name}:{port}"
    # the same image as prep (which has the CLI installed), built from the same definition
    assert (client["image"], client["build"]) == (
        services["prep"]["image"],
        services["prep"]["build"],
    )


def test_nothing_is_downloaded() -> None:
    files = [COMPOSE, CPU_OVERRIDE, *sorted((ROOT / "docker").glob("*.Dockerfile"))]
    for path in files:
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
    for variant, files in VARIANTS.items():
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
        ours = compose_config(*files, env={"SLOTWISE_MODELS_DIR": str(tmp_path / "models")})
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
    services = compose_config(COMPOSE)["services"]
    assert run_healthcheck(services["prep"], prep_servers("mrope")) == 0
    assert run_healthcheck(services["infer"], infer_server("mrope").port) == 0


def test_healthchecks_fail_when_nothing_serves() -> None:
    services = compose_config(COMPOSE)["services"]
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


# -- Dockerfiles -----------------------------------------------------------------------------


def all_builds() -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for variant, files in VARIANTS.items():
        for name, build in builds(compose_config(*files)):
            out.append((variant, name, build))
    return out


BUILDS = all_builds()
BUILD_IDS = [f"{v}-{n}" for v, n, _ in BUILDS]


@pytest.mark.parametrize(
    ("variant", "name", "build"), BUILDS, ids=[f"{v}-{n}" for v, n, _ in BUILDS]
)
def test_dockerfile_targets_exist_and_copy_what_exists(
    variant: str, name: str, build: dict[str, Any]
) -> None:
    path = ROOT / build["context"] / build["dockerfile"]
    assert path.is_file()
    dockerfile = read_dockerfile(path)
    dockerfile.chain(build.get("target"))  # the target exists
    patterns = dockerignore_patterns()
    stage_names = {s.name for s in dockerfile.stages}
    for stage in dockerfile.stages:
        for args in stage.all("COPY"):
            flags, sources = copy_sources(args)
            if "from" in flags:
                assert flags["from"] in stage_names, f"COPY --from={flags['from']}: no such stage"
                continue
            for source in sources:
                assert (ROOT / build["context"] / source).exists(), (
                    f"COPY {source}: not in the repo"
                )
                assert not dockerignore_excludes(source, patterns), f".dockerignore drops {source}"
    declared = {a.split("=")[0] for s in dockerfile.stages for a in s.all("ARG")}
    assert set(build.get("args", {})) <= declared | set(dockerfile.global_args)


@pytest.mark.parametrize(
    ("variant", "name", "build"), BUILDS, ids=[f"{v}-{n}" for v, n, _ in BUILDS]
)
def test_dockerfile_cmd_is_the_service(variant: str, name: str, build: dict[str, Any]) -> None:
    dockerfile = read_dockerfile(ROOT / build["context"] / build["dockerfile"])
    target = build.get("target")
    cmd = json.loads(dockerfile.effective(target, "CMD") or "null")
    assert isinstance(cmd, list), "CMD in exec form (JSON), so signals reach python"
    assert dockerfile.effective(target, "ENTRYPOINT") is None  # compose's command replaces CMD
    module = "prep_service" if name in ("prep", "client") else "infer_service"
    args = parse_command(cmd, module)
    assert dockerfile.effective(target, "EXPOSE") == str(args.port)
    assert args.model.parent == args.mmproj.parent == Path("/models")
    compose_cmd = compose_config(*VARIANTS[variant])["services"][
        "prep" if name == "client" else name
    ]
    assert parse_command(compose_cmd["command"], module).port == args.port


@pytest.mark.parametrize(
    ("variant", "name", "build"), BUILDS, ids=[f"{v}-{n}" for v, n, _ in BUILDS]
)
def test_images_are_multi_stage_and_run_as_a_user(
    variant: str, name: str, build: dict[str, Any]
) -> None:
    dockerfile = read_dockerfile(ROOT / build["context"] / build["dockerfile"])
    target = build.get("target")
    user = dockerfile.effective(target, "USER")
    assert user is not None and user.split(":")[0] not in ("root", "0")
    chain = dockerfile.chain(target)
    runs = " ".join(r for s in chain for r in s.all("RUN"))
    assert "build-essential" not in runs and "pip install" not in runs, "build tools in runtime"
    copies = [copy_sources(a)[0].get("from") for s in chain for a in s.all("COPY")]
    assert "build" in copies, "the runtime image takes the built virtualenv from the build stage"
    build_stage = dockerfile.stage("build")
    build_runs = " ".join(build_stage.all("RUN"))
    # llama-cpp-python from source, its version pinned once (pyproject.toml), nothing else
    assert "--no-binary llama-cpp-python" in build_runs
    assert "llama-cpp-python==" not in dockerfile.path.read_text()
    assert "tomllib" in build_runs and "pyproject.toml" in build_runs


def test_cuda_image_builds_with_cuda_and_runs_on_the_runtime_base() -> None:
    dockerfile = read_dockerfile(ROOT / "docker" / "infer.Dockerfile")
    build, runtime = dockerfile.stage("build"), dockerfile.stages[-1]
    version = dockerfile.global_args["CUDA_VERSION"]
    assert build.base.startswith(f"nvidia/cuda:{version}-devel-ubuntu")
    assert runtime.base.startswith(f"nvidia/cuda:{version}-runtime-ubuntu")
    cmake_args = next(a for a in build.all("ARG") if a.startswith("LLAMA_CMAKE_ARGS="))
    assert "-DGGML_CUDA=on" in cmake_args
    assert "-DGGML_NATIVE=OFF" in cmake_args  # no GPU at build time: "native" cannot work
    cmd = json.loads(dockerfile.effective(None, "CMD") or "null")
    assert parse_command(cmd, "infer_service").gpu_layers > 0


def test_cpu_images_use_python_3_11_slim() -> None:
    dockerfile = read_dockerfile(ROOT / "docker" / "prep.Dockerfile")
    assert dockerfile.global_args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert {s.name for s in dockerfile.stages} == {"build", "runtime", "infer-cpu", "prep"}
    assert dockerfile.stages[-1].name == "prep"  # the default target
    cmd = json.loads(dockerfile.effective("infer-cpu", "CMD") or "null")
    assert parse_command(cmd, "infer_service").gpu_layers == 0


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = dockerignore_patterns()
    excluded = [
        "models/model.gguf",
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "tests/contract/node/node_modules/x",
        "prep_service/__pycache__/a.pyc",
    ]
    for path in excluded:
        assert dockerignore_excludes(path, patterns), path
    for path in ("pyproject.toml", "README.md", "prep_service/service.py", "protos/slotwise/v1/x"):
        assert not dockerignore_excludes(path, patterns), path
