#!/usr/bin/env bash
# On a GPU machine (torch with CUDA installed, possibly no package index):
# builds and installs aoti-sessions with CUDA, runs every test suite there
# (CPU and GPU variants, GoogleTest with its CUDA cases) and the benchmarks,
# writing logs and bench/results/sessions.md. Wheels and GoogleTest come from .deps/
# when present (bench/fetch_gpu_deps.sh makes it). Logs go to $OUT (default
# build/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build/gpu}
mkdir -p "$OUT"
# AOTI models built with the default /opt/gcc toolchain link libstdc++
# statically and crash on load (docs/aoti-runtime.md): use the system compiler.
export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export AOTI_SESSIONS_CACHE=${AOTI_SESSIONS_CACHE:-$PWD/build/gpu-cache}
export AOTI_SESSIONS_ALL_FAMILIES=${AOTI_SESSIONS_ALL_FAMILIES:-1}  # every family's tests (tests/llm_models.py)
export PYTHONUNBUFFERED=1
if [ -d .deps/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/ais-site .deps/wheels/*.whl
  export PYTHONPATH=/tmp/ais-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d .deps/gtest ]; then
  export CMAKE_PREFIX_PATH=$PWD/.deps/gtest/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
fi
stage=${1:-all}  # all | test | some | bench | weights | lifecycle | serve | pool
status=0

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/machine.txt"

python3 -m pip install -q --no-build-isolation --no-deps --no-compile . 2>&1 | tail -3
python3 -c "import aoti_sessions._core as c; assert c.built_with_cuda(), 'built without CUDA'"
if [ "$stage" = all ] || [ "$stage" = test ]; then
  # Compile the test models in parallel first (the suite compiles one at a time).
  python3 bench/warm_test_models.py --devices cpu cuda --jobs 12 > "$OUT/warm.log" 2>&1 || status=$?
  # A failing test must not keep the benchmarks from running: report it at the end.
  python3 -m pytest tests -m "not registry and not clang" -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" || status=$?
fi
if [ "$stage" = some ]; then
  # Chosen test files only (TESTS="tests/test_a.py ..."), models compiled as needed.
  python3 -m pytest $TESTS -m "not registry and not clang" -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" || status=$?
fi
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  python3 bench/bench_switch.py --device cuda 2>&1 | tee "$OUT/bench_switch.txt"
  python3 bench/bench_sessions.py --out bench/results/sessions.md 2>&1 | tee "$OUT/bench_sessions.txt"
  cp bench/results/sessions.md "$OUT/sessions.md"
  python3 bench/bench_sessions.py --suite graphs --out bench/results/graphs.md 2>&1 | tee "$OUT/bench_graphs.txt"
  cp bench/results/graphs.md "$OUT/" 2>/dev/null || true
fi
if [ "$stage" = all ] || [ "$stage" = weights ]; then
  python3 bench/bench_weights.py --out bench/results/weights.md 2>&1 | tee "$OUT/bench_weights.txt" || status=$?
  cp bench/results/weights.md "$OUT/" 2>/dev/null || true
fi
if [ "$stage" = all ] || [ "$stage" = lifecycle ]; then
  # Session files go to the repository's disk, not a RAM-backed /tmp.
  mkdir -p build/disk
  python3 bench/bench_lifecycle.py --disk-dir build/disk --out bench/results/lifecycle.md 2>&1 \
    | tee "$OUT/bench_lifecycle.txt" || status=$?
  cp bench/results/lifecycle.md "$OUT/" 2>/dev/null || true
fi
if [ "$stage" = all ] || [ "$stage" = serve ]; then
  # The chat server under multi-turn load and transformers' generate at
  # B = each chat count (CHATS, TURNS, ROUNDS to shorten it; ANCHOR=--no-anchor
  # skips transformers, whose compile takes a while per B).
  python3 bench/bench_serve.py --device cuda --chats "${CHATS:-1,4,16,64}" --turns "${TURNS:-8}" \
    --rounds "${ROUNDS:-3}" "${ANCHOR:---anchor}" --out bench/results/serve_cuda.md 2>&1 \
    | tee "$OUT/bench_serve.txt" || status=$?
  cp bench/results/serve_cuda.md "$OUT/" 2>/dev/null || true
fi
if [ "$stage" = pool ]; then
  # Batched decode over pooled state, one model family after another
  # (FAMILIES to choose, ROWS and ROUNDS to shorten it; DTYPE=float32 for
  # another dtype than bf16). Not part of "all".
  for family in ${FAMILIES:-qwen3 qwen3_moe gpt_oss qwen3_next qwen3_5_moe lfm2 mamba2}; do
    python3 bench/bench_pool.py --device cuda --family "$family" --rows "${ROWS:-1,2,4,8,16,32,64}" \
      --rounds "${ROUNDS:-3}" ${DTYPE:+--dtype "$DTYPE"} --out "$OUT/RESULTS_pool_${family}_cuda.md" 2>&1 \
      | tee "$OUT/bench_pool_$family.txt" || status=$?
  done
fi
exit $status
