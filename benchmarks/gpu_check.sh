#!/usr/bin/env bash
# The GPU device check, in one run (a few minutes on one H200). Writes $OUT/summary.json (default ./gpu-check):
#   1. the CUDA tests, with compiled Triton kernels (the run fails if TRITON_INTERPRET is set);
#   2. the engine's greedy tokens against transformers on the device: fp32 (Triton backend) exact, bf16 reported;
#   3. a disaggregated stack, prefill and decode as two processes on the same device: 16 concurrent requests
#      token-exact against transformers fp32;
#   4. decode throughput, engine vs transformers.generate, batch 1 / 64 / 256;
#   5. the served stack under load (pdserve bench), disaggregated and colocated.
#
#   benchmarks/gpu_wheels.sh           # here, once: the wheels the GPU machine lacks, into .whl/
#   benchmarks/gpu_check.sh            # there, carrying .whl (installs them; downloads nothing)
#   DEVICE=cpu QUICK=1 benchmarks/gpu_check.sh    # the same steps on CPU, small (tests/test_gpu_check.py runs it)
#
# Every step runs even if an earlier one failed; the exit status says whether all passed.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-}
OUT=${OUT:-$PWD/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/steps.jsonl"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 UCX_WARN_UNUSED_ENV_VARS=n
status=0
record() {  # name, ok (0/1), detail file or text
    $PY -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "ok": sys.argv[2] == "0", "detail": sys.argv[3]}))' \
        "$1" "$2" "$3" >> "$OUT/steps.jsonl"
    [ "$2" = 0 ] || status=1
    echo "== $1: $([ "$2" = 0 ] && echo ok || echo FAILED)"
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    record wheels $? "$(ls .whl | wc -l) wheels"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PDSERVE=($PY -m pdserve.cli)
# the model: the built-in one where it is installed, else a random-weight twin of it (see gpu_wheels.sh)
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
    if $PY -c "from pdserve.engine.model_store import resolve_model; resolve_model(None)" >/dev/null 2>&1; then MODEL=default
    elif [ -d .whl/model ]; then MODEL=$($PY -m pdserve.benchmarks.random_model .whl/model /tmp/pdserve-check-model | tail -1)
    fi
fi
KVT=ucx; $PY -c "import ucxx" >/dev/null 2>&1 || KVT=tcp
record setup $([ -n "$MODEL" ]; echo $?) "model ${MODEL:-none}, KV transport $KVT"
KV=8G; KV_BYTES=$((8 << 30)); [ -n "$QUICK" ] && { KV=512M; KV_BYTES=$((512 << 20)); }
port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
wait_up() { for _ in $(seq 1 300); do grep -q "^serving" "$1" && return 0; kill -0 "$2" 2>/dev/null || return 1; sleep 1; done; return 1; }

{ nvidia-smi 2>/dev/null | head -15; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0))"; } > "$OUT/device.txt" 2>&1
record device 0 "$(tail -1 "$OUT/device.txt")"

# 1. tests (compiled kernels: conftest leaves TRITON_INTERPRET unset where CUDA is present)
if [ "$DEVICE" != cpu ] && [ "${TRITON_INTERPRET:-}" = 1 ]; then record compiled-kernels 1 "TRITON_INTERPRET=1 is set"; fi
tests=(tests/test_kernels_cuda.py tests/test_kvtransfer.py -k "cuda or bit_exact")
[ -n "$QUICK" ] && tests=(tests/test_kernels_cuda.py)  # the dry run: the CPU suite runs the rest anyway
timeout 600 $PY -m pytest -q -p no:cacheprovider "${tests[@]}" > "$OUT/pytest.txt" 2>&1
record tests $? "$(tail -1 "$OUT/pytest.txt")"

# 2. engine against transformers on the device
backend=triton; [ "$DEVICE" = cpu ] && backend=torch
n=8; [ -n "$QUICK" ] && n=2
timeout 600 $PY -m pdserve.benchmarks.device_parity --model "$MODEL" --device "$DEVICE" --dtype float32 --backend "$backend" --requests $n \
    > "$OUT/parity-fp32.json" 2>"$OUT/parity-fp32.err"
