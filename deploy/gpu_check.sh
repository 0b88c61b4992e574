#!/usr/bin/env bash
# Everything a CPU machine cannot check, in one run on a machine with an NVIDIA GPU, from the
# repo root:  bash deploy/gpu_check.sh          (GPU_CHECK_DRY_RUN=1: print the plan, run nothing)
#
# Installs the wheels in .whl/ (flashinfer-python, apache-tvm-ffi, gguf, redis, openai: what the
# checks need beyond an image with torch, transformers, numpy, pytest) into /tmp/site, restores
# a flashinfer JIT cache if .whl/flashinfer-jit-cache.tar.gz exists (GPU_CHECK_SAVE_JIT=1 writes
# one to $OUT after the run: carry it to .whl/ to skip nvcc next time), reports the machine and
# the cold start, then runs four phases, each with its share of GPU_CHECK_BUDGET_S (default 480
# s = 8 min; a phase also gets what earlier phases left unused):
#   a (38%): today's engine and kernel tests: tests/engine/test_cuda_engine.py, the real CUDA
#            graph tests (decode and speculative verification) and the staged-transfer test,
#            the flashinfer kernels (bf16 first: their JIT
#            builds overlap under pytest-xdist, then the rest)
#   b (17%): `halfmoon serve --device cuda` 1P1D sharing the GPU, greedy completions through the
#            openai client identical to transformers on CUDA, the KV path (bench/gpu_serve_check.py)
#   c (30%): `halfmoon bench engine --device cuda` (bf16, torch attention: the backend CUDA graphs
#            capture; graphs on / off vs transformers bf16 on the same GPU), then the layer-pipelined
#            transfer from device memory (its path, the share of the transfer hidden)
#   d (15%): every model family and speculative decoding on CUDA; the tensor-parallel
#            collectives on NCCL (tests/engine/test_cuda_tp.py: one rank, and two ranks on one GPU)
# A step still running at its limit is interrupted (its output is kept); a step with under 30 s
# is skipped. Everything goes to $OUT/gpu_log.txt (OUT: /tmp/gpu_check) with JUnit XML per
# pytest step, each phase's JSON, and $OUT/gpu_summary.json (bench/gpu_summary.py) to quote.
set -uo pipefail

OUT=${OUT:-/tmp/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
DRY=${GPU_CHECK_DRY_RUN:-0}
PHASES=(a b c d)
declare -A SHARE=([a]=38 [b]=17 [c]=30 [d]=15)
mkdir -p "$OUT"

# seconds since start; a dry run keeps a virtual clock on which every step takes its whole limit
elapsed() { if [[ $DRY == 1 ]]; then echo "$DRY_T"; else echo $((SECONDS - START)); fi; }
DRY_T=0

# phase_limit P: P's share of the budget plus what earlier phases left, within what is left.
phase_limit() {
  local p=$1 before=0 q
  for q in "${PHASES[@]}"; do
    [[ $q == "$p" ]] && break
    before=$((before + BUDGET * SHARE[$q] / 100))
  done
  local own=$((BUDGET * SHARE[$p] / 100)) left=$((BUDGET - $(elapsed)))
  local carry=$((before - $(elapsed)))
  ((carry < 0)) && carry=0
  local limit=$((own + carry))
  echo $((limit < left ? limit : left))
}

record() {  # record STEP BUDGET START_T EXIT: one line of phases.tsv (exit -1: skipped)
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(($(elapsed) - $3))" "$4" >>"$OUT/phases.tsv"
}

jit_monitor() {  # every 30 s: elapsed time, compiler processes, JIT modules built so far
  while sleep 30 </dev/null >/dev/null 2>&1; do  # sleep must not hold tee's pipe open
    echo "[monitor t=$(elapsed)s] nvcc/cicc/ptxas running: $(pgrep -c 'nvcc|cicc|ptxas' || true);" \
      "JIT modules built: $(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)"
  done
}

# step NAME LIMIT CMD...: CMD interrupted (SIGINT, then KILL) after LIMIT s; skipped under 30 s.
step() {
  local name=$1 limit=$2 t0
  shift 2
  t0=$(elapsed)
  if ((limit < 30)); then
    echo "== $name skipped: ${limit}s left"
    record "$name" "$limit" "$t0" -1
    return 0
  fi
  echo "== $name (limit ${limit}s, t=$(elapsed)s): $*"
  if [[ $DRY == 1 ]]; then DRY_T=$((DRY_T + limit)); record "$name" "$limit" "$t0" 0; return 0; fi
  timeout -s INT -k 20 "$limit" "$@"
  local rc=$?
  echo "== $name exit $rc (t=$(elapsed)s)"
  record "$name" "$limit" "$t0" "$rc"
  return $rc
}

# pytest_step NAME LIMIT WORKERS JOBS ARGS...: pytest with WORKERS xdist workers (0: none), each
# JIT build running JOBS compilers, JUnit XML to $OUT/junit-NAME.xml.
pytest_step() {
  local name=$1 limit=$2 workers=$3 jobs=$4
  shift 4
  local xdist=()
  if ((workers > 0)) && python3 -c 'import xdist' 2>/dev/null; then xdist=(-n "$workers"); fi
  MAX_JOBS=$jobs step "$name" "$limit" python3 -m pytest -p no:cacheprovider --noconftest -v -rs \
    --timeout "$((limit > 420 ? 420 : limit))" --durations=10 "${xdist[@]}" \
    --junitxml "$OUT/junit-$name.xml" "$@"
}

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed"; return 1; }
  if [[ -f .whl/flashinfer-jit-cache.tar.gz ]]; then
    mkdir -p ~/.cache && tar -xzf .whl/flashinfer-jit-cache.tar.gz -C ~/.cache && echo "JIT cache restored"
  fi
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
  SETUP_S=$(elapsed) python3 - "$OUT/cold_start.json" <<'EOF' || { echo "import check failed"; return 1; }
import json, os, sys, time
t = time.time()
import torch, transformers
t_import = time.time() - t
t = time.time()
gpu = (f"{torch.cuda.get_device_name(0)} sm{torch.cuda.get_device_capability(0)}"
       if torch.cuda.is_available() else "NO CUDA DEVICE (the CUDA checks will skip or fail)")
torch.zeros(1, device="cuda") if torch.cuda.is_available() else None
t_cuda = time.time() - t
t = time.time()
import flashinfer, tvm_ffi
t_fi = time.time() - t
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", gpu, "| transformers", transformers.__version__)
print("flashinfer", flashinfer.__version__, "tvm_ffi", tvm_ffi.__version__, f"(import {t_fi:.1f}s)")
cold = {"gpu": gpu, "install_s": int(os.environ["SETUP_S"]), "torch_import_s": round(t_import, 1),
        "cuda_init_s": round(t_cuda, 1), "flashinfer_import_s": round(t_fi, 1)}
json.dump(cold, open(sys.argv[1], "w"))
print("cold start:", cold)
EOF
}

