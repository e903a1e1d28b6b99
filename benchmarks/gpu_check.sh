#!/usr/bin/env bash
# The GPU device check, in one run: CUDA kernels and KV transfer tests, a disaggregated stack on the GPU giving
# the same greedy text as the CPU engine, then a served benchmark. Results land in $OUT (default ./gpu-check).
#
#   benchmarks/gpu_wheels.sh                 # here, once: wheels the GPU machine lacks, into .whl/
#   benchmarks/gpu_check.sh                  # there (carry .whl); DEVICE=cpu runs the same steps on CPU (dry run)
#
# Every step runs even if an earlier one failed; the exit status says whether all passed.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$PWD/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 UCX_WARN_UNUSED_ENV_VARS=n
status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }
fail() { echo "FAILED: $*" | tee -a "$OUT/summary.txt"; status=1; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    step "installing carried wheels"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || fail "wheel install"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
PDSERVE="$PY -m cli"

step "device"
{ nvidia-smi 2>/dev/null || echo "no nvidia-smi"; $PY -c "import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0))"; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt" | tail -3

step "tests: CUDA kernels, backends, engine parity and the KV transfer in device memory"
timeout 900 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_kvtransfer.py \
    -k "cuda or bit_exact" > "$OUT/pytest.txt" 2>&1 || fail "pytest (see pytest.txt)"
tail -3 "$OUT/pytest.txt"

port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
G=$(port); P=$(port); D=$(port)
step "disaggregated stack on $DEVICE (prefill + decode sharing it), fp32 greedy against the CPU engine"
$PDSERVE --log-level WARNING up --device "$DEVICE" --dtype float32 --port "$G" --prefill-port "$P" \
    --decode-port "$D" --metrics-port -1 --http-port -1 --kv-cache-memory 1G --local-prefill-max-tokens 0 \
    > "$OUT/up-fp32.log" 2>&1 &
UP=$!
for _ in $(seq 1 300); do grep -q "^serving" "$OUT/up-fp32.log" && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
for prompt in "The capital of France is" "Write a haiku about the sea." "def fibonacci(n):"; do
    served=$($PDSERVE generate --address "127.0.0.1:$G" --raw --max-tokens 32 --temperature 0 "$prompt" 2>>"$OUT/errors.txt")
    local_cpu=$($PDSERVE generate --local --device cpu --dtype float32 --raw --max-tokens 32 --temperature 0 \
        "$prompt" 2>>"$OUT/errors.txt")
    if [ -n "$served" ] && [ "$served" = "$local_cpu" ]; then echo "same text: $prompt"; else
        fail "text differs for '$prompt': served '$served' vs cpu '$local_cpu'"; fi
done | tee -a "$OUT/summary.txt"
kill -TERM $UP; wait $UP

step "served benchmark on $DEVICE, bf16, 128 in / 128 out, disaggregated and colocated"
for mode in disagg colocated; do
    G=$(port); P=$(port); D=$(port)
    extra=(); [ "$mode" = colocated ] && extra=(--colocated)
    $PDSERVE --log-level WARNING up --device "$DEVICE" --dtype bfloat16 --port "$G" --prefill-port "$P" \
        --decode-port "$D" --metrics-port -1 --http-port -1 --kv-cache-memory 8G --max-num-seqs 256 "${extra[@]}" \
        > "$OUT/up-$mode.log" 2>&1 &
    UP=$!
    for _ in $(seq 1 300); do grep -q "^serving" "$OUT/up-$mode.log" && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
    for c in 1 8 32 128; do
        n=$(( c == 1 ? 8 : 4 * c ))
        $PDSERVE bench --address "127.0.0.1:$G" --num-requests $n --max-concurrency $c --input-len 128 \
            --output-len 128 --num-warmups 2 --label "$DEVICE $mode c=$c" --result-json "$OUT/bench.jsonl" \
            > "$OUT/bench-$mode-$c.txt" 2>&1 || fail "bench $mode c=$c"
        grep -E "Output token throughput|Median TTFT|Median ITL" "$OUT/bench-$mode-$c.txt" | tr -s ' ' \
            | paste -sd ';' | sed "s/^/$mode c=$c: /" | tee -a "$OUT/summary.txt"
    done
    kill -TERM $UP; wait $UP
done

step "done: status $status"
exit $status
