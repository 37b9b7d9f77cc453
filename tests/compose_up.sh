#!/usr/bin/env bash
# The compose stack for real, on this machine: stand-in base images, the CPU images built, prep,
# infer, nginx and the gateway started on the tiny models, every health check passing, a
# session of image turns through nginx (the Python client) and a chat through the HTTP edge
# (the openai client), infer scaled to 2, the replica holding the session killed and the
# session going on, then everything torn down and what was built removed.
#
#   sudo tests/compose_up.sh   # exit 0: passed; 77: skipped (not root, or no Docker engine
#                              # can start here); anything else: failed
#
# What it needs and makes, where nothing is there:
# - a Docker engine: Debian's docker.io (installed with apt if missing),
#   `dockerd --storage-driver vfs --iptables=false` started for the run, with its data in the
#   run's temporary folder, and stopped after (nothing of it stays);
# - Docker Compose >= 2.24 (compose.cpu.yaml's !override): the plugin of Debian trixie's
#   docker-compose package (Debian bookworm ships compose 1.29), fetched with apt from
#   Debian's archive and used from a private DOCKER_CONFIG;
# - base images, since Docker Hub is not reachable: Debian bookworm by debootstrap (python3,
#   with the host's CA store) for python:3.11-slim-bookworm, and nginx-light on it
#   (tests/compose/nginx.Dockerfile) for nginx:1.28-alpine;
# - llama-cpp-python's wheel from pip's cache on this host (built by the install, for this
#   CPU) in docker/wheels/, so that a build takes minutes, not a compile of llama.cpp.
# System-wide it may install docker.io and debootstrap; the rest goes when it ends. Times and
# image sizes are printed at the end. KEEP_BASES=1 keeps the stand-in bases it made (on an
# engine that was already running).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d /tmp/slotwise-compose.XXXXXX)
PROJECT=slotwise-up-$$
STANDIN=slotwise-standin
TAG=up-$$
NET_TIMEOUT=900  # seconds for one step that downloads (apt, debootstrap, a build)
started=$(date +%s)
log() { printf '[compose_up %s] %s\n' "$(date +%T)" "$*" >&2; }
skip() { log "SKIP: $*"; exit 77; }
fail() { log "FAILED: $*"; exit 1; }
since() { echo $(( $(date +%s) - $1 )); }
apt_install() {
  timeout "$NET_TIMEOUT" apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive timeout "$NET_TIMEOUT" apt-get install -y -qq "$@" >/dev/null
}

DOCKERD_PID= COMPOSE_READY= WHEEL= MADE_BASES=
cleanup() {
  local rc=$?
  trap '' INT TERM  # a second Ctrl-C must not leave the stack up
  set +e
  if [ -n "$COMPOSE_READY" ]; then
    [ "$rc" = 0 ] || compose logs --no-color --tail 60 >&2
    log "tearing down"
    timeout 300 "${COMPOSE[@]}" --profile client down --volumes --remove-orphans >/dev/null 2>&1
  fi
  docker rmi "slotwise/prep:$TAG" "slotwise/infer:$TAG-cpu" >/dev/null 2>&1
  [ -n "$WHEEL" ] && rm -f "$ROOT/docker/wheels/$WHEEL"
  if [ -n "$MADE_BASES" ] && [ -z "${KEEP_BASES:-}" ] && [ -z "$DOCKERD_PID" ]; then
    docker rmi -f $MADE_BASES >/dev/null 2>&1
  fi
  if [ -n "$DOCKERD_PID" ]; then  # our own engine: it goes, and its data with $WORK
    kill "$DOCKERD_PID" 2>/dev/null
    timeout 60 tail --pid="$DOCKERD_PID" -f /dev/null || kill -9 "$DOCKERD_PID" 2>/dev/null
  fi
  # (what a killed engine may leave mounted under its data, e.g. a container's shm)
  awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
  rm -rf --one-file-system "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- a Docker engine -----------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || skip "no Docker engine answers, and starting one needs root"
  if ! command -v dockerd >/dev/null 2>&1; then
    # the package must not start a daemon of its own (overlay2, iptables) beside ours
    policy=/usr/sbin/policy-rc.d
    [ -e "$policy" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; made_policy=1; }
    apt_install docker.io || { [ -n "${made_policy:-}" ] && rm -f "$policy"; skip "docker.io could not be installed"; }
    [ -n "${made_policy:-}" ] && rm -f "$policy"
  fi
  if ! docker info >/dev/null 2>&1; then
    # an engine of the run's own, all of its state in $WORK: nothing of it outlives the run
    export DOCKER_HOST="unix://$WORK/docker.sock"
    dockerd --storage-driver vfs --iptables=false --data-root "$WORK/docker-data" \
      -H "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
      docker info >/dev/null 2>&1 && break
      kill -0 "$DOCKERD_PID" 2>/dev/null || break
      sleep 1
    done
    docker info >/dev/null 2>&1 \
      || skip "dockerd cannot start here: $(tail -3 "$WORK/dockerd.log" | tr '\n' ' ')"
    log "dockerd started (vfs, no iptables)"
  fi
fi

# -- Docker Compose >= 2.24 ------------------------------------------------------------------------
export DOCKER_CONFIG="$WORK/docker-config"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
[ -f "$HOME/.docker/config.json" ] && cp "$HOME/.docker/config.json" "$DOCKER_CONFIG/"
[ -d "$HOME/.docker/contexts" ] && cp -r "$HOME/.docker/contexts" "$DOCKER_CONFIG/"
new_enough() {  # compose's version is at least 2.24
  local v; v=$(docker compose version --short 2>/dev/null) || return 1
  printf '2.24\n%s\n' "${v#v}" | sort -CV
}
if ! new_enough; then
  apt_dir="$WORK/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
    >"$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
            -o APT::Sandbox::User=root)
  (cd "$apt_dir" && timeout "$NET_TIMEOUT" apt-get "${apt_opts[@]}" update -qq \
    && timeout "$NET_TIMEOUT" apt-get "${apt_opts[@]}" download -qq docker-compose) \
    || fail "Docker Compose v2 could not be fetched (Debian trixie's docker-compose)"
  dpkg-deb -x "$apt_dir"/docker-compose_*.deb "$apt_dir/root"
  cp "$apt_dir/root/usr/libexec/docker/cli-plugins/docker-compose" "$DOCKER_CONFIG/cli-plugins/"
  new_enough || fail "Debian's docker-compose is older than 2.24"
