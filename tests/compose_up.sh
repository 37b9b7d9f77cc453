#!/usr/bin/env bash
# The compose stack for real, on this machine: stand-in base images, the CPU images built, prep,
# infer, nginx and the gateway started on the tiny models, every health check passing, a
# session of image turns through nginx (the Python client) and a chat through the HTTP edge
# (the openai client), infer scaled to 2, the replica holding the session killed and the
# session going on, then everything torn down and what was built removed.
#
#   sudo tests/compose_up.sh          # exit 0: passed; 77: skipped (no Docker engine here)
#
# What it needs and makes, where nothing is there:
# - a Docker engine: Debian's docker.io, `dockerd --storage-driver vfs --iptables=false`
#   started for the run (and stopped after) when none answers;
# - Docker Compose >= 2.24 (compose.cpu.yaml's !override): the plugin of Debian trixie's
#   docker-compose package (Debian bookworm ships compose 1.29), fetched with apt from
#   Debian's archive and used from a private DOCKER_CONFIG, installing nothing system-wide;
# - base images, since Docker Hub is not reachable: Debian bookworm by debootstrap (python3,
#   with the host's CA store) for python:3.11-slim-bookworm, and nginx-light on it
#   (tests/compose/nginx.Dockerfile) for nginx:1.28-alpine;
# - llama-cpp-python's wheel from pip's cache on this host (built once by the install) in
#   docker/wheels/, so that a build takes minutes, not a compile of llama.cpp.
# Times and image sizes are printed at the end. KEEP_BASES=1 keeps the stand-in bases.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d /tmp/slotwise-compose.XXXXXX)
PROJECT=slotwise-up-$$
STANDIN=slotwise-standin
TAG=up-$$
started=$(date +%s)
log() { printf '[compose_up %s] %s\n' "$(date +%T)" "$*" >&2; }
skip() { log "SKIP: $*"; exit 77; }
since() { echo $(( $(date +%s) - $1 )); }

