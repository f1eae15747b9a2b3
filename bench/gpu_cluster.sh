#!/usr/bin/env bash
# The cluster's GPU figures (issue 21, bench/bench_cluster.py) on a 2-GPU machine without a package index, in
# two consecutive device calls on one warm machine (ray's wheel does not fit one call). Here, first:
# bench/fetch_gpu_deps.sh --cluster. Then, with nothing between the calls (the machine goes back ~30 s idle):
#   call 1: STAGE=1 bash bench/gpu_cluster.sh   kind nvidia-h100-x2, carry [.deps/gpu-base, .deps/cluster-1]:
#           wheels, the build, the bench model compiled (~5 min)
#   call 2: STAGE=2 bash bench/gpu_cluster.sh   NO kind (a call naming another kind, even the one the first
#           moved to, gets a bare machine), carry [.deps/cluster-2]: ray, then bench_cluster per load in RUNS
#           (CHATS:TOKENS:TURNS ..., default "32:128:4": about 300 s on 2 x H100, so one load a call under
#           LIMIT_S, 570 s); BENCH_ARGS passes more options. Further calls of STAGE=2 right after it (no
#           kind, no carry) find ray installed and run their RUNS.
# Results under $OUT: RESULTS_cluster_cuda_c<chats>_t<tokens>.md (written after each phase) and the logs.
set -u
cd "$(dirname "$0")/.."
# AOTI models built with the default /opt/gcc toolchain crash on load (docs/aoti-runtime.md): the system compiler.
export CXX=/usr/bin/g++ CC=/usr/bin/gcc PYTHONUNBUFFERED=1 AOTI_SESSIONS_CACHE=$PWD/build/gpu-cache
# Two install folders: pip --target does not merge a package folder that is already there (ray's dependencies
# share namespace packages, opentelemetry, with the base wheels).
export PYTHONPATH=$PWD/build/site-ray:$PWD/build/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
  python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
if [ "${STAGE:-}" = 1 ]; then
  t0=$(date +%s)
  mkdir -p build/raywheel && cp .deps/cluster-1/ray.part1 build/raywheel/
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target build/site .deps/gpu-base/*.whl \
    > "$OUT/deps.log" 2>&1
  python3 -m pip install -q --no-build-isolation --no-deps --no-compile . > "$OUT/build.log" 2>&1
  python3 -c "import sys; sys.path.insert(0, 'bench'); import bench_serve; print(bench_serve.bench_package('cuda'))" \
    > "$OUT/bench_package.log" 2>&1
  echo "stage 1: $(( $(date +%s) - t0 )) s" >> "$OUT/machine.txt"
elif [ "${STAGE:-}" = 2 ]; then
  t0=$(date +%s)
  [ -f build/raywheel/ray.part1 ] || { echo "a bare machine: call 1's build is not here" | tee "$OUT/bare.txt"; exit 3; }
  if [ ! -d build/site-ray/ray ]; then  # (a later call on the same machine finds it installed)
    name=$(cut -d' ' -f3 .deps/cluster-2/ray.sha256)
    cat build/raywheel/ray.part1 .deps/cluster-2/ray.part2 > "build/raywheel/$name"
    (cd build/raywheel && sha256sum -c ../../.deps/cluster-2/ray.sha256) > "$OUT/ray_sha.txt" 2>&1 || exit 4
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target build/site-ray \
      "build/raywheel/$name" .deps/cluster-2/*.whl > "$OUT/ray_install.log" 2>&1
  fi
  python3 -c "import ray, ray.serve, ray.dashboard.optional_deps; print('ray', ray.__version__)" >> "$OUT/machine.txt" 2>&1
  # RUNS: the loads, each CHATS:TOKENS:TURNS (chats at once, tokens a turn, turns a chat).
  for spec in ${RUNS:-32:128:4}; do
    IFS=: read -r chats tokens turns <<< "$spec"
    left=$(( ${LIMIT_S:-570} - ($(date +%s) - t0) ))
    [ "$left" -lt 90 ] && { echo "$spec: not run, $left s left" >> "$OUT/machine.txt"; break; }
    name="c${chats}_t${tokens}"
    timeout "$left" python3 bench/bench_cluster.py --device cuda --rounds "${ROUNDS:-3}" --chats "$chats" \
      --turns "$turns" --tokens "$tokens" --replicas 1,2 --affinity-replicas "" --requests "${REQUESTS:-30}" \
      --no-serve-defaults --overhead-rounds "${OVERHEAD_ROUNDS:-10}" ${BENCH_ARGS:-} --out "$OUT/RESULTS_cluster_cuda_$name.md" > "$OUT/bench_cluster_$name.log" 2>&1
    echo "bench_cluster rc $? at $(( $(date +%s) - t0 )) s" >> "$OUT/bench_cluster_$name.log"
  done
else
  echo "STAGE=1 or STAGE=2 (see the head of this file)" >&2; exit 2
fi