phase_a() {
  local end=$(($(elapsed) + $(phase_limit a))) rc=0
  pytest_step a1 "$((end - $(elapsed) - 90))" 0 "$(nproc)" tests/engine/test_cuda_engine.py \
    tests/engine/test_cuda_graphs.py::test_cuda_graphs_match_eager_on_cuda \
    tests/engine/test_cuda_graphs.py::test_cuda_verification_graphs_match_eager_on_cuda \
    tests/transport/test_staging.py::test_cuda_staged_transfer || rc=1
  pytest_step a2 "$((end - $(elapsed) - 40))" 3 6 -k "dtype1 or write_kv" \
    tests/kernels/test_flashinfer_backend.py || rc=1
  pytest_step a3 "$((end - $(elapsed)))" 6 4 -k "not (dtype1 or write_kv)" \
    tests/kernels/test_flashinfer_backend.py || rc=1
  return $rc
}

phase_b() {
  step b "$(phase_limit b)" python3 -m bench.gpu_serve_check --out "$OUT/serve.json"
}

phase_c() {
  local end=$(($(elapsed) + $(phase_limit c))) rc=0
  step c1 "$((end - $(elapsed) - 60))" sh -c "python3 -m halfmoon.cli.main bench engine --device cuda --dtype bfloat16 \
    --attention-backend torch --quick --json > '$OUT/bench_engine_cuda.json'" || rc=1
  step c2 "$((end - $(elapsed)))" sh -c "python3 -m bench.transport_bench --skip throughput --device cuda \
    --lengths 512,2048 --repeats 1 --json > '$OUT/transport_cuda.json'" || rc=1
  return $rc
}

phase_d() {
  pytest_step d "$(phase_limit d)" 0 "$(nproc)" tests/engine/test_cuda_families.py \
    tests/engine/test_cuda_graphs.py::test_cuda_speculative_matches_plain_greedy tests/engine/test_cuda_tp.py
}

main() {
  START=$SECONDS
  : >"$OUT/phases.tsv"
  echo "== gpu_check: budget ${BUDGET}s, shares a ${SHARE[a]}% b ${SHARE[b]}% c ${SHARE[c]}% d ${SHARE[d]}%" \
    "$([[ $DRY == 1 ]] && echo '(dry run: nothing is executed)')"
  if [[ $DRY != 1 ]]; then
    setup || return 1
    jit_monitor & local monitor=$!
  fi
  local rc=0 p
  for p in "${PHASES[@]}"; do
    "phase_$p" || rc=1
  done
  if [[ $DRY != 1 ]]; then
    kill "$monitor" 2>/dev/null
    echo "== JIT modules built (time, bytes, path):"
    find ~/.cache/flashinfer -name '*.so' -printf '%TT %s %p\n' 2>/dev/null | sort
    [[ ${GPU_CHECK_SAVE_JIT:-0} == 1 ]] && tar -czf "$OUT/flashinfer-jit-cache.tar.gz" -C ~/.cache flashinfer
    python3 -m bench.gpu_summary "$OUT" || rc=1
  fi
  echo "== done in $(elapsed)s: exit $rc"
  return $rc
}

main 2>&1 | tee "$OUT/gpu_log.txt"
exit "${PIPESTATUS[0]}"