fi
log "Docker Compose $(docker compose version --short)"
: >"$WORK/empty.env"  # a .env in the checkout must not change the test stack
COMPOSE=(docker compose -p "$PROJECT" --env-file "$WORK/empty.env"
         -f compose.yaml -f compose.cpu.yaml -f "$WORK/standin.yaml")
compose() { "${COMPOSE[@]}" "$@"; }

# -- stand-in base images ------------------------------------------------------------------------
t=$(date +%s)
if ! docker image inspect "$STANDIN/python:bookworm" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap || fail "no debootstrap"
  timeout "$NET_TIMEOUT" debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
    || fail "debootstrap: $(tail -5 "$WORK/debootstrap.log" | tr '\n' ' ')"
  # pip in the images trusts PyPI with the host's CA store (a proxy's CA, where there is one)
  ca=/etc/ssl/certs/ca-certificates.crt
  [ -f "$ca" ] && cp "$ca" "$WORK/rootfs$ca"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | docker import \
    --change "ENV PIP_CERT=$ca" --change 'CMD ["python3"]' - "$STANDIN/python:bookworm" >/dev/null
  MADE_BASES="$STANDIN/python:bookworm"
  rm -rf --one-file-system "$WORK/rootfs"
fi
if ! docker image inspect "$STANDIN/nginx:bookworm" >/dev/null 2>&1; then
  timeout "$NET_TIMEOUT" docker build -q --network host -f tests/compose/nginx.Dockerfile \
    --build-arg "BASE_IMAGE=$STANDIN/python:bookworm" -t "$STANDIN/nginx:bookworm" tests/compose >/dev/null
  MADE_BASES="$MADE_BASES $STANDIN/nginx:bookworm"
fi
bases_s=$(since "$t")
log "stand-in bases ready (${bases_s} s)"

