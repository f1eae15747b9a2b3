# Sourced by the one-call GPU scripts (bench/gpu_agents.sh, bench/gpu_families.sh, bench/gpu_decode.sh):
# from the repo root, $OUT made, the system compiler (docs/aoti-runtime.md), the tests' package cache outside the carried tree,
# the wheels of .deps/wheels (bench/fetch_gpu_deps.sh) on the path, the machine written to $OUT/machine.txt,
# and aoti_sessions built with CUDA and installed (the script exits where it is not).
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# Once a call: a script sourcing this after another one did (a call running two) finds it done.
[ -n "${AIS_GPU_SETUP_DONE:-}" ] && return 0
OUT=${OUT:-$PWD/build/gpu}
mkdir -p "$OUT"
export OUT CXX=/usr/bin/g++ CC=/usr/bin/gcc PYTHONUNBUFFERED=1
export AOTI_SESSIONS_CACHE=${AOTI_SESSIONS_CACHE:-/tmp/ais-cache}
# Every family's tests, not only those of every CPU run (tests/llm_models.py EVERY_RUN).
export AOTI_SESSIONS_ALL_FAMILIES=${AOTI_SESSIONS_ALL_FAMILIES:-1}
if [ -d .deps/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/ais-site .deps/wheels/*.whl \
    > /dev/null 2>&1
  export PYTHONPATH=/tmp/ais-site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; git log --oneline -1 2>/dev/null; } | tee "$OUT/machine.txt"
python3 -m pip install -q --no-build-isolation --no-deps --no-compile . 2>&1 | tail -3
python3 -c "import aoti_sessions._core as c; assert c.built_with_cuda(), 'built without CUDA'" || exit 1
export AIS_GPU_SETUP_DONE=1