record engine-fp32-exact $? "$(cat "$OUT/parity-fp32.json")"
if [ -z "$QUICK" ]; then
    timeout 600 $PY -m pdserve.benchmarks.device_parity --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --requests $n \
        > "$OUT/parity-bf16.json" 2>"$OUT/parity-bf16.err"
    record engine-bf16 0 "$(cat "$OUT/parity-bf16.json")"
fi

# 3. a disaggregated stack on the device: 16 concurrent requests token-exact
G=$(port); P=$(port); D=$(port)
"${PDSERVE[@]}" --log-level WARNING up --model "$MODEL" --kv-transport $KVT --device "$DEVICE" --dtype float32 --port "$G" --prefill-port "$P" \
    --decode-port "$D" --metrics-port -1 --http-port -1 --kv-cache-memory 1G --local-prefill-max-tokens 0 \
    > "$OUT/up-fp32.log" 2>&1 &
UP=$!
if wait_up "$OUT/up-fp32.log" $UP; then
    n=16; [ -n "$QUICK" ] && n=4
    timeout 600 $PY -m pdserve.benchmarks.device_parity --model "$MODEL" --device "$DEVICE" --dtype float32 --served "127.0.0.1:$G" \
        --requests $n > "$OUT/parity-served.json" 2>"$OUT/parity-served.err"
    record disaggregated-exact $? "$(cat "$OUT/parity-served.json")"
else
    record disaggregated-exact 1 "the stack did not start: $(tail -3 "$OUT/up-fp32.log")"
fi
kill -TERM $UP; wait $UP

# 4. decode throughput against transformers.generate
batches=(1 64 256); [ -n "$QUICK" ] && batches=(1 4)
out=128; [ -n "$QUICK" ] && out=8
timeout 900 $PY -m pdserve.benchmarks.engine_throughput --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --batches "${batches[@]}" \
    --output-len $out --repeats 1 --kv-cache-memory $KV_BYTES --json "$OUT/engine.json" > "$OUT/engine.txt" 2>&1
record engine-throughput $? "$(tail -${#batches[@]} "$OUT/engine.txt" | tr -s ' ' | paste -sd ';')"

# 5. served, under load
levels=(1 8 32 128); modes=(disagg colocated)
[ -n "$QUICK" ] && { levels=(2); modes=(disagg); }
for mode in "${modes[@]}"; do
    G=$(port); P=$(port); D=$(port)
    extra=(); [ "$mode" = colocated ] && extra=(--colocated)
    "${PDSERVE[@]}" --log-level WARNING up --model "$MODEL" --kv-transport $KVT --device "$DEVICE" --dtype bfloat16 --port "$G" --prefill-port "$P" \
        --decode-port "$D" --metrics-port -1 --http-port -1 --kv-cache-memory $KV --max-num-seqs 256 "${extra[@]}" \
        > "$OUT/up-$mode.log" 2>&1 &
    UP=$!
    if wait_up "$OUT/up-$mode.log" $UP; then
        for c in "${levels[@]}"; do
            reqs=$(( c == 1 ? 4 : 2 * c )); len=$out
            "${PDSERVE[@]}" bench --address "127.0.0.1:$G" --num-requests $reqs --max-concurrency "$c" --input-len 128 \
                --output-len $len --num-warmups 1 --label "$DEVICE $mode c=$c" --result-json "$OUT/bench.jsonl" \
                > "$OUT/bench-$mode-$c.txt" 2>&1
            record "served-$mode-c$c" $? "$(grep -E 'Output token throughput|Median ITL' "$OUT/bench-$mode-$c.txt" \
                | tr -s ' ' | paste -sd ';')"
        done
    else
        record "served-$mode" 1 "the stack did not start: $(tail -3 "$OUT/up-$mode.log")"
    fi
    kill -TERM $UP; wait $UP
done

$PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
bench = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()] if (out / "bench.jsonl").exists() else []
engine = json.loads((out / "engine.json").read_text()) if (out / "engine.json").exists() else None
summary = {"ok": all(s["ok"] for s in steps), "steps": steps, "engine_throughput": engine,
           "served": [{k: b.get(k) for k in ("label", "output_throughput", "ttft_ms", "itl_ms", "failed")} for b in bench]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({"ok": summary["ok"], "failed_steps": [s["step"] for s in steps if not s["ok"]]}))
PY
exit $status
