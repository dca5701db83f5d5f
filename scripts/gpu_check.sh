#!/usr/bin/env bash
# One command on a fresh GPU machine (an H200: Python 3.12, jax for CUDA, no network), from the project's root:
#   bash scripts/gpu_check.sh          (under 10 minutes; on a machine without a GPU it says so and exits)
# Prints: (a) jax's device and memory; (b) the compiled Triton and Mosaic GPU kernels against the float64 oracle and
# the XLA reference on the test configurations and a pool past 4 GiB, then the cuda lowering tests, then the grouped
# (W4A16 / W8A16 / FP8-block) matmul kernel against a float64 oracle and timed beside XLA's dots; (c)
# scripts/bench_kernels.py (each kernel's time and HBM bandwidth per step kind); (d) decode steps of Llama-1B- and
# 8B-shaped random-weight models at 1/64/256 sequences beside the HBM floor, with each GPU kernel, and one engine's
# warm-up and throughput; (e) the CPU matmul's AMX tiles, where the host CPU has them.
# Stage (d) needs flax: where it is missing, the wheels of scripts/gpu_wheels.sh (carried in wheels/) are used.
# Env: PYTHON (default python3), OUT (one log per stage, default ./gpu_check_out), BUDGET_S (default 560),
#      DRY_RUN=1 (a CPU check of the plumbing: tiny sizes, interpreted kernel; its figures mean nothing).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-$PWD/gpu_check_out}
BUDGET_S=${BUDGET_S:-560}
DRY=${DRY_RUN:-0}
START=$(date +%s)
mkdir -p "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS="ignore::DeprecationWarning"  # jax 0.11 warns that Pallas' Triton backend is deprecated

stage() {  # stage NAME SECONDS CMD...: CMD under a timeout clipped to the budget left, logged to $LOG/NAME.log
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET_S - ($(date +%s) - START)))
  if ((left < 15)); then echo "### $name: skipped (budget spent)"; return; fi
  ((limit > left)) && limit=$left
  echo "### $name (limit ${limit} s)"
  local t0
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$LOG/$name.log" | grep -v -e "^WARNING: All log messages" -e "^I0000"
  local rc=${PIPESTATUS[0]}
  echo "### $name: rc=$rc ($(($(date +%s) - t0)) s)$([ "$rc" = 124 ] && echo ', timed out')"
}

backend=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo "none (jax does not import)")
if [ "$backend" != gpu ] && [ "$DRY" != 1 ]; then
  echo "gpu_check: no GPU here (jax backend: $backend); nothing to check"
  exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
stage a_device 60 "$PY" -c "
import jax, jaxlib
d = jax.devices()[0]
stats = d.memory_stats() or {}
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, '|', d.device_kind, '| compute capability',
      getattr(d, 'compute_capability', '-'), '| memory limit %.1f GiB' % (stats.get('bytes_limit', 0) / 2**30))
"

if [ "$DRY" = 1 ]; then
  stage b_kernel 300 "$PY" scripts/gpu_kernel_check.py --interpret --configs 1 --no-big-pool --impls triton
else
  stage b_kernel 120 "$PY" scripts/gpu_kernel_check.py
fi
stage b_lowering 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas_lowering.py tests/test_mosaic_gpu_attention.py
if [ "$DRY" = 1 ]; then
  stage b_grouped 120 "$PY" scripts/gpu_grouped_check.py --interpret --small --rows 1,16 --repeats 1
else
  stage b_grouped 90 "$PY" scripts/gpu_grouped_check.py
fi

if [ "$DRY" = 1 ]; then
  stage c_bench_kernels 120 "$PY" scripts/bench_kernels.py --small --repeats 2
else
  stage c_bench_kernels 90 "$PY" scripts/bench_kernels.py --repeats 10
fi

if ! "$PY" -c "import flax" 2>/dev/null; then
  if ls wheels/flax-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$LOG/site" wheels/*.whl
    export PYTHONPATH="$PYTHONPATH:$LOG/site"
  else
    echo "### d: flax missing and no wheels/ (run scripts/gpu_wheels.sh and carry wheels/)"
  fi
fi
if [ "$DRY" = 1 ]; then
  stage d_decode_and_engine 300 "$PY" scripts/bench_gpu_decode.py --decode tiny --engine tiny --batches 1,8 \
    --context 64 --requests 8 --prompt-len 16 --output-len 8
else
  stage d_decode 260 "$PY" scripts/bench_gpu_decode.py --decode llama1b,llama8b --engine "" --attention triton,mosaic_gpu
  stage d_engine 150 "$PY" scripts/bench_gpu_decode.py --decode "" --engine llama1b
fi
# (e) the host CPU. Where it has AMX (Sapphire Rapids and later; no development machine so far has), the matmul
# kernel's tile path on real tiles: its tests, then tiles against vdpbf16ps (the same source with the tiles
# compiled out) in one process.
grep -m1 'model name' /proc/cpuinfo
if grep -qw amx_bf16 /proc/cpuinfo; then
  sed 's/^#define JPAGED_MATMUL_AMX 1.*/#undef JPAGED_MATMUL_AMX/' jpaged/pallas/cpu/matmul.cc >"$LOG/matmul_no_tiles.cc"
  JAX_PLATFORMS=cpu stage e_amx_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cpu_matmul.py
  JAX_PLATFORMS=cpu stage e_amx_ab 150 "$PY" scripts/ab_cpu_kernels.py matmul "$LOG/matmul_no_tiles.cc" \
    jpaged/pallas/cpu/matmul.cc --dtype bfloat16 --rows 1,8,64,512
else
  echo "### e: no AMX on this host CPU"
fi
echo "### done in $(($(date +%s) - START)) s; logs in $LOG"