# -- models, the wheel, the settings ---------------------------------------------------------------
pair=$("$PY" -m slotwise_core.tiny_models "$WORK/tiny" --only mrope)  # "mrope: model=M mmproj=P"
model=${pair#*model=}; model=${model%% mmproj=*}
mkdir -p "$WORK/models"
cp "$model" "$WORK/models/model.gguf"
cp "${pair##*mmproj=}" "$WORK/models/mmproj.gguf"
chmod a+rx "$WORK" && chmod -R a+rX "$WORK/models"  # the services run as uid 10001
found=$(find "${PIP_CACHE_DIR:-$HOME/.cache/pip}" -name 'llama_cpp_python-0.3.36-*.whl' 2>/dev/null | head -1 || true)
if [ -n "$found" ] && [ ! -e "docker/wheels/$(basename "$found")" ]; then
  WHEEL=$(basename "$found")
  cp "$found" docker/wheels/
  log "reusing $WHEEL (pip's, built on this host)"
elif [ -z "$found" ]; then
  log "no llama-cpp-python wheel in pip's cache: the images compile llama.cpp (slow)"
fi
read -r prep_port infer_port http_port < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export SLOTWISE_PYTHON_IMAGE="$STANDIN/python:bookworm" SLOTWISE_NGINX_IMAGE="$STANDIN/nginx:bookworm"
export SLOTWISE_MODELS_DIR="$WORK/models" SLOTWISE_TAG="$TAG" SLOTWISE_CTX_SIZE=2048
export SLOTWISE_PARALLEL=2 SLOTWISE_PREP_THREADS=1 SLOTWISE_GPU_LAYERS=0
export SLOTWISE_PREP_PORT=$prep_port SLOTWISE_INFER_PORT=$infer_port SLOTWISE_HTTP_PORT=$http_port
cat >"$WORK/standin.yaml" <<'EOF'
# builds reach PyPI through the host's network (the engine runs without iptables)
services:
  prep: {build: {network: host}}
  infer: {build: {network: host}}
  client: {build: {network: host}}
EOF
PREP=127.0.0.1:$prep_port INFER=127.0.0.1:$infer_port HTTP=http://127.0.0.1:$http_port
turns() { "$PY" tests/compose/check.py turns "$PREP" "$INFER" harbour "$1"; }

# -- build and start -----------------------------------------------------------------------------
COMPOSE_READY=1
t=$(date +%s)
timeout "$NET_TIMEOUT" "${COMPOSE[@]}" build
build_s=$(since "$t")
log "images built (${build_s} s)"
t=$(date +%s)
compose up -d --wait --wait-timeout 600
up_s=$(since "$t")
compose ps
log "every service healthy (${up_s} s)"

# -- through nginx: a session of image turns; through the HTTP edge: a chat ------------------------
[ "$(turns 3)" = 3 ] || fail "the session's first turns"
"$PY" tests/compose/check.py chat "$HTTP"
compose run --rm -T client info </dev/null >/dev/null  # the CLI in the image, through nginx

# -- two replicas; the one that served the session's last turn killed; the session goes on ----------
compose up -d --wait --wait-timeout 600 --scale infer=2 --no-recreate
compose restart nginx  # nginx reads the replicas when it starts (compose.yaml's header)
compose up -d --wait --wait-timeout 120 --scale infer=2 --no-recreate
replicas=$(compose ps -q infer)
[ "$(echo "$replicas" | wc -l)" = 2 ] || fail "infer did not scale to 2"
served() { docker logs "$1" 2>&1 | grep -c "session=harbour status=OK" || true; }
declare -A before
for id in $replicas; do before[$id]=$(served "$id"); done
[ "$(turns 1)" = 4 ] || fail "the session's 4th turn"
holder=
for _ in $(seq 50); do  # the access-log line is written as the call ends: wait for it
  for id in $replicas; do
    if [ "$(served "$id")" -gt "${before[$id]}" ]; then holder=$id; fi
  done
  [ -n "$holder" ] && break
  sleep 0.2
done
[ -n "$holder" ] || fail "no replica logged the session's 4th turn"
survivor=$(echo "$replicas" | grep -v "$holder")
moved=$([ "${before[$holder]}" = 0 ] && echo "moved to the new replica" || echo "stayed on its replica")
log "killing infer replica ${holder:0:12}, which served turn 4 (the session $moved)"
docker kill "$holder" >/dev/null
[ "$(docker inspect -f '{{.State.Running}}' "$holder")" = false ] || fail "the replica still runs"
survived=$(served "$survivor")
[ "$(turns 2)" = 6 ] || fail "the session after the kill"
for _ in $(seq 50); do [ "$(served "$survivor")" -ge $((survived + 2)) ] && break; sleep 0.2; done
[ "$(served "$survivor")" -ge $((survived + 2)) ] || fail "turns 5 and 6 were not the survivor's"
log "the session went on on the other replica (6 turns, none lost)"

# -- figures ---------------------------------------------------------------------------------------
size() { docker image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.0f MB", $1 / 1e6 }'; }
log "passed in $(since "$started") s: bases ${bases_s} s, build ${build_s} s, up ${up_s} s;" \
    "slotwise/prep:$TAG $(size "slotwise/prep:$TAG"), slotwise/infer:$TAG-cpu $(size "slotwise/infer:$TAG-cpu")"
