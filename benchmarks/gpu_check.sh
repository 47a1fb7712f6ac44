#!/usr/bin/env bash
# The GPU checks in one run, for a machine with one CUDA GPU, torch, Triton, transformers and pytest but no
# network and no Ray (nothing is installed: the checkout runs in place with the machine's python3):
#   1. the `gpu` tests (tests/gpu: compiled Triton kernels, the engine on CUDA against transformers, CUDA
#      graphs against eager steps, the one-synchronisation step, KV sizing);
#   2. `kvserve bench-gpu` (python -m benchmarks.gpu_bench) on the llama `1b` preset, bf16.
# Logs and docs/bench-style JSON go to $OUT (default /tmp/kvserve-gpu). Exits non-zero if either part fails.
#   PARTS="tests bench" (default both)   TESTS_TIMEOUT / BENCH_TIMEOUT: seconds for each part
#   BENCH_ARGS: extra arguments for the bench (e.g. "--batches 1 64 --no-graphs")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve-gpu}
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-tests bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
"$PYTHON" - <<'EOF' 2>&1 | tee "$OUT/device.txt"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none: these checks need CUDA")
EOF
rc=0
if [[ " $PARTS " == *" tests "* ]]; then
  timeout "${TESTS_TIMEOUT:-300}" "$PYTHON" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x --durations=15 \
    2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
  echo "gpu tests: exit $status" | tee -a "$OUT/device.txt"
  (( status )) && rc=1
fi
if [[ " $PARTS " == *" bench "* ]]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-480}" "$PYTHON" -m benchmarks.gpu_bench --out "$OUT/gpu.json" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/gpu_bench.log"
  status=${PIPESTATUS[0]}
  echo "bench-gpu: exit $status" | tee -a "$OUT/device.txt"
  (( status )) && rc=1
fi
exit $rc
