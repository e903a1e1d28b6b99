#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has torch, triton, transformers, numpy, grpcio's deps, aiohttp, uvloop),
# for its Python 3.12 on x86-64, into .whl/ at the repository root: carry `.whl` with benchmarks/gpu_check.sh.
# Versions are the ones this checkout installs here, so both machines run the same stack. What travels is capped
# (64 MiB with the repository), so the built-in model's wheel (93 MB) stays here: its config and tokenizer go to
# .whl/model and the check runs a random-weight twin of it. The UCX wheels (~55 MB) come only with WITH_UCX=1;
# without them the check moves KV over the TCP transport.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
pkgs=(grpcio grpcio-health-checking grpcio-reflection protobuf gguf
      opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp opentelemetry-exporter-otlp-proto-common
      opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http opentelemetry-proto
      opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-semantic-conventions
      googleapis-common-protos fastapi starlette pydantic pydantic-core annotated-types annotated-doc
      typing-inspection uvicorn h11 anyio sniffio pytest-asyncio)
[ -n "${WITH_UCX:-}" ] && pkgs+=(ucxx-cu13 libucxx-cu13 libucx-cu13 rmm-cu13 librmm-cu13)
pins=()
for p in "${pkgs[@]}"; do
    v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version:/ {print $2}')
    pins+=("$p${v:+==$v}")
done
plat=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do plat+=(--platform "manylinux_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"
python3 -c "from pdserve.engine.model_store import resolve_model; from pdserve.benchmarks.random_model import export_config; \
from pathlib import Path; export_config(resolve_model(None), Path('.whl/model'))"
du -sh .whl
