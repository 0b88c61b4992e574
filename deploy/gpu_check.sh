#!/usr/bin/env bash
# The CUDA tests, on a machine with an NVIDIA GPU, from the repo root: bash deploy/gpu_check.sh
#
# Installs the wheels in .whl/ (flashinfer-python, apache-tvm-ffi, gguf, redis: what the CUDA
# tests need beyond an image with torch, transformers, numpy, pytest) into /tmp/site, reports the
# machine, then runs the tests in order of priority, since each flashinfer kernel configuration
# is JIT-compiled with nvcc on first use (minutes per module):
#   1: tests/engine/test_cuda_engine.py (the engine on CUDA; flashinfer bf16, head_dim 64)
#   2: the bf16 flashinfer kernel tests and write_kv (pytest-xdist: their JIT builds overlap)
#   3: the rest of tests/kernels/test_flashinfer_backend.py (fp16 kernels, plans-once, CPU ones)
#   4: every model family on CUDA (tests/engine/test_cuda_families.py: torch and flashinfer
#      backends, sliding windows, per-layer RoPE, q/k norm, biases; head_dim 64)
# all inside GPU_CHECK_BUDGET_S seconds (default 450): a phase still running at its share is
# interrupted (its summary is kept) and a later phase with under 30 s left is skipped.
# Everything goes to $OUT/gpu_log.txt, with JUnit XML per phase beside it (OUT: /tmp/gpu_check).
set -uo pipefail

OUT=${OUT:-/tmp/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
mkdir -p "$OUT"

elapsed() { echo $((SECONDS - START)); }

jit_monitor() {  # every 30 s: elapsed time, compiler processes, JIT modules built so far
  while sleep 30 </dev/null >/dev/null 2>&1; do  # sleep must not hold tee's pipe open
    echo "[monitor t=$(elapsed)s] nvcc/cicc/ptxas running: $(pgrep -c 'nvcc|cicc|ptxas' || true);" \
      "JIT modules built: $(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)"
  done
}

# run_pytest PHASE SECONDS WORKERS JOBS ARGS...: pytest with WORKERS xdist workers (0: none),
# each JIT build running JOBS compilers; interrupted (summary kept) after SECONDS.
run_pytest() {
  local phase=$1 limit=$2 workers=$3 jobs=$4
  shift 4
  if ((limit < 30)); then
    echo "== phase $phase skipped: ${limit}s left of the ${BUDGET}s budget"
    return 0
  fi
  local xdist=()
  if ((workers > 0)) && python3 -c 'import xdist' 2>/dev/null; then xdist=(-n "$workers"); fi
  echo "== phase $phase (limit ${limit}s, t=$(elapsed)s, MAX_JOBS=$jobs ${xdist[*]}): $*"
  MAX_JOBS=$jobs timeout -s INT -k 20 "$limit" python3 -m pytest -p no:cacheprovider \
    --noconftest -v -rs --timeout "$((limit > 420 ? 420 : limit))" --durations=10 \
    "${xdist[@]}" --junitxml "$OUT/junit-phase$phase.xml" "$@"
  local rc=$?
  echo "== phase $phase exit $rc (t=$(elapsed)s)"
  return $rc
}

main() {
  START=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  # ninja (flashinfer's JIT driver) from the image's python, whether or not its bin is on PATH
  PATH="$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
  PATH="$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null || echo /nonexistent):$PATH"
  export PATH
  echo "== machine (t=$(elapsed)s)"
  nvidia-smi -L
  echo "nvcc: $(command -v nvcc || echo 'not on PATH')" \
    "$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*')"
  echo "ninja: $(command -v ninja || echo 'not on PATH'); cores: $(nproc)"
  python3 - <<'EOF' || { echo "import check failed"; return 1; }
import time
import torch, transformers
gpu = (f"{torch.cuda.get_device_name(0)} sm{torch.cuda.get_device_capability(0)}"
       if torch.cuda.is_available() else "NO CUDA DEVICE (the CUDA tests will skip)")
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", gpu,
      "| transformers", transformers.__version__)
t = time.time()
import flashinfer, tvm_ffi
print("flashinfer", flashinfer.__version__, "tvm_ffi", tvm_ffi.__version__,
      f"(import {time.time() - t:.1f}s)")
EOF

  jit_monitor & local monitor=$!
  local rc1 rc2 rc3 rc4
  run_pytest 1 "$((BUDGET - $(elapsed) - 120))" 0 "$(nproc)" tests/engine/test_cuda_engine.py
  rc1=$?
  run_pytest 2 "$((BUDGET - $(elapsed) - 60))" 3 6 -k "dtype1 or write_kv" \
    tests/kernels/test_flashinfer_backend.py
  rc2=$?
  run_pytest 3 "$((BUDGET - $(elapsed) - 90))" 6 4 -k "not (dtype1 or write_kv)" \
    tests/kernels/test_flashinfer_backend.py
  rc3=$?
  run_pytest 4 "$((BUDGET - $(elapsed) - 10))" 0 "$(nproc)" tests/engine/test_cuda_families.py
  rc4=$?
  kill "$monitor" 2>/dev/null
  echo "== JIT modules built (time, bytes, path):"
  find ~/.cache/flashinfer -name '*.so' -printf '%TT %s %p\n' 2>/dev/null | sort
  echo "== done in $(elapsed)s: phase exits $rc1 $rc2 $rc3 $rc4"
  return $((rc1 || rc2 || rc3 || rc4))
}

main 2>&1 | tee "$OUT/gpu_log.txt"
exit "${PIPESTATUS[0]}"