DOCKERD_PID=
cleanup() {
  local rc=$?
  set +e
  if [ -n "${COMPOSE_READY:-}" ]; then
    [ "$rc" = 0 ] || compose logs --no-color --tail 60 >&2
    log "tearing down"
    compose --profile client down --volumes --remove-orphans >/dev/null 2>&1
    docker rmi "slotwise/prep:$TAG" "slotwise/infer:$TAG-cpu" >/dev/null 2>&1
  fi
  rm -f "$ROOT"/docker/wheels/*.whl
  if [ -z "${KEEP_BASES:-}" ]; then
    docker rmi -f "$STANDIN/python:bookworm" "$STANDIN/nginx:bookworm" >/dev/null 2>&1
    docker builder prune -af >/dev/null 2>&1
  fi
  if [ -n "$DOCKERD_PID" ]; then kill "$DOCKERD_PID"; wait "$DOCKERD_PID" 2>/dev/null; fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

# -- a Docker engine -----------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || skip "no Docker engine answers, and starting one needs root"
  if ! command -v dockerd >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; } \
      || skip "docker.io could not be installed"
  fi
  dockerd --storage-driver vfs --iptables=false >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || skip "dockerd did not start: $(tail -3 "$WORK/dockerd.log" | tr '\n' ' ')"
  log "dockerd started (vfs, no iptables)"
fi

# -- Docker Compose v2 ---------------------------------------------------------------------------
export DOCKER_CONFIG="$WORK/docker-config"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
if ! docker compose version >/dev/null 2>&1; then
  apt_dir="$WORK/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
    >"$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
            -o APT::Sandbox::User=root)
  (cd "$apt_dir" && apt-get "${apt_opts[@]}" update -qq && apt-get "${apt_opts[@]}" download -qq docker-compose) \
    || skip "Docker Compose v2 could not be fetched (Debian trixie's docker-compose)"
  dpkg-deb -x "$apt_dir"/docker-compose_*.deb "$apt_dir/root"
  cp "$apt_dir/root/usr/libexec/docker/cli-plugins/docker-compose" "$DOCKER_CONFIG/cli-plugins/"
fi
version=$(docker compose version --short)
log "Docker Compose $version"
compose() {
  docker compose -p "$PROJECT" -f compose.yaml -f compose.cpu.yaml -f "$WORK/standin.yaml" "$@"
}

# -- stand-in base images ------------------------------------------------------------------------
t=$(date +%s)
if ! docker image inspect "$STANDIN/python:bookworm" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null || skip "no debootstrap"; }
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1
  cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | docker import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
    - "$STANDIN/python:bookworm" >/dev/null
  rm -rf "$WORK/rootfs"
fi
if ! docker image inspect "$STANDIN/nginx:bookworm" >/dev/null 2>&1; then
  docker build -q --network host -f tests/compose/nginx.Dockerfile \
    --build-arg "BASE_IMAGE=$STANDIN/python:bookworm" -t "$STANDIN/nginx:bookworm" tests/compose >/dev/null
fi
bases_s=$(since "$t")
log "stand-in bases ready (${bases_s} s)"

# -- models, the wheel, the settings ---------------------------------------------------------------
pair=$("$PY" -m slotwise_core.tiny_models "$WORK/tiny" --only mrope)  # "mrope: model=M mmproj=P"
model=${pair#*model=}; model=${model%% mmproj=*}
mkdir -p "$WORK/models"
cp "$model" "$WORK/models/model.gguf"
cp "${pair##*mmproj=}" "$WORK/models/mmproj.gguf"
chmod -R a+rX "$WORK"
wheel=$(find "${PIP_CACHE_DIR:-$HOME/.cache/pip}" -name 'llama_cpp_python-0.3.36-*.whl' 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
  cp "$wheel" docker/wheels/
  log "reusing $(basename "$wheel")"
else
  log "no llama-cpp-python wheel in pip's cache: the images compile llama.cpp (slow)"
fi
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export SLOTWISE_PYTHON_IMAGE="$STANDIN/python:bookworm" SLOTWISE_NGINX_IMAGE="$STANDIN/nginx:bookworm"
export SLOTWISE_MODELS_DIR="$WORK/models" SLOTWISE_TAG="$TAG" SLOTWISE_CTX_SIZE=2048
export SLOTWISE_PARALLEL=2 SLOTWISE_PREP_THREADS=1 SLOTWISE_GPU_LAYERS=0
SLOTWISE_PREP_PORT=$(free_port); SLOTWISE_INFER_PORT=$(free_port); SLOTWISE_HTTP_PORT=$(free_port)
export SLOTWISE_PREP_PORT SLOTWISE_INFER_PORT SLOTWISE_HTTP_PORT
cat >"$WORK/standin.yaml" <<'EOF'
# builds reach PyPI through the host's network (the engine runs without iptables)
services:
  prep: {build: {network: host}}
  infer: {build: {network: host}}
  client: {build: {network: host}}
EOF
PREP=127.0.0.1:$SLOTWISE_PREP_PORT INFER=127.0.0.1:$SLOTWISE_INFER_PORT HTTP=http://127.0.0.1:$SLOTWISE_HTTP_PORT

# -- build and start -----------------------------------------------------------------------------
t=$(date +%s)
compose build
build_s=$(since "$t")
log "images built (${build_s} s)"
COMPOSE_READY=1
t=$(date +%s)
compose up -d --wait --wait-timeout 600
up_s=$(since "$t")
compose ps
log "every service healthy (${up_s} s)"

# -- through nginx: a session of image turns; through the HTTP edge: a chat ------------------------
[ "$("$PY" tests/compose/check.py turns "$PREP" "$INFER" harbour 3)" = 3 ]
"$PY" tests/compose/check.py chat "$HTTP"
compose run --rm client info >/dev/null  # the CLI in the image, through nginx

# -- two replicas; the one that holds the session killed; the session goes on ---------------------
compose up -d --wait --wait-timeout 600 --scale infer=2 --no-recreate
compose restart nginx  # nginx reads the replicas when it starts (compose.yaml's header)
compose up -d --wait --wait-timeout 120 --scale infer=2 --no-recreate
[ "$(compose ps -q infer | wc -l)" = 2 ]
served() { docker logs "$1" 2>&1 | grep -c "session=harbour status=OK" || true; }
declare -A before
for id in $(compose ps -q infer); do before[$id]=$(served "$id"); done
[ "$("$PY" tests/compose/check.py turns "$PREP" "$INFER" harbour 1)" = 4 ]
holder=
for id in $(compose ps -q infer); do
  [ "$(served "$id")" -gt "${before[$id]}" ] && holder=$id  # the replica that served turn 4
done
[ -n "$holder" ] || { log "no replica logged the session's 4th turn"; exit 1; }
log "killing infer replica ${holder:0:12}, which served the session"
docker kill "$holder" >/dev/null
[ "$("$PY" tests/compose/check.py turns "$PREP" "$INFER" harbour 2)" = 6 ]
log "the session went on on the other replica (6 turns, none lost)"

# -- figures ---------------------------------------------------------------------------------------
size() { docker image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.0f MB", $1 / 1e6 }'; }
log "passed in $(since "$started") s: bases ${bases_s} s, build ${build_s} s, up ${up_s} s;" \
    "slotwise/prep:$TAG $(size "slotwise/prep:$TAG"), slotwise/infer:$TAG-cpu $(size "slotwise/infer:$TAG-cpu")"
