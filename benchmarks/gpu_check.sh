#!/usr/bin/env bash
# The GPU checks in one run, for a machine with one CUDA GPU, torch, Triton, transformers and pytest but no
# network and no Ray (nothing is installed: the checkout runs in place with the machine's python3), in
# three parts, the quickest to fail first:
#   1. kernels: the compiled Triton kernels and the torch backend's attention against the naive reference
#      (tests/gpu/test_triton_cuda.py, test_cuda.py's kernel test);
#   2. tests: the rest of the `gpu` tests (the engine on CUDA against transformers, deterministic mode, CUDA
#      graphs against eager steps, the warm-up leaving nothing to compile, the one-synchronisation step, KV
#      sizing);
#   3. bench: `kvserve bench-gpu` (python -m benchmarks.gpu_bench) on the llama `1b` preset, bf16, at a size
#      that fits its limit (BENCH_ARGS replaces it).
# Logs and docs/bench-style JSON go to $OUT (default /tmp/kvserve-gpu); $OUT/device.txt has the versions,
# the device, and each part's exit status and seconds. Exits non-zero if any part fails.
#   PARTS="kernels tests bench" (default all three)
#   KERNELS_TIMEOUT / TESTS_TIMEOUT / BENCH_TIMEOUT: seconds for each part, 140 + 140 + 240 = 520 by default:
#     with the device probe, within 10 minutes of a 15-minute device budget (a cold Triton cache compiles
#     the kernel tests' ~120 variants and each engine's warm-up its ~10-20, about a second each)
#   BENCH_ARGS: the bench's arguments (default below; e.g. "--batches 1 64 --no-graphs")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve-gpu}
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-kernels tests bench}
BENCH_ARGS=${BENCH_ARGS:---batches 1 8 64 --decode-steps 16 --prefill-prompts 8 --shared-requests 32 --hf-batch 16 \
--agreement-prompts 8 --agreement-len 16}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET
"$PYTHON" - <<'EOF' 2>&1 | tee "$OUT/device.txt"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none: these checks need CUDA")
EOF
rc=0

# part NAME LIMIT LOG COMMAND...: run it under its limit, its output in $OUT/LOG; its status and time in device.txt
part() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
  local status=${PIPESTATUS[0]}
  echo "$name: exit $status in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/device.txt"
  if (( status )); then rc=1; fi
}

PYTEST=("$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -x --durations=15)
if [[ " $PARTS " == *" kernels "* ]]; then
  part "gpu kernels" "${KERNELS_TIMEOUT:-140}" gpu_kernels.log \
    "${PYTEST[@]}" tests/gpu/test_triton_cuda.py tests/gpu/test_cuda.py::test_paged_attention_on_cuda
fi
if [[ " $PARTS " == *" tests "* ]]; then
  part "gpu tests" "${TESTS_TIMEOUT:-140}" gpu_tests.log \
    "${PYTEST[@]}" tests/gpu --deselect tests/gpu/test_cuda.py::test_paged_attention_on_cuda \
    --ignore tests/gpu/test_triton_cuda.py
fi
if [[ " $PARTS " == *" bench "* ]]; then
  # shellcheck disable=SC2086
  part "bench-gpu" "${BENCH_TIMEOUT:-240}" gpu_bench.log "$PYTHON" -m benchmarks.gpu_bench --out "$OUT/gpu.json" \
    $BENCH_ARGS
fi
echo "total: $SECONDS s" | tee -a "$OUT/device.txt"
exit $rc
